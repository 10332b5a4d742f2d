//! End-to-end tests of the `classify` binary on a generated image and a generated tiny
//! checkpoint (no network).

mod common;

use common::{assert_ok, assert_one_line_error, s, write_random_checkpoint};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use candle_core::{DType, Device, Module, D};
use image::{ImageFormat, Rgb, RgbImage};
use models::{Checkpoint, DeiTConfig, PreprocessConfig};

const CLASSES: usize = 10;

struct Fixture {
    _dir: tempfile::TempDir,
    dir: PathBuf,
    weights: PathBuf,
    images: Vec<PathBuf>,
}

fn tiny_cfg() -> DeiTConfig {
    DeiTConfig::custom(48, 2, 3, CLASSES, false)
}

/// A tiny random checkpoint in timm naming, and two generated PNG images.
fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_path_buf();
    let cfg = tiny_cfg();
    let weights = path.join("tiny.safetensors");
    write_random_checkpoint(&cfg, &weights);
    let images = (0..2u32)
        .map(|i| {
            let img = RgbImage::from_fn(300 + 20 * i, 250, |x, y| {
                Rgb([
                    (x * (3 + i)) as u8,
                    (y * 5) as u8,
                    ((x + y) * (7 - i)) as u8,
                ])
            });
            let p = path.join(format!("img{i}.png"));
            img.save_with_format(&p, ImageFormat::Png).unwrap();
            p
        })
        .collect();
    Fixture {
        _dir: dir,
        dir: path,
        weights,
        images,
    }
}

fn classify(args: &[&str], env: &[(&str, &Path)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_classify"));
    cmd.args(args).env("RUST_BACKTRACE", "1");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

fn local_args(f: &Fixture) -> Vec<&str> {
    vec!["--weights", s(&f.weights), "--infer-arch", "--heads", "3"]
}

#[test]
fn text_output() {
    let f = fixture();
    let mut args = local_args(&f);
    args.extend([s(&f.images[0]), s(&f.images[1]), "--top-k", "3"]);
    let out = classify(&args, &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_ok(&out);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 2 * (1 + 3), "{stdout}");
    assert_eq!(lines[0], s(&f.images[0]));
    assert_eq!(lines[4], s(&f.images[1]));
    for l in lines[1..4].iter().chain(&lines[5..8]) {
        assert!(l.contains('%') && l.contains("(class "), "{l}");
    }
}

#[test]
fn json_output_matches_library() {
    let f = fixture();
    // Labels from a config.json next to the weights.
    let id2label: serde_json::Map<String, serde_json::Value> = (0..CLASSES)
        .map(|i| (i.to_string(), format!("label-{i}").into()))
        .collect();
    std::fs::write(
        f.dir.join("config.json"),
        serde_json::json!({ "id2label": id2label }).to_string(),
    )
    .unwrap();
    let mut args = local_args(&f);
    args.extend([
        s(&f.images[0]),
        s(&f.images[1]),
        "--json",
        "--top-k",
        "4",
        "--batch-size",
        "1",
    ]);
    let out = classify(&args, &[]);
    assert_ok(&out);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["device"], "cpu");
    assert_eq!(v["dtype"], "f32");
    assert_eq!(v["pruner"], "none");
    assert!(v["model"].as_str().unwrap().contains("inferred"));
    let images = v["images"].as_array().unwrap();
    assert_eq!(images.len(), 2);

    // The same pipeline through the library.
    let cfg = tiny_cfg();
    let model = Checkpoint::from_file(&f.weights)
        .unwrap()
        .load_model(&cfg, DType::F32, &Device::Cpu)
        .unwrap();
    let pixels = PreprocessConfig::default().load_batch(&f.images).unwrap();
    let probs = candle_nn::ops::softmax(&model.forward(&pixels).unwrap(), D::Minus1)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();

    for (img, (path, row)) in images.iter().zip(f.images.iter().zip(&probs)) {
        assert_eq!(img["path"], s(path));
        let top = img["top_k"].as_array().unwrap();
        assert_eq!(top.len(), 4);
        let mut sum = 0.0;
        let mut prev = f64::INFINITY;
        for p in top {
            let (i, prob) = (
                p["index"].as_u64().unwrap() as usize,
                p["prob"].as_f64().unwrap(),
            );
            assert!(i < CLASSES);
            assert_eq!(p["label"], format!("label-{i}"));
            assert!(prob <= prev, "not sorted");
            assert!((prob - row[i] as f64).abs() < 1e-5, "{prob} vs {}", row[i]);
            prev = prob;
            sum += prob;
        }
        assert!(sum <= 1.0 + 1e-5, "{sum}");
        // The top entry is the argmax of the library's probabilities.
        let argmax = (0..CLASSES)
            .max_by(|&a, &b| row[a].total_cmp(&row[b]))
            .unwrap();
        assert_eq!(top[0]["index"].as_u64().unwrap() as usize, argmax);
    }
}

#[test]
fn half_precision_runs() {
    let f = fixture();
    let mut args = local_args(&f);
    args.extend([s(&f.images[0]), "--dtype", "bf16", "--json", "--top-k", "1"]);
    let out = classify(&args, &[]);
    assert_ok(&out);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["dtype"], "bf16");
    assert_eq!(v["images"][0]["top_k"].as_array().unwrap().len(), 1);
}

