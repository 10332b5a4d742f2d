//! Checkpoint loading: the three namings give identical models, and every way a checkpoint can
//! be wrong is a typed error naming the tensor and shapes.

mod common;

use std::collections::HashMap;

use candle_core::{DType, Device, Module, Tensor};
use common::*;
use models::{Checkpoint, DeiTConfig, ModelError, WeightNaming};

fn logits_from_file(path: &std::path::Path, cfg: &DeiTConfig, pixels: &Tensor) -> Tensor {
    let ckpt = Checkpoint::from_file(path).unwrap();
    let model = ckpt.load_model(cfg, DType::F32, &Device::Cpu).unwrap();
    model.forward(pixels).unwrap()
}

/// Writes the same weights under the three namings and checks detection and identical logits.
fn three_namings_agree(cfg: &DeiTConfig, seed: u64) {
    let dir = tempfile::tempdir().unwrap();
    let timm = random_timm_weights(cfg, seed);
    let hf_prefix = if cfg.distilled { "deit" } else { "vit" };
    let hf = to_hf(&timm, hf_prefix);
    let (p_timm, p_hf) = (
        dir.path().join("timm.safetensors"),
        dir.path().join("hf.safetensors"),
    );
    save(&timm, &p_timm);
    save(&hf, &p_hf);
    assert_eq!(
        Checkpoint::from_file(&p_timm).unwrap().naming(),
        WeightNaming::Timm
    );
    let want = if cfg.distilled {
        WeightNaming::HfDeit
    } else {
        WeightNaming::HfVit
    };
    assert_eq!(Checkpoint::from_file(&p_hf).unwrap().naming(), want);

    let pixels = random_pixels(2, cfg.image_size, seed + 7).tensor();
    let a = logits_from_file(&p_timm, cfg, &pixels);
    let b = logits_from_file(&p_hf, cfg, &pixels);
    assert_eq!(a.dims(), &[2, cfg.num_classes]);
    // Same numbers in, same ops: bit-identical.
    assert_eq!(
        max_abs_diff(&a, &b),
        0.0,
        "{}: timm vs {hf_prefix}",
        cfg.name
    );
    // And the logits depend on the weights (a different seed differs).
    let other = dir.path().join("other.safetensors");
    save(&random_timm_weights(cfg, seed + 1), &other);
    assert!(max_abs_diff(&a, &logits_from_file(&other, cfg, &pixels)) > 1e-3);
}

#[test]
fn tiny_timm_and_vit_namings_agree() {
    three_namings_agree(&tiny_cfg(false), 100);
}

#[test]
fn tiny_timm_and_deit_namings_agree() {
    three_namings_agree(&tiny_cfg(true), 200);
}

#[test]
fn full_size_deit_tiny_random_weights() {
    let cfg = DeiTConfig::tiny();
    let dir = tempfile::tempdir().unwrap();
    let timm = random_timm_weights(&cfg, 400);
    let p_timm = dir.path().join("model.safetensors");
    let p_vit = dir.path().join("vit.safetensors");
    save(&timm, &p_timm);
    save(&to_hf(&timm, "vit"), &p_vit);
    let pixels = random_pixels(1, 224, 401).tensor();
    let a = logits_from_file(&p_timm, &cfg, &pixels);
    let b = logits_from_file(&p_vit, &cfg, &pixels);
    assert_eq!(a.dims(), &[1, 1000]);
    assert_eq!(max_abs_diff(&a, &b), 0.0);
    let v = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert!(v.iter().all(|x| x.is_finite()));
    // The checkpoint's architecture is recoverable from its shapes.
    let inferred = Checkpoint::from_file(&p_timm)
        .unwrap()
        .infer_config(None)
        .unwrap();
    assert_eq!(
        (
            inferred.dim,
            inferred.depth,
            inferred.heads,
            inferred.num_classes,
            inferred.distilled
        ),
        (192, 12, 3, 1000, false)
    );
    assert_eq!(
        (inferred.image_size, inferred.patch_size, inferred.mlp_ratio),
        (224, 16, 4)
    );
    // A full-size checkpoint loaded with the wrong size is a named shape error.
    let err = Checkpoint::from_file(&p_timm)
        .unwrap()
        .load_model(&DeiTConfig::small(), DType::F32, &Device::Cpu)
        .unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, ModelError::ShapeMismatch { .. }), "{msg}");
    assert!(
        msg.contains("cls_token") && msg.contains("[1, 1, 384]") && msg.contains("[1, 1, 192]"),
        "{msg}"
    );
}

