mod common;

use std::collections::HashMap;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::VarBuilder;
use common::*;
use pruners::{
    DynamicVit, DynamicVitConfig, DynamicVitMode, Mode, PredictorLG, PruneError, PruneInput,
    PruneSite, PrunerKind, PruningSchedule, TokenPruner, WeightsSource,
};

// ---------- an independent f64 implementation of PredictorLG (the reference formula) ----------

#[derive(Clone)]
struct W {
    ln_w: Vec<f64>,
    ln_b: Vec<f64>,
    lin: Vec<(Vec<Vec<f64>>, Vec<f64>)>, // in_conv.1, out_conv.0, out_conv.2, out_conv.4
}

const NAMES: [&str; 4] = ["in_conv.1", "out_conv.0", "out_conv.2", "out_conv.4"];

fn erf(x: f64) -> f64 {
    // Abramowitz & Stegun 7.1.26, |error| < 1.5e-7
    let s = x.signum();
    let x = x.abs();
    let t = 1.0 / (1.0 + 0.3275911 * x);
    let y = 1.0
        - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t
            + 0.254829592)
            * t
            * (-x * x).exp();
    s * y
}

fn gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2))
}

fn linear(x: &[f64], w: &(Vec<Vec<f64>>, Vec<f64>)) -> Vec<f64> {
    w.0.iter()
        .zip(&w.1)
        .map(|(row, b)| row.iter().zip(x).map(|(a, b)| a * b).sum::<f64>() + b)
        .collect()
}

/// log-probs [keep, drop] for patch tokens `x` (all valid).
fn reference(x: &[Vec<f64>], w: &W) -> Vec<[f64; 2]> {
    let c = x[0].len();
    let h: Vec<Vec<f64>> = x
        .iter()
        .map(|t| {
            let mean = t.iter().sum::<f64>() / c as f64;
            let var = t.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / c as f64;
            let n: Vec<f64> = t
                .iter()
                .enumerate()
                .map(|(i, v)| (v - mean) / (var + 1e-5).sqrt() * w.ln_w[i] + w.ln_b[i])
                .collect();
            linear(&n, &w.lin[0]).into_iter().map(gelu).collect()
        })
        .collect();
    let half = c / 2;
    let pooled: Vec<f64> = (half..c)
        .map(|i| h.iter().map(|t| t[i]).sum::<f64>() / h.len() as f64)
        .collect();
    h.iter()
        .map(|t| {
            let f: Vec<f64> = t[..half].iter().chain(&pooled).copied().collect();
            let a: Vec<f64> = linear(&f, &w.lin[1]).into_iter().map(gelu).collect();
            let b: Vec<f64> = linear(&a, &w.lin[2]).into_iter().map(gelu).collect();
            let z = linear(&b, &w.lin[3]);
            let m = z[0].max(z[1]);
            let lse = m + ((z[0] - m).exp() + (z[1] - m).exp()).ln();
            [z[0] - lse, z[1] - lse]
        })
        .collect()
}

fn pseudo(n: usize, seed: u64, scale: f64) -> Vec<f64> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (((s >> 33) as f64 / (1u64 << 31) as f64) - 0.5) * 2.0 * scale
        })
        .collect()
}

/// Images of `lens[i]` token rows of width `c`: row t of image i is
/// `pseudo(c, seed + image_stride · i + t, scale)`, in f32.
fn pseudo_images(
    c: usize,
    lens: &[usize],
    seed: u64,
    image_stride: u64,
    scale: f64,
) -> Vec<Vec<Vec<f32>>> {
    lens.iter()
        .enumerate()
        .map(|(i, &n)| {
            (0..n)
                .map(|t| {
                    pseudo(c, seed + image_stride * i as u64 + t as u64, scale)
                        .iter()
                        .map(|&v| v as f32)
                        .collect()
                })
                .collect()
        })
        .collect()
}

