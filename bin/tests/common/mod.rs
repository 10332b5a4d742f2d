//! Helpers shared by the command-line tests: a random checkpoint on disk, paths as `&str`, and the
//! contract every bad input must keep (one `error:` line, exit code 1).
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::Path;
use std::process::Output;

use candle_core::{Device, Tensor};
use models::{expected_tensors, DeiTConfig, WeightNaming};

/// Writes a checkpoint of `cfg` in timm naming with random weights (std 1/√fan_in).
pub fn write_random_checkpoint(cfg: &DeiTConfig, path: &Path) {
    let tensors: HashMap<String, Tensor> = expected_tensors(cfg, WeightNaming::Timm)
        .into_iter()
        .map(|(name, shape)| {
            let fan_in = *shape.last().unwrap() as f64;
            let t = Tensor::randn(0f32, (1.0 / fan_in.sqrt()) as f32, shape, &Device::Cpu).unwrap();
            (name, t)
        })
        .collect();
    candle_core::safetensors::save(&tensors, path).unwrap();
}

/// The command succeeded; its stderr is shown when it did not.
pub fn assert_ok(out: &Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The contract for bad input: exit code 1, exactly one line on stderr starting with `error:`,
/// no panic or backtrace, nothing on stdout.
pub fn assert_one_line_error(out: &Output, must_contain: &[&str]) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "stderr: {stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
    for bad in ["panicked", "backtrace", "Backtrace", "RUST_BACKTRACE"] {
        assert!(!stderr.contains(bad), "{stderr}");
    }
    for w in must_contain {
        assert!(stderr.contains(w), "`{stderr}` lacks `{w}`");
    }
    assert!(
        out.stdout.is_empty(),
        "stdout: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    stderr
}