#[test]
fn infer_config_in_each_naming() {
    for distilled in [false, true] {
        let cfg = tiny_cfg(distilled);
        let timm = random_timm_weights(&cfg, 500);
        let hf = to_hf(&timm, if distilled { "deit" } else { "vit" });
        for w in [&timm, &hf] {
            let got = Checkpoint::from_tensors(to_tensors(w))
                .unwrap()
                .infer_config(Some(3))
                .unwrap();
            assert_eq!(
                (
                    got.dim,
                    got.depth,
                    got.heads,
                    got.num_classes,
                    got.distilled,
                    got.mlp_ratio
                ),
                (48, 2, 3, 10, distilled, 4)
            );
            assert_eq!((got.image_size, got.patch_size), (224, 16));
        }
    }
}

fn load_err(weights: Vec<(String, Raw)>, cfg: &DeiTConfig) -> ModelError {
    Checkpoint::from_tensors(to_tensors(&weights))
        .and_then(|c| c.load_model(cfg, DType::F32, &Device::Cpu))
        .unwrap_err()
}

#[test]
fn missing_tensor_is_named() {
    let cfg = tiny_cfg(false);
    for (weights, gone) in [
        (random_timm_weights(&cfg, 600), "blocks.1.mlp.fc2.bias"),
        (
            to_hf(&random_timm_weights(&cfg, 600), "vit"),
            "vit.encoder.layer.0.attention.attention.key.weight",
        ),
    ] {
        let weights: Vec<_> = weights.into_iter().filter(|(n, _)| n != gone).collect();
        let err = load_err(weights, &cfg);
        let msg = err.to_string();
        assert!(matches!(err, ModelError::MissingTensor { .. }), "{msg}");
        assert!(msg.contains(gone), "{msg}");
        let want_shape = if gone.ends_with("key.weight") {
            "[48, 48]"
        } else {
            "[48]"
        };
        assert!(msg.contains(want_shape), "{msg}");
    }
}

#[test]
fn extra_tensor_is_named() {
    let cfg = tiny_cfg(false);
    let mut w = random_timm_weights(&cfg, 700);
    // A third block's tensor: the checkpoint is deeper than the config.
    w.push((
        "blocks.2.norm1.weight".into(),
        Raw {
            shape: vec![48],
            data: vec![1.0; 48],
        },
    ));
    let err = load_err(w, &cfg);
    let msg = err.to_string();
    assert!(matches!(err, ModelError::UnexpectedTensor { .. }), "{msg}");
    assert!(
        msg.contains("blocks.2.norm1.weight") && msg.contains("[48]"),
        "{msg}"
    );
}

#[test]
fn misshaped_tensor_names_both_shapes() {
    let cfg = tiny_cfg(true);
    let mut w = to_hf(&random_timm_weights(&cfg, 800), "deit");
    let (_, raw) = w
        .iter_mut()
        .find(|(n, _)| n == "deit.encoder.layer.1.intermediate.dense.weight")
        .unwrap();
    *raw = Raw {
        shape: vec![190, 48],
        data: vec![0.0; 190 * 48],
    };
    let err = load_err(w, &cfg);
    let msg = err.to_string();
    match &err {
        ModelError::ShapeMismatch {
            name,
            expected,
            found,
            ..
        } => {
            assert_eq!(name, "deit.encoder.layer.1.intermediate.dense.weight");
            assert_eq!(expected, &vec![192, 48]);
            assert_eq!(found, &vec![190, 48]);
        }
        other => panic!("expected ShapeMismatch, got {other}"),
    }
    assert!(
        msg.contains("[192, 48]") && msg.contains("[190, 48]"),
        "{msg}"
    );
}