fn random_weights(c: usize, seed: u64) -> W {
    let dims = [(c, c), (c / 2, c), (c / 4, c / 2), (2, c / 4)];
    W {
        ln_w: pseudo(c, seed, 0.5).iter().map(|v| 1.0 + v).collect(),
        ln_b: pseudo(c, seed + 1, 0.2),
        lin: dims
            .iter()
            .enumerate()
            .map(|(i, &(o, inp))| {
                let flat = pseudo(o * inp, seed + 10 + i as u64, 0.8);
                (
                    flat.chunks(inp).map(|r| r.to_vec()).collect(),
                    pseudo(o, seed + 20 + i as u64, 0.3),
                )
            })
            .collect(),
    }
}

/// The hand-set predictor: logits (z, -z) with z = gelu(gelu(gelu(LN(x)_0))).
fn hand_weights() -> W {
    let c = 4;
    let eye: Vec<Vec<f64>> = (0..c)
        .map(|i| (0..c).map(|j| f64::from(u8::from(i == j))).collect())
        .collect();
    W {
        ln_w: vec![1.0; c],
        ln_b: vec![0.0; c],
        lin: vec![
            (eye, vec![0.0; c]),
            (vec![vec![1.0, 0.0, 0.0, 0.0], vec![0.0; 4]], vec![0.0; 2]),
            (vec![vec![1.0, 0.0]], vec![0.0]),
            (vec![vec![1.0], vec![-1.0]], vec![0.0, 0.0]),
        ],
    }
}

fn tensors(w: &W, stage: usize, dtype: DType) -> HashMap<String, Tensor> {
    let dev = Device::Cpu;
    let v = |x: &[f64]| Tensor::new(x.iter().map(|&v| v as f32).collect::<Vec<_>>(), &dev).unwrap();
    let m = |x: &Vec<Vec<f64>>| {
        let r = x.len();
        let flat: Vec<f32> = x.iter().flatten().map(|&v| v as f32).collect();
        let c = flat.len() / r;
        Tensor::from_vec(flat, (r, c), &dev).unwrap()
    };
    let p = format!("score_predictor.{stage}");
    let mut out = HashMap::new();
    out.insert(format!("{p}.in_conv.0.weight"), v(&w.ln_w));
    out.insert(format!("{p}.in_conv.0.bias"), v(&w.ln_b));
    for (name, l) in NAMES.iter().zip(&w.lin) {
        out.insert(format!("{p}.{name}.weight"), m(&l.0));
        out.insert(format!("{p}.{name}.bias"), v(&l.1));
    }
    out.into_iter()
        .map(|(k, t)| (k, t.to_dtype(dtype).unwrap()))
        .collect()
}

fn load(w: &W, stage: usize, config: DynamicVitConfig, c: usize) -> DynamicVit {
    let vb = VarBuilder::from_tensors(tensors(w, stage, DType::F32), DType::F32, &Device::Cpu);
    DynamicVit::load(config, c, &vb).unwrap()
}

fn hand_tokens(ts: &[f32]) -> Vec<Vec<f32>> {
    std::iter::once(vec![9.0, 0.0, 0.0, 0.0])
        .chain(ts.iter().map(|&t| vec![t, -t, 1.0, -1.0]))
        .collect()
}

const TS: [f32; 6] = [2.0, -1.0, 3.0, 0.5, -2.0, 1.0];

fn cfg(stage: usize, mode: DynamicVitMode, original: usize) -> DynamicVitConfig {
    DynamicVitConfig {
        stage,
        mode,
        original_patches: original,
        layer_norm_eps: 1e-5,
    }
}

