//! `bench-cpu-ops`: every operation prints one line with its time, GFLOP/s and page faults,
//! and bad arguments are one-line errors.

use std::process::Command;

fn run(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_bench-cpu-ops"))
        .args(args)
        .env("RAYON_NUM_THREADS", "2")
        .output()
        .unwrap()
}

/// One DeiT-T image, one timed call, and `extra`.
fn run_tiny(extra: &[&str]) -> std::process::Output {
    let mut args = vec!["--models", "deit-tiny", "--batch", "1", "--reps", "1"];
    args.extend_from_slice(extra);
    run(&args)
}

#[test]
fn every_operation_prints_its_line() {
    for dtype in ["f32", "bf16"] {
        let out = run_tiny(&["--dtype", dtype]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        for op in [
            "ln", "qkv", "attn", "proj+res", "fc1+gelu", "fc1", "fc2+res", "block",
        ] {
            let line = text
                .lines()
                .find(|l| l.split_whitespace().nth(3) == Some(op))
                .unwrap_or_else(|| panic!("no line for {op} in:\n{text}"));
            assert!(
                line.starts_with(&format!("deit-tiny {dtype} b1 ")),
                "{line}"
            );
            let us: f64 = line.split_whitespace().nth(4).unwrap().parse().unwrap();
            assert!(us > 0.0, "{line}");
        }
        assert!(
            text.contains(&format!("deit-tiny {dtype} b1 block(2 ln)")),
            "{text}"
        );
    }
}

#[test]
fn bad_arguments_are_one_line_errors() {
    for (args, says) in [
        (vec!["--models", "deit-huge"], "unknown model"),
        (vec!["--ops", "attn,softmax"], "unknown operation"),
        (vec!["--reps", "0"], "--reps"),
        (vec!["--batch", "0"], "--batch"),
    ] {
        let out = run(&args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(
            err.starts_with("error: ") && err.contains(says),
            "{args:?}: {err}"
        );
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
    }
}

/// `--amx-ceiling` prints the tile product's GFLOP/s for each depth on one thread and on every
/// core where the CPU has AMX, and is a one-line error where it has none.
#[test]
fn amx_ceiling_prints_its_lines_or_says_why_not() {
    let out = run_tiny(&["--amx-ceiling", "--ops", "ln"]);
    if out.status.success() {
        let text = String::from_utf8(out.stdout).unwrap();
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("amx-ceiling"))
            .collect();
        assert_eq!(lines.len(), 6, "{text}");
        for line in lines {
            let gflops: f64 = line.split_whitespace().nth(5).unwrap().parse().unwrap();
            assert!(gflops > 0.0, "{line}");
        }
    } else {
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(
            err.starts_with("error: --amx-ceiling: ") && err.trim_end().lines().count() == 1,
            "{err}"
        );
    }
}
