//! End-to-end tests of the `eval` binary and of `classify --show-pruning` on a generated labelled
//! folder and a generated tiny checkpoint (no network).

mod common;

use common::{assert_ok, assert_one_line_error, s, write_random_checkpoint};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use image::{ImageFormat, Rgb, RgbImage};
use models::DeiTConfig;

const CLASSES: usize = 10;
/// ImageNet-1k classes 0, 1, 2.
const WNIDS: [&str; 3] = ["n01440764", "n01443537", "n01484850"];

struct Fixture {
    _dir: tempfile::TempDir,
    root: PathBuf,
    weights: PathBuf,
    data: PathBuf,
    /// Decodable images in eval's order (class folder, then name) with their labels.
    images: Vec<(PathBuf, usize)>,
}

/// A tiny random 4-block checkpoint (pruning at blocks 1, 2, 3) and a folder of 3 classes with
/// PNG and JPEG images and one corrupt JPEG.
fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    let cfg = DeiTConfig::custom(96, 4, 3, CLASSES, false);
    let weights = root.join("tiny.safetensors");
    write_random_checkpoint(&cfg, &weights);
    let data = root.join("data");
    let mut images = Vec::new();
    for (label, wnid) in WNIDS.iter().enumerate() {
        let d = data.join(wnid);
        std::fs::create_dir_all(&d).unwrap();
        for (k, (ext, fmt)) in [("jpg", ImageFormat::Jpeg), ("png", ImageFormat::Png)]
            .into_iter()
            .enumerate()
        {
            let i = (label * 2 + k) as u32;
            let img = RgbImage::from_fn(240 + 10 * i, 230, |x, y| {
                Rgb([
                    (x * (3 + i)) as u8,
                    (y * (2 + label as u32)) as u8,
                    ((x * y) / (5 + i)) as u8,
                ])
            });
            let p = d.join(format!("img{i}.{ext}"));
            img.save_with_format(&p, fmt).unwrap();
            images.push((p, label));
        }
    }
    std::fs::write(
        data.join(WNIDS[2]).join("broken.jpg"),
        b"\xff\xd8\xff\xe0 not really a jpeg",
    )
    .unwrap();
    images.sort();
    Fixture {
        _dir: dir,
        root,
        weights,
        data,
        images,
    }
}

fn run(bin: &str, args: &[&str]) -> Output {
    Command::new(bin).args(args).output().unwrap()
}

fn local_args(f: &Fixture) -> Vec<&str> {
    vec!["--weights", s(&f.weights), "--infer-arch", "--heads", "3"]
}

/// Top-k class indices of every image, from `classify --json`.
fn classify_top(f: &Fixture, k: usize, extra: &[&str]) -> Vec<Vec<usize>> {
    let mut args = local_args(f);
    let k = k.to_string();
    args.extend(["--json", "--top-k", &k]);
    args.extend(extra);
    args.extend(f.images.iter().map(|(p, _)| s(p)));
    let out = run(env!("CARGO_BIN_EXE_classify"), &args);
    assert_ok(&out);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|img| {
            img["top_k"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| p["index"].as_u64().unwrap() as usize)
                .collect()
        })
        .collect()
}