#[test]
fn hand_set_predictor_log_probs_and_keep_sets() {
    let w = hand_weights();
    let img = hand_tokens(&TS);
    let (t, _) = pad_batch(std::slice::from_ref(&img), 7, 0.0);
    let fixed = load(
        &w,
        0,
        cfg(0, DynamicVitMode::TopK { keep_ratio: 0.5 }, 6),
        4,
    );
    assert_eq!(fixed.weights_source(), WeightsSource::Checkpoint);
    assert_eq!(fixed.site(), PruneSite::BeforeBlock);
    assert_eq!(fixed.kind(), PrunerKind::DynamicVit);
    let lp = fixed
        .log_probs(&PruneInput::new(&t, 1))
        .unwrap()
        .to_vec3::<f32>()
        .unwrap();
    for (j, &tv) in TS.iter().enumerate() {
        // closed form: LN(x)_0 = t / sqrt((t^2 + 1) / 2 + eps), z = gelu^3, log-softmax(z, -z)
        let t = tv as f64;
        let u = t / ((t * t + 1.0) / 2.0 + 1e-5).sqrt();
        let z = gelu(gelu(gelu(u)));
        let keep = -(1.0 + (-2.0 * z).exp()).ln();
        let drop = -(1.0 + (2.0 * z).exp()).ln();
        assert!(
            (lp[0][j][0] as f64 - keep).abs() < 1e-5,
            "{j}: {:?} vs {keep}",
            lp[0][j]
        );
        assert!((lp[0][j][1] as f64 - drop).abs() < 1e-5);
    }
    // fixed: floor(0.5 * 6) = 3 -> t = 3 (3), 2 (1), 1 (6)
    let plan = fixed.plan(&PruneInput::new(&t, 1)).unwrap();
    assert_eq!(plan.indices, vec![vec![0, 1, 3, 6]]);
    // adaptive: keep-probability > 0.5 <=> z > 0 <=> t > 0
    let adaptive = load(&w, 0, DynamicVitConfig::adaptive(0, 6), 4);
    assert_eq!(adaptive.mode(), Mode::Adaptive);
    let plan = adaptive.plan(&PruneInput::new(&t, 1)).unwrap();
    assert_eq!(plan.indices, vec![vec![0, 1, 3, 4, 6]]);
    // all tokens negative: adaptive still keeps one patch (the best: t = -0.5 has the largest z)
    let neg = hand_tokens(&[-2.0, -3.0, -0.5]);
    let (tn, _) = pad_batch(&[neg], 4, 0.0);
    let plan = adaptive.plan(&PruneInput::new(&tn, 1)).unwrap();
    assert_eq!(plan.indices[0].len(), 2);
}

#[test]
fn fixed_count_is_floor_of_original_like_the_reference() {
    // int(196 * 0.7 ** s): 137, 96, 67
    let counts: Vec<usize> = (0..3)
        .map(|s| {
            DynamicVitConfig::fixed(s, 0.7, 196)
                .fixed_keep_count()
                .unwrap()
        })
        .collect();
    assert_eq!(counts, vec![137, 96, 67]);
    // the count refers to the original patches, not the current ones
    let w = random_weights(8, 3);
    let p = load(
        &w,
        0,
        cfg(0, DynamicVitMode::TopK { keep_ratio: 0.5 }, 8),
        8,
    );
    let img: Vec<Vec<f32>> = (0..5)
        .map(|i| pseudo(8, 100 + i, 1.0).iter().map(|&v| v as f32).collect())
        .collect();
    let (t, _) = pad_batch(&[img], 5, 0.0);
    // floor(0.5 * 8) = 4 = all 4 current patches
    assert_eq!(p.plan(&PruneInput::new(&t, 1)).unwrap().indices[0].len(), 5);
}

