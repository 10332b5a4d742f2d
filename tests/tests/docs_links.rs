//! The project's Markdown (README.md and docs/*.md): every relative link names a file that
//! exists, every `#anchor` a heading of its target (GitHub's slugs), and every table row sits on
//! one line (a row broken over lines ends the table where it breaks). The docs are long and
//! edited by hand; this is what keeps their cross-references and their tables whole.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// README.md and the Markdown files under docs/.
fn markdown_files() -> Vec<PathBuf> {
    let mut files = vec![root().join("README.md")];
    let mut dirs = vec![root().join("docs")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// The lines outside fenced code blocks.
fn prose_lines(text: &str) -> Vec<&str> {
    let mut fenced = false;
    text.lines()
        .filter(|l| {
            if l.trim_start().starts_with("```") {
                fenced = !fenced;
                return false;
            }
            !fenced
        })
        .collect()
}

/// GitHub's anchor for a heading: lowercase, code marks and punctuation dropped (letters,
/// digits, `-`, `_` and spaces kept), spaces to hyphens.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a Markdown file's headings (repeats numbered -1, -2, ... as GitHub does).
fn anchors(text: &str) -> HashSet<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut out = HashSet::new();
    for line in prose_lines(text) {
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if !(1..=6).contains(&hashes) || !line[hashes..].starts_with(' ') {
            continue;
        }
        let s = slug(&line[hashes..]);
        let n = seen.entry(s.clone()).or_insert(0);
        out.insert(if *n == 0 {
            s.clone()
        } else {
            format!("{s}-{n}")
        });
        *n += 1;
    }
    out
}

/// The targets of `[text](target)` links in `text`.
fn link_targets(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in prose_lines(text) {
        let mut rest = line;
        while let Some(i) = rest.find("](") {
            rest = &rest[i + 2..];
            let end = rest.find([')', ' ']).unwrap_or(rest.len());
            out.push(rest[..end].to_string());
            rest = &rest[end..];
        }
    }
    out
}

#[test]
fn relative_links_and_anchors_resolve() {
    let files = markdown_files();
    assert!(
        files.len() >= 2,
        "README.md and docs/BENCHMARKS.md at least"
    );
    let mut anchor_cache: HashMap<PathBuf, HashSet<String>> = HashMap::new();
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for target in link_targets(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (path, anchor) = target.split_once('#').unwrap_or((&target, ""));
            let resolved = if path.is_empty() {
                file.clone()
            } else {
                file.parent().unwrap().join(path)
            };
            if !resolved.exists() {
                broken.push(format!("{}: {target} (no such file)", file.display()));
                continue;
            }
            if anchor.is_empty() || resolved.extension().is_none_or(|e| e != "md") {
                continue;
            }
            let known = anchor_cache
                .entry(resolved.clone())
                .or_insert_with(|| anchors(&std::fs::read_to_string(&resolved).unwrap()));
            if !known.contains(anchor) {
                broken.push(format!("{}: {target} (no such heading)", file.display()));
            }
        }
    }
    assert!(checked > 0, "no relative links found: the scan is broken");
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn table_rows_stay_on_one_line() {
    let mut broken = Vec::new();
    for file in markdown_files() {
        let text = std::fs::read_to_string(&file).unwrap();
        for (i, line) in prose_lines(&text).iter().enumerate() {
            if line.starts_with("| ") && !line.trim_end().ends_with('|') {
                broken.push(format!("{}: prose line {}", file.display(), i + 1));
            }
        }
    }
    assert!(
        broken.is_empty(),
        "table rows continued on the next line (the table ends there):\n{}",
        broken.join("\n")
    );
}

#[test]
fn the_checks_catch_what_they_are_for() {
    let doc = "# Top\n## A `code` heading: 1–2 × 3\n## Top\n```\n# not a heading\n```\n";
    let a = anchors(doc);
    assert!(a.contains("top") && a.contains("top-1"), "{a:?}");
    assert!(a.contains("a-code-heading-12--3"), "{a:?}");
    assert!(!a.contains("not-a-heading"));
    assert_eq!(
        link_targets("see [x](a.md#b) and [y](https://e.org) [z](#c)"),
        ["a.md#b", "https://e.org", "#c"]
    );
}
