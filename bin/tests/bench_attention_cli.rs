//! `bench-attention` on the CPU (its smoke mode): both q / k / v layouts run, record themselves in
//! the JSON, and the ragged op agrees with candle's padded attention on every row.

mod common;

use common::{assert_ok, s};
use std::process::Command;

/// Runs the benchmark on a few small shapes in f32 and returns its JSON report.
fn run(layout: &str, out: &std::path::Path) -> serde_json::Value {
    let output = Command::new(env!("CARGO_BIN_EXE_bench-attention"))
        .args([
            "--device",
            "cpu",
            "--heads",
            "2,3",
            "--batch",
            "1,3",
            "--keep",
            "1.0,0.5",
            "--dtype",
            "f32",
            "--host-calls",
            "2",
            "--gpu-reps",
            "2",
            "--qkv-layout",
            layout,
            "--out",
            s(out),
        ])
        .output()
        .unwrap();
    assert_ok(&output);
    serde_json::from_str(&std::fs::read_to_string(out).unwrap()).unwrap()
}

#[test]
fn both_qkv_layouts_agree_with_padded_attention() {
    let dir = tempfile::tempdir().unwrap();
    for layout in ["fused", "head-major"] {
        let report = run(layout, &dir.path().join(format!("{layout}.json")));
        assert_eq!(report["qkv_layout"], layout);
        let rows = report["rows"].as_array().unwrap();
        // 2 head counts x 2 batches x 2 keeps, a ragged and a padded row each.
        assert_eq!(rows.len(), 16, "{layout}");
        for row in rows {
            let diff = row["max_abs_diff_vs_padded"].as_f64().unwrap();
            assert!(diff < 1e-4, "{layout}: {row}");
        }
    }
}

#[test]
fn unknown_layout_is_refused() {
    let out = Command::new(env!("CARGO_BIN_EXE_bench-attention"))
        .args(["--device", "cpu", "--qkv-layout", "interleaved"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("interleaved"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