#[test]
fn random_weights_match_the_reference_formula_and_padding_is_ignored() {
    let c = 8;
    let w = random_weights(c, 11);
    let p = load(
        &w,
        2,
        cfg(2, DynamicVitMode::TopK { keep_ratio: 0.5 }, 6),
        c,
    );
    let img: Vec<Vec<f32>> = (0..7)
        .map(|i| pseudo(c, 200 + i, 2.0).iter().map(|&v| v as f32).collect())
        .collect();
    let patches: Vec<Vec<f64>> = img[1..]
        .iter()
        .map(|r| r.iter().map(|&v| v as f64).collect())
        .collect();
    let want = reference(&patches, &w);
    let (t, _) = pad_batch(std::slice::from_ref(&img), 7, 0.0);
    let got = p
        .log_probs(&PruneInput::new(&t, 1))
        .unwrap()
        .to_vec3::<f32>()
        .unwrap();
    for (g, r) in got[0].iter().zip(&want) {
        assert!((g[0] as f64 - r[0]).abs() < 1e-4 && (g[1] as f64 - r[1]).abs() < 1e-4);
    }
    // expected keep set from the reference log-probs: top floor(0.5 * 6) = 3
    let mut order: Vec<usize> = (0..6).collect();
    order.sort_by(|&a, &b| want[b][0].total_cmp(&want[a][0]).then(a.cmp(&b)));
    let mut keep: Vec<u32> = order[..3].iter().map(|&j| j as u32 + 1).collect();
    keep.sort();
    keep.insert(0, 0);
    let alone = p.plan(&PruneInput::new(&t, 1)).unwrap();
    assert_eq!(alone.indices[0], keep);
    // the same image between a longer and a shorter neighbour, with garbage padding
    let long: Vec<Vec<f32>> = (0..11)
        .map(|i| pseudo(c, 300 + i, 2.0).iter().map(|&v| v as f32).collect())
        .collect();
    let (tb, lens) = pad_batch(&[long, img.clone(), img[..3].to_vec()], 11, 1e3);
    let input = PruneInput::new(&tb, 1).with_lengths(&lens);
    let batch = p.plan(&input).unwrap();
    assert_eq!(batch.indices[1], keep);
    let lpb = p.log_probs(&input).unwrap().to_vec3::<f32>().unwrap();
    for (a, b) in lpb[1][..6].iter().zip(&got[0]) {
        assert!((a[0] - b[0]).abs() < 1e-5);
    }
    for (b, idx) in batch.indices.iter().enumerate() {
        assert!(idx.iter().all(|&j| (j as usize) < lens[b]));
    }
    // the 2-patch image keeps min(3, 2) = 2
    assert_eq!(batch.indices[2], vec![0, 1, 2]);
}

#[test]
fn loads_from_safetensors_checkpoint_with_real_names() {
    let c = 8;
    let w = random_weights(c, 5);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dyvit.safetensors");
    let mut all = tensors(&w, 1, DType::F32);
    // unrelated model tensors are ignored
    all.insert(
        "blocks.0.norm1.weight".into(),
        Tensor::ones(c, DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&all, &path).unwrap();
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(&[&path], DType::F32, &Device::Cpu).unwrap() };
    let p = DynamicVit::load(DynamicVitConfig::fixed(1, 0.7, 196), c, &vb).unwrap();
    assert_eq!(p.weights_source(), WeightsSource::Checkpoint);
    assert_eq!(
        TokenPruner::weights_source(&p),
        Some(WeightsSource::Checkpoint)
    );
    let x: Vec<Vec<f32>> = (0..5)
        .map(|i| pseudo(c, 50 + i, 1.5).iter().map(|&v| v as f32).collect())
        .collect();
    let want = reference(
        &x.iter()
            .map(|r| r.iter().map(|&v| v as f64).collect())
            .collect::<Vec<_>>(),
        &w,
    );
    // as a candle Module on [B, P, C] patch tokens
    let xt = pad_batch(&[x], 5, 0.0).0;
    let got = p
        .predictor()
        .forward(&xt)
        .unwrap()
        .to_vec3::<f32>()
        .unwrap();
    for (g, r) in got[0].iter().zip(&want) {
        assert!((g[0] as f64 - r[0]).abs() < 1e-4);
    }

    // the same through the schedule builder: stage 1 is block 6
    let mut three = HashMap::new();
    for s in 0..3 {
        three.extend(tensors(&random_weights(c, s as u64), s, DType::F16));
    }
    let vb3 = VarBuilder::from_tensors(three, DType::F32, &Device::Cpu);
    let sched = PruningSchedule::parse("dynamicvit", 12).unwrap();
    let built = sched.build(12, c, Some(&vb3), &Device::Cpu).unwrap();
    assert_eq!(built.iter().map(|b| b.0).collect::<Vec<_>>(), vec![3, 6, 9]);
    assert!(built
        .iter()
        .all(|(_, p)| p.weights_source() == Some(WeightsSource::Checkpoint)));
}