#[test]
fn eval_folder_matches_classify() {
    let f = fixture();
    let json = f.root.join("out.json");
    let csv = f.root.join("out.csv");
    let chart = f.root.join("chart.svg");
    let mut args = local_args(&f);
    args.extend([
        s(&f.data),
        "--settings",
        "none,none,evit:ragged,evit:padded",
        "--batch-size",
        "2",
        "--workers",
        "2",
        "--json",
        s(&json),
        "--csv",
        s(&csv),
        "--chart",
        s(&chart),
    ]);
    let out = run(env!("CARGO_BIN_EXE_eval"), &args);
    assert_ok(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("broken.jpg"), "{stderr}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    for key in [
        "model",
        "device",
        "dtype",
        "images",
        "skipped",
        "loader_img_s",
        "settings",
        "comparisons",
    ] {
        assert!(v.get(key).is_some(), "no {key} in {v}");
    }
    assert_eq!(v["device"], "cpu");
    assert_eq!(v["dtype"], "f32");
    assert_eq!(v["images"], f.images.len());
    let skipped = v["skipped"].as_array().unwrap();
    assert_eq!(skipped.len(), 1);
    assert_eq!(v["skipped_count"], 1);
    assert!(skipped[0]["name"].as_str().unwrap().ends_with("broken.jpg"));
    assert!(!skipped[0]["reason"].as_str().unwrap().is_empty());
    assert!(v["loader_img_s"].as_f64().unwrap() > 0.0);

    // Accuracy against a count by hand from classify's predictions.
    let n = f.images.len() as f64;
    let dense_top5 = classify_top(&f, 5, &[]);
    let dense_top1 = dense_top5.iter().map(|t| t[0]).collect::<Vec<_>>();
    let hits1 = f
        .images
        .iter()
        .zip(&dense_top1)
        .filter(|((_, l), p)| l == *p)
        .count();
    let hits5 = f
        .images
        .iter()
        .zip(&dense_top5)
        .filter(|((_, l), p)| p.contains(l))
        .count();
    let pruned_top1 = classify_top(&f, 1, &["--pruner", "evit"]);
    let hits_pruned = f
        .images
        .iter()
        .zip(&pruned_top1)
        .filter(|((_, l), p)| *l == p[0])
        .count();

    let settings = v["settings"].as_array().unwrap();
    let names: Vec<&str> = settings
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["none", "none#2", "evit-fixed:ragged", "evit-fixed:padded"]
    );
    for st in settings {
        for key in ["pruner", "mode", "path", "top1", "top5", "img_s"] {
            assert!(st.get(key).is_some(), "no {key} in {st}");
        }
        assert!(st["img_s"].as_f64().unwrap() > 0.0);
        let expected1 = if st["pruner"] == "none" {
            hits1
        } else {
            hits_pruned
        };
        assert!(
            (st["top1"].as_f64().unwrap() - 100.0 * expected1 as f64 / n).abs() < 1e-9,
            "{st}"
        );
        let kept = st["mean_kept_tokens_per_stage"].as_array().unwrap();
        if st["pruner"] == "none" {
            assert!(
                (st["top5"].as_f64().unwrap() - 100.0 * hits5 as f64 / n).abs() < 1e-9,
                "{st}"
            );
            assert!(kept.is_empty());
        } else {
            // Blocks 1, 2, 3; EViT keeps ceil(0.7 n) of the n non-class tokens (the previous
            // fused token included) + the class and a new fused token: 196 → 138, 139 → 98,
            // 99 → 70.
            let k: Vec<f64> = kept.iter().map(|x| x.as_f64().unwrap()).collect();
            assert_eq!(k, [1.0 + 138.0 + 1.0, 1.0 + 98.0 + 1.0, 1.0 + 70.0 + 1.0]);
        }
    }

    let comps = v["comparisons"].as_array().unwrap();
    let find = |a: &str, b: &str| {
        comps
            .iter()
            .find(|c| c["a"] == a && c["b"] == b)
            .unwrap_or_else(|| panic!("no comparison {a} vs {b} in {comps:?}"))
    };
    let same = find("none", "none#2");
    assert_eq!(same["max_abs_dlogit"].as_f64().unwrap(), 0.0);
    assert_eq!(same["mean_abs_dlogit"].as_f64().unwrap(), 0.0);
    assert_eq!(same["top1_agreement"].as_f64().unwrap(), 100.0);
    let pruned = find("none", "evit-fixed:ragged");
    assert!(pruned["max_abs_dlogit"].as_f64().unwrap() > 0.0, "{pruned}");
    assert!(
        pruned["mean_abs_dlogit"].as_f64().unwrap() > 0.0,
        "{pruned}"
    );
    let paths = find("evit-fixed:padded", "evit-fixed:ragged");
    assert!(paths["max_abs_dlogit"].as_f64().unwrap() < 1e-3, "{paths}");

    let csv = std::fs::read_to_string(&csv).unwrap();
    assert_eq!(csv.lines().count(), 1 + 4, "{csv}");
    let svg = std::fs::read_to_string(&chart).unwrap();
    assert!(svg.contains("<svg") && svg.contains("evit-fixed"), "{svg}");
}

#[test]
fn eval_csv_list_and_limit() {
    let f = fixture();
    let list = f.root.join("list.tsv");
    let mut text = String::from("path\tlabel\n");
    for (p, l) in &f.images {
        let rel = p.strip_prefix(&f.root).unwrap();
        // Labels alternate between index and WordNet id.
        let label = if l % 2 == 0 {
            l.to_string()
        } else {
            WNIDS[*l].to_string()
        };
        text.push_str(&format!("{}\t{label}\n", rel.display()));
    }
    std::fs::write(&list, text).unwrap();
    let json = f.root.join("list.json");
    let mut args = local_args(&f);
    args.extend([
        s(&list),
        "--settings",
        "none",
        "--limit",
        "4",
        "--json",
        s(&json),
    ]);
    let out = run(env!("CARGO_BIN_EXE_eval"), &args);
    assert_ok(&out);
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["images"], 4);
    assert_eq!(v["skipped_count"], 0);
    let top1 = classify_top(&f, 1, &[]);
    let hits = f.images[..4]
        .iter()
        .zip(&top1)
        .filter(|((_, l), p)| *l == p[0])
        .count();
    assert_eq!(
        v["settings"][0]["top1"].as_f64().unwrap(),
        100.0 * hits as f64 / 4.0
    );
}

