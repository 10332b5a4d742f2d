//! The dense candle model against an independent f64 reference (explicit loops per image,
//! token and head), on random weights and inputs.

mod common;

use candle_core::{DType, Device, Module, Tensor};
use common::*;
use models::{Checkpoint, DeiTConfig};

fn check_against_reference(cfg: &DeiTConfig, batch: usize, seed: u64) {
    let weights = random_timm_weights(cfg, seed);
    let pixels = random_pixels(batch, cfg.image_size, seed + 1);
    let model = Checkpoint::from_tensors(to_tensors(&weights))
        .unwrap()
        .load_model(cfg, DType::F32, &Device::Cpu)
        .unwrap();
    let logits = model.forward(&pixels.tensor()).unwrap();
    assert_eq!(logits.dims(), &[batch, cfg.num_classes]);
    let got = logits.to_vec2::<f32>().unwrap();
    let want = reference_logits(cfg, &weights, &pixels);
    let mut max_diff = 0f64;
    let mut spread = 0f64;
    for (g, w) in got.iter().zip(&want) {
        for (g, w) in g.iter().zip(w) {
            max_diff = max_diff.max((*g as f64 - w).abs());
            spread = spread.max(w.abs());
        }
    }
    // The logits must be non-trivial for the comparison to mean anything.
    assert!(
        spread > 0.1,
        "reference logits are degenerate (max |logit| {spread})"
    );
    assert!(
        max_diff <= 1e-4,
        "{}: max |logit diff| {max_diff} > 1e-4",
        cfg.name
    );
}

#[test]
fn tiny_matches_reference() {
    check_against_reference(&tiny_cfg(false), 2, 11);
}

#[test]
fn tiny_distilled_matches_reference() {
    check_against_reference(&tiny_cfg(true), 2, 21);
}

#[test]
fn other_geometry_matches_reference() {
    // Different image/patch size, head count and MLP ratio: all sizes come from the config.
    let mut cfg = DeiTConfig::custom(32, 3, 4, 7, false);
    cfg.image_size = 64;
    cfg.patch_size = 8;
    cfg.mlp_ratio = 2;
    check_against_reference(&cfg, 3, 31);
}

#[test]
fn batch_rows_are_independent() {
    // An image's logits do not depend on the other images in its batch.
    let cfg = tiny_cfg(true);
    let weights = random_timm_weights(&cfg, 41);
    let model = Checkpoint::from_tensors(to_tensors(&weights))
        .unwrap()
        .load_model(&cfg, DType::F32, &Device::Cpu)
        .unwrap();
    let pixels = random_pixels(3, cfg.image_size, 42).tensor();
    let all = model.forward(&pixels).unwrap();
    for i in 0..3 {
        let one = model.forward(&pixels.narrow(0, i, 1).unwrap()).unwrap();
        let diff = max_abs_diff(&one, &all.narrow(0, i, 1).unwrap());
        assert!(diff < 1e-5, "image {i}: {diff}");
    }
}

#[test]
fn forward_features_and_half_precision() {
    let cfg = tiny_cfg(false);
    let weights = random_timm_weights(&cfg, 51);
    let pixels = random_pixels(2, cfg.image_size, 52).tensor();
    let load = |dtype| {
        Checkpoint::from_tensors(to_tensors(&weights))
            .unwrap()
            .load_model(&cfg, dtype, &Device::Cpu)
            .unwrap()
    };
    let f32_model = load(DType::F32);
    let feats = f32_model.forward_features(&pixels).unwrap();
    assert_eq!(feats.dims(), &[2, cfg.seq_len(), cfg.dim]);
    // forward == forward_head(forward_features)
    let direct = f32_model.forward(&pixels).unwrap();
    assert_eq!(
        max_abs_diff(&direct, &f32_model.forward_head(&feats).unwrap()),
        0.0
    );
    // bf16 / f16 run and stay close to f32 (loose bound: half precision through 2 blocks).
    for dtype in [DType::BF16, DType::F16] {
        let m = load(dtype);
        assert_eq!(m.dtype(), dtype);
        let l = m.forward(&pixels).unwrap();
        assert_eq!(l.dtype(), dtype);
        let l = l.to_dtype(DType::F32).unwrap();
        let diff = max_abs_diff(&l, &direct);
        let scale = direct
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(
            diff < 0.1 * scale.max(1.0),
            "{dtype:?}: diff {diff} (scale {scale})"
        );
    }
    // Probabilities sum to one.
    let p = f32_model.probabilities(&pixels).unwrap();
    let sums = p.sum(1).unwrap().to_vec1::<f32>().unwrap();
    assert!(sums.iter().all(|s| (s - 1.0).abs() < 1e-5), "{sums:?}");
    let _ = Tensor::zeros(1, DType::F32, &Device::Cpu);
}