#[test]
fn missing_or_misshaped_tensor_is_a_clear_error() {
    let c = 8;
    let w = random_weights(c, 5);
    let dir = tempfile::tempdir().unwrap();

    let mut missing = tensors(&w, 0, DType::F32);
    missing.remove("score_predictor.0.out_conv.4.bias");
    let path = dir.path().join("missing.safetensors");
    candle_core::safetensors::save(&missing, &path).unwrap();
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(&[&path], DType::F32, &Device::Cpu).unwrap() };
    match DynamicVit::load(DynamicVitConfig::fixed(0, 0.7, 196), c, &vb) {
        Err(PruneError::MissingWeight { name }) => {
            assert_eq!(name, "score_predictor.0.out_conv.4.bias")
        }
        other => panic!("{other:?}"),
    }
    // wrong stage: nothing there
    assert!(matches!(
        DynamicVit::load(DynamicVitConfig::fixed(1, 0.7, 196), c, &vb),
        Err(PruneError::MissingWeight { .. })
    ));

    let mut bad = tensors(&w, 0, DType::F32);
    bad.insert(
        "score_predictor.0.in_conv.1.weight".into(),
        Tensor::zeros((c, c / 2), DType::F32, &Device::Cpu).unwrap(),
    );
    let path = dir.path().join("bad.safetensors");
    candle_core::safetensors::save(&bad, &path).unwrap();
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(&[&path], DType::F32, &Device::Cpu).unwrap() };
    match DynamicVit::load(DynamicVitConfig::fixed(0, 0.7, 196), c, &vb) {
        Err(e @ PruneError::WeightShape { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("score_predictor.0.in_conv.1.weight"), "{msg}");
            assert!(msg.contains("[8, 8]") && msg.contains("[8, 4]"), "{msg}");
        }
        other => panic!("{other:?}"),
    }
    // embedding width that does not match the checkpoint
    let vb = VarBuilder::from_tensors(tensors(&w, 0, DType::F32), DType::F32, &Device::Cpu);
    assert!(matches!(
        DynamicVit::load(DynamicVitConfig::fixed(0, 0.7, 196), 16, &vb),
        Err(PruneError::WeightShape { .. })
    ));
}

#[test]
fn random_init_is_reported_and_deterministic() {
    let c = 16;
    let a = DynamicVit::random_init(DynamicVitConfig::fixed(0, 0.7, 196), c, &Device::Cpu).unwrap();
    let b = DynamicVit::random_init(DynamicVitConfig::fixed(0, 0.7, 196), c, &Device::Cpu).unwrap();
    assert_eq!(a.weights_source(), WeightsSource::Random);
    assert_eq!(a.weights_source().to_string(), "random");
    assert_eq!(TokenPruner::weights_source(&a), Some(WeightsSource::Random));
    let x: Vec<Vec<f32>> = (0..9)
        .map(|i| pseudo(c, 70 + i, 1.0).iter().map(|&v| v as f32).collect())
        .collect();
    let (t, _) = pad_batch(&[x], 9, 0.0);
    let la = a
        .log_probs(&PruneInput::new(&t, 1))
        .unwrap()
        .to_vec3::<f32>()
        .unwrap();
    let lb = b
        .log_probs(&PruneInput::new(&t, 1))
        .unwrap()
        .to_vec3::<f32>()
        .unwrap();
    assert_eq!(la, lb);
    // schedule without weights -> random predictors
    let built = PruningSchedule::parse("dynamicvit-adaptive", 12)
        .unwrap()
        .build(12, c, None, &Device::Cpu)
        .unwrap();
    assert!(built
        .iter()
        .all(|(_, p)| p.weights_source() == Some(WeightsSource::Random)
            && p.mode() == Mode::Adaptive));
}