#[test]
fn distilled_mismatch_is_explained() {
    let err = load_err(random_timm_weights(&tiny_cfg(true), 900), &tiny_cfg(false));
    assert!(matches!(err, ModelError::DistilledMismatch { .. }), "{err}");
    assert!(err.to_string().contains("distillation token"), "{err}");
    let err = load_err(random_timm_weights(&tiny_cfg(false), 900), &tiny_cfg(true));
    assert!(matches!(err, ModelError::DistilledMismatch { .. }), "{err}");
}

#[test]
fn unrecognised_naming() {
    let err = Checkpoint::from_tensors(HashMap::from([(
        "model.encoder.weight".to_string(),
        Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap(),
    )]))
    .unwrap_err();
    assert!(matches!(err, ModelError::UnknownNaming), "{err}");
}

#[test]
fn unknown_model_name() {
    let err = DeiTConfig::from_name("deit-large").unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, ModelError::UnknownModel { .. }));
    assert!(
        msg.contains("deit-large") && msg.contains("deit-small-distilled"),
        "{msg}"
    );
}

#[test]
fn unreadable_weights_files() {
    let dir = tempfile::tempdir().unwrap();
    // Missing file.
    let missing = dir.path().join("nope.safetensors");
    let err = Checkpoint::from_file(&missing).unwrap_err();
    assert!(matches!(err, ModelError::ReadWeights { .. }), "{err}");
    assert!(err.to_string().contains("nope.safetensors"), "{err}");
    // Garbage / truncated safetensors.
    let garbage = dir.path().join("garbage.safetensors");
    std::fs::write(&garbage, b"this is not a safetensors file").unwrap();
    let err = Checkpoint::from_file(&garbage).unwrap_err();
    assert!(matches!(err, ModelError::ReadWeights { .. }), "{err}");
    let good = dir.path().join("good.safetensors");
    save(&random_timm_weights(&tiny_cfg(false), 1), &good);
    let bytes = std::fs::read(&good).unwrap();
    let truncated = dir.path().join("truncated.safetensors");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let err = Checkpoint::from_file(&truncated).unwrap_err();
    assert!(matches!(err, ModelError::ReadWeights { .. }), "{err}");
    assert!(err.to_string().contains("truncated.safetensors"), "{err}");
    // A directory.
    let err = Checkpoint::from_file(dir.path()).unwrap_err();
    assert!(matches!(err, ModelError::ReadWeights { .. }), "{err}");
    // Unknown extension.
    let odd = dir.path().join("weights.onnx");
    std::fs::write(&odd, b"x").unwrap();
    let err = Checkpoint::from_file(&odd).unwrap_err();
    assert!(
        matches!(err, ModelError::UnsupportedWeightsFormat { .. }),
        "{err}"
    );
    // A .bin that is not a PyTorch zip goes to the pickle reader and fails cleanly.
    let bin = dir.path().join("pytorch_model.bin");
    std::fs::write(&bin, b"not a zip").unwrap();
    let err = Checkpoint::from_file(&bin).unwrap_err();
    assert!(matches!(err, ModelError::ReadWeights { .. }), "{err}");
    assert!(err.to_string().contains("PyTorch"), "{err}");
}

#[test]
fn expected_tensor_lists() {
    let cfg = tiny_cfg(true);
    let timm = models::expected_tensors(&cfg, WeightNaming::Timm);
    // 4 tokens/embeds + 2 patch + 12 per block + 2 norm + 4 heads
    assert_eq!(timm.len(), 3 + 2 + 12 * cfg.depth + 2 + 4);
    let deit = models::expected_tensors(&cfg, WeightNaming::HfDeit);
    // qkv (2 tensors) becomes q, k, v (6 tensors) per block.
    assert_eq!(deit.len(), timm.len() + 4 * cfg.depth);
    // The written HF checkpoint has exactly the expected names.
    let written: std::collections::BTreeSet<String> = to_hf(&random_timm_weights(&cfg, 2), "deit")
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let expected: std::collections::BTreeSet<String> = deit.into_iter().map(|(n, _)| n).collect();
    assert_eq!(written, expected);
}