#[test]
fn missing_image_is_one_line() {
    let f = fixture();
    let missing = f.dir.join("does-not-exist.jpg");
    let mut args = local_args(&f);
    args.push(s(&missing));
    assert_one_line_error(&classify(&args, &[]), &["does-not-exist.jpg"]);
}

#[test]
fn bad_images_are_one_line() {
    let f = fixture();
    let truncated = f.dir.join("truncated.png");
    let bytes = std::fs::read(&f.images[0]).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() / 3]).unwrap();
    let empty = f.dir.join("empty.jpg");
    std::fs::write(&empty, b"").unwrap();
    let text = f.dir.join("text.png");
    std::fs::write(&text, b"plain text").unwrap();
    for (p, word) in [
        (&truncated, "truncated.png"),
        (&empty, "empty"),
        (&text, "unrecognised"),
    ] {
        let mut args = local_args(&f);
        args.push(s(p));
        assert_one_line_error(&classify(&args, &[]), &[word]);
    }
}

#[test]
fn missing_weights_file_is_one_line() {
    let f = fixture();
    let w = f.dir.join("nope.safetensors");
    let out = classify(&["--weights", s(&w), s(&f.images[0])], &[]);
    assert_one_line_error(&out, &["nope.safetensors"]);
}

#[test]
fn wrong_architecture_names_tensor_and_suggests_infer_arch() {
    let f = fixture();
    let out = classify(
        &[
            "--weights",
            s(&f.weights),
            "--model",
            "deit-tiny",
            s(&f.images[0]),
        ],
        &[],
    );
    assert_one_line_error(
        &out,
        &["cls_token", "[1, 1, 192]", "[1, 1, 48]", "--infer-arch"],
    );
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_without_feature_is_one_line() {
    let f = fixture();
    let mut args = local_args(&f);
    args.extend([s(&f.images[0]), "--device", "cuda"]);
    assert_one_line_error(
        &classify(&args, &[]),
        &["no CUDA support", "--features cuda"],
    );
}

#[test]
fn unreachable_hub_is_one_line() {
    // The real hf-hub path, pointed at a closed local port with an empty cache.
    let f = fixture();
    let cache = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_classify"))
        .args(["--model", "deit-tiny", s(&f.images[0])])
        .env("HF_ENDPOINT", "http://127.0.0.1:9")
        .env("HF_HOME", cache.path())
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    assert_one_line_error(
        &out,
        &[
            "cannot download timm/deit_tiny_patch16_224.fb_in1k/model.safetensors",
            "--weights",
        ],
    );
}

/// A file that is no image fails on its header before any weights are fetched: the Hub is
/// pointed at a closed port with an empty cache, so a download attempt would be the error.
#[test]
fn bad_image_fails_before_the_download() {
    let f = fixture();
    let text = f.dir.join("notes.jpg");
    std::fs::write(&text, b"plain text").unwrap();
    let empty = f.dir.join("empty.png");
    std::fs::write(&empty, b"").unwrap();
    for (p, words) in [
        (&text, ["notes.jpg", "unrecognised"]),
        (&empty, ["empty.png", "empty"]),
    ] {
        let cache = tempfile::tempdir().unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_classify"))
            .args(["--model", "deit-tiny", s(&f.images[0]), s(p)])
            .env("HF_ENDPOINT", "http://127.0.0.1:9")
            .env("HF_HOME", cache.path())
            .env("RUST_BACKTRACE", "1")
            .output()
            .unwrap();
        assert_one_line_error(&out, &words);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("download"), "{err}");
    }
}

#[test]
fn unknown_model_is_rejected_by_clap() {
    let f = fixture();
    let out = classify(&["--model", "deit-huge", s(&f.images[0])], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("deit-huge") && stderr.contains("deit-small"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}