#[test]
fn half_precision_same_decisions() {
    let w = hand_weights();
    let imgs = [hand_tokens(&TS), hand_tokens(&[1.0, -3.0, 4.0])];
    let (t, lens) = pad_batch(&imgs, 7, 0.0);
    for mode in [
        DynamicVitMode::TopK { keep_ratio: 0.5 },
        DynamicVitMode::Probability { threshold: 0.5 },
    ] {
        let p = load(&w, 0, cfg(0, mode, 6), 4);
        let want = p
            .plan(&PruneInput::new(&t, 1).with_lengths(&lens))
            .unwrap()
            .indices;
        for dt in [DType::F16, DType::BF16] {
            let got = p
                .plan(&PruneInput::new(&to_dtype(&t, dt), 1).with_lengths(&lens))
                .unwrap()
                .indices;
            assert_eq!(got, want, "{dt:?} {mode:?}");
        }
    }
}

#[test]
fn bad_input_is_a_typed_error() {
    let p = DynamicVit::random_init(DynamicVitConfig::fixed(0, 0.7, 196), 8, &Device::Cpu).unwrap();
    let wrong_c = Tensor::zeros((1, 5, 4), DType::F32, &Device::Cpu).unwrap();
    assert!(matches!(
        p.plan(&PruneInput::new(&wrong_c, 1)),
        Err(PruneError::Shape { .. })
    ));
    let t = Tensor::zeros((2, 5, 8), DType::F32, &Device::Cpu).unwrap();
    assert!(matches!(
        p.plan(&PruneInput::new(&t, 1).with_lengths(&[5, 1])),
        Err(PruneError::BadLength { image: 1, .. })
    ));
    assert!(matches!(
        p.plan(&PruneInput::new(&t, 1).with_lengths(&[5])),
        Err(PruneError::InvalidInput(_))
    ));
    assert!(matches!(
        DynamicVit::random_init(DynamicVitConfig::fixed(0, 0.7, 196), 2, &Device::Cpu),
        Err(PruneError::InvalidConfig(_))
    ));
    // the Module impl turns typed errors into candle errors, never panics
    assert!(p.predictor().forward(&wrong_c).is_err());
    let _ = PredictorLG::tensor_specs(8);
}