#[test]
fn eval_bad_datasets_are_one_line_errors() {
    let f = fixture();
    let eval = env!("CARGO_BIN_EXE_eval");
    let with = |data: &Path| {
        let mut args = local_args(&f);
        args.extend([s(data), "--settings", "none"]);
        run(eval, &args)
    };
    let empty = f.root.join("empty");
    std::fs::create_dir(&empty).unwrap();
    assert_one_line_error(&with(&empty), &["no class sub-folders"]);

    let no_images = f.root.join("no_images");
    std::fs::create_dir_all(no_images.join(WNIDS[0])).unwrap();
    std::fs::write(no_images.join(WNIDS[0]).join("notes.txt"), "x").unwrap();
    assert_one_line_error(&with(&no_images), &["no images"]);

    let unknown = f.root.join("unknown");
    std::fs::create_dir_all(unknown.join("cats")).unwrap();
    assert_one_line_error(&with(&unknown), &["unknown label `cats`"]);
    let too_big = f.root.join("too_big");
    std::fs::create_dir_all(too_big.join("10")).unwrap();
    assert_one_line_error(&with(&too_big), &["unknown label `10`"]);

    assert_one_line_error(&with(&f.root.join("missing")), &["missing"]);
    let mut args = local_args(&f);
    args.extend([s(&f.data), "--settings", "evit:dense"]);
    assert_one_line_error(&run(eval, &args), &["dense"]);
}

/// A missing dataset fails before any weights are fetched: the Hub is pointed at a closed port
/// with an empty cache, so a download attempt would be the error.
#[test]
fn missing_dataset_fails_before_the_download() {
    let f = fixture();
    let cache = tempfile::tempdir().unwrap();
    let missing = f.root.join("no-such-dataset");
    let out = Command::new(env!("CARGO_BIN_EXE_eval"))
        .args(["--model", "deit-tiny", s(&missing), "--settings", "none"])
        .env("HF_ENDPOINT", "http://127.0.0.1:9")
        .env("HF_HOME", cache.path())
        .output()
        .unwrap();
    assert_one_line_error(&out, &["cannot read dataset", "no-such-dataset"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("download"), "{err}");
}

#[test]
fn show_pruning_shades_dropped_patches() {
    let f = fixture();
    let png = f.root.join("pruning.png");
    let image = &f.images[1].0;
    let mut args = local_args(&f);
    args.extend([
        s(image),
        "--pruner",
        "evit-adaptive",
        "--path",
        "padded",
        "--json",
        "--show-pruning",
        s(&png),
    ]);
    let out = run(env!("CARGO_BIN_EXE_classify"), &args);
    assert_ok(&out);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["pruner"], "evit-adaptive");
    let kept: Vec<usize> = v["images"][0]["kept_patches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k.as_u64().unwrap() as usize)
        .collect();
    assert_eq!(kept.len(), 3);
    assert!(
        kept.windows(2).all(|w| w[0] >= w[1]) && kept[2] < 196,
        "{kept:?}"
    );

    let drawing = image::open(&png).unwrap().to_rgb8();
    assert_eq!(drawing.dimensions(), (224 * 4, 224));
    let (grid, patch) = (14u32, 16u32);
    let mut previous = vec![false; 196];
    for (stage, &kept) in kept.iter().enumerate() {
        let off = 224 * (stage as u32 + 1);
        let mut shaded = vec![false; 196];
        for (p, sh) in shaded.iter_mut().enumerate() {
            let (px, py) = ((p as u32 % grid) * patch, (p as u32 / grid) * patch);
            let mut differs = 0;
            for y in py..py + patch {
                for x in px..px + patch {
                    differs +=
                        usize::from(drawing.get_pixel(x, y) != drawing.get_pixel(off + x, y));
                }
            }
            // A patch is shaded entirely or not at all.
            assert!(differs == 0 || differs == 256, "patch {p}: {differs}");
            *sh = differs == 256;
        }
        assert_eq!(shaded.iter().filter(|s| **s).count(), 196 - kept);
        // Dropped patches stay dropped.
        assert!(previous.iter().zip(&shaded).all(|(a, b)| !a || *b));
        previous = shaded;
    }

    // Several images: the index is appended; no pruner: refused.
    let mut args = local_args(&f);
    args.extend([
        s(&f.images[0].0),
        s(&f.images[1].0),
        "--pruner",
        "threshold-l2",
        "--show-pruning",
        s(&png),
    ]);
    assert_ok(&run(env!("CARGO_BIN_EXE_classify"), &args));
    for i in 0..2 {
        let p = f.root.join(format!("pruning-{i}.png"));
        assert_eq!(
            image::open(&p).unwrap().to_rgb8().dimensions(),
            (224 * 4, 224),
            "{}",
            p.display()
        );
    }
    let mut args = local_args(&f);
    args.extend([s(image), "--show-pruning", s(&png)]);
    assert_one_line_error(&run(env!("CARGO_BIN_EXE_classify"), &args), &["--pruner"]);
}