#[test]
fn packed_scores_match_the_reference_and_the_image_path_bit_for_bit() {
    use candle_ragged::{pack, RaggedBatch};
    let c = 16;
    let w = random_weights(c, 17);
    let p = load(
        &w,
        1,
        cfg(1, DynamicVitMode::TopK { keep_ratio: 0.5 }, 12),
        c,
    );
    // Three images of different lengths (class token first), padding full of garbage.
    let imgs = pseudo_images(c, &[9, 4, 13], 500, 50, 2.0);
    let (t, lens) = pad_batch(&imgs, 13, 1e3);
    let input = PruneInput::new(&t, 1).with_lengths(&lens);
    let image_scores = p.scores(&input).unwrap().to_vec2::<f32>().unwrap();
    let batch = RaggedBatch::from_lengths(&lens, &Device::Cpu).unwrap();
    let packed = pack(&t, &batch).unwrap();
    let packed_scores = p
        .packed_scores(&packed, &batch, 1)
        .unwrap()
        .expect("dynamicvit scores packed tokens")
        .to_vec1::<f32>()
        .unwrap();
    let mut start = 0;
    for (b, img) in imgs.iter().enumerate() {
        let patches: Vec<Vec<f64>> = img[1..]
            .iter()
            .map(|r| r.iter().map(|&v| v as f64).collect())
            .collect();
        let want = reference(&patches, &w);
        for (j, r) in want.iter().enumerate() {
            let got = packed_scores[start + 1 + j];
            assert!(
                (got as f64 - r[0]).abs() < 1e-4,
                "image {b} patch {j}: {got} vs {}",
                r[0]
            );
            // The image-shaped scores are the packed ones, bit for bit.
            assert_eq!(
                image_scores[b][1 + j].to_bits(),
                got.to_bits(),
                "image {b} patch {j}"
            );
        }
        assert_eq!(image_scores[b][0], 0.0, "prefix score");
        start += img.len();
    }
    // Half precision: the packed formulation stays within the dtype's rounding of the module's.
    for dt in [DType::F16, DType::BF16] {
        let th = to_dtype(&t, dt);
        let module = p
            .log_probs(&PruneInput::new(&th, 1).with_lengths(&lens))
            .unwrap()
            .to_vec3::<f32>()
            .unwrap();
        let packed = p
            .packed_scores(&pack(&th, &batch).unwrap(), &batch, 1)
            .unwrap()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let mut start = 0;
        for (b, &len) in lens.iter().enumerate() {
            for j in 0..len - 1 {
                let (a, m) = (packed[start + 1 + j], module[b][j][0]);
                assert!(
                    (a - m).abs() < 2e-2,
                    "{dt:?} image {b} patch {j}: {a} vs {m}"
                );
            }
            start += len;
        }
    }
    // An image with nothing but its class token is a clear error.
    let only_cls = RaggedBatch::from_lengths(&[1, 3], &Device::Cpu).unwrap();
    let x = Tensor::zeros((4, c), DType::F32, &Device::Cpu).unwrap();
    assert!(p.packed_scores(&x, &only_cls, 1).is_err());
}

#[test]
fn packed_and_module_formulations_agree_at_deit_small_width() {
    use candle_ragged::{pack, RaggedBatch};
    let c = 384;
    let p = DynamicVit::random_init(DynamicVitConfig::adaptive(0, 196), c, &Device::Cpu).unwrap();
    let lens = [197usize, 140];
    let imgs = pseudo_images(c, &lens, 9000, 1000, 1.0);
    let (t, lens) = pad_batch(&imgs, 197, 0.0);
    let module = p
        .log_probs(&PruneInput::new(&t, 1).with_lengths(&lens))
        .unwrap()
        .to_vec3::<f32>()
        .unwrap();
    let batch = RaggedBatch::from_lengths(&lens, &Device::Cpu).unwrap();
    let packed = p
        .packed_scores(&pack(&t, &batch).unwrap(), &batch, 1)
        .unwrap()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let (mut worst, mut margins) = (0f32, Vec::new());
    let mut start = 0;
    for (b, &len) in lens.iter().enumerate() {
        for j in 0..len - 1 {
            worst = worst.max((packed[start + 1 + j] - module[b][j][0]).abs());
            margins.push((module[b][j][0] - 0.5f32.ln()).abs());
        }
        start += len;
    }
    margins.sort_by(f32::total_cmp);
    // The two formulations differ only in f32 rounding (the pooled half's product is rounded on
    // its own, the sums run in other orders).
    assert!(
        worst <= 1e-6,
        "packed vs module keep log-probs differ by {worst}"
    );
    // With the reference's random init the keep log-probs sit within ~1e-3 of ln 0.5, the closest
    // within a few ulps: rounding-level differences flip a few adaptive (p > 0.5) decisions, and
    // each later stage pools over the tokens the earlier ones kept, so the adaptive kept counts of
    // a random predictor move between formulations and dtypes (see docs/LEVERS.md).
    eprintln!(
        "max |packed - module| = {worst:e}; |log p - ln 0.5|: min {:e}, median {:e}, max {:e}",
        margins[0],
        margins[margins.len() / 2],
        margins[margins.len() - 1]
    );
}
