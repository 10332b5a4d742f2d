mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use pruners::{
    Mode, PruneError, PruneInput, PruneSite, ThresholdL2, ThresholdL2Config, TokenPruner,
};

// Patch norms of one image, positions 1..=6 after the class token.
const NORMS: [f32; 6] = [5.0, 1.0, 4.0, 2.0, 3.0, 0.5];

fn plan(cfg: ThresholdL2Config, norms: &[f32], prefix: usize) -> Vec<u32> {
    let img = image_with_norms(prefix, norms, 8);
    let (t, _) = pad_batch(&[img], prefix + norms.len(), 0.0);
    let p = ThresholdL2::new(cfg).unwrap();
    p.plan(&PruneInput::new(&t, prefix)).unwrap().indices[0].clone()
}

#[test]
fn fixed_keeps_top_k_norms() {
    // k = ceil(0.5 * 6) = 3 -> norms 5, 4, 3 at positions 1, 3, 5
    assert_eq!(
        plan(ThresholdL2Config::fixed(0.5), &NORMS, 1),
        vec![0, 1, 3, 5]
    );
    // k = ceil(0.34 * 6) = ceil(2.04) = 3
    assert_eq!(
        plan(ThresholdL2Config::fixed(0.34), &NORMS, 1),
        vec![0, 1, 3, 5]
    );
    // k = ceil(0.1 * 6) = 1
    assert_eq!(plan(ThresholdL2Config::fixed(0.1), &NORMS, 1), vec![0, 1]);
    assert_eq!(
        plan(ThresholdL2Config::fixed(1.0), &NORMS, 1),
        vec![0, 1, 2, 3, 4, 5, 6]
    );
}

#[test]
fn distillation_prefix_always_kept() {
    // two prefix tokens with tiny norms; patches at 2..=7
    assert_eq!(
        plan(ThresholdL2Config::fixed(0.5), &NORMS, 2),
        vec![0, 1, 2, 4, 6]
    );
    assert_eq!(
        plan(ThresholdL2Config::absolute(100.0), &NORMS, 2),
        vec![0, 1, 2]
    );
}

#[test]
fn adaptive_absolute_and_relative() {
    assert_eq!(
        plan(ThresholdL2Config::absolute(2.5), &NORMS, 1),
        vec![0, 1, 3, 5]
    );
    // threshold equal to a norm keeps it (>=): exact norms from one-hot tokens
    let exact: Vec<Vec<f32>> = [0.0f32, 5.0, 1.0, 4.0, 2.0]
        .iter()
        .map(|&n| vec![0.0, n, 0.0])
        .collect();
    let (t, _) = pad_batch(&[exact], 5, 0.0);
    let p = ThresholdL2::new(ThresholdL2Config::absolute(4.0)).unwrap();
    assert_eq!(
        p.plan(&PruneInput::new(&t, 1)).unwrap().indices[0],
        vec![0, 1, 3]
    );
    // mean = 15.5 / 6 = 2.5833; factor 1.5 -> 3.875: norms 5, 4
    assert_eq!(
        plan(ThresholdL2Config::relative(1.5), &NORMS, 1),
        vec![0, 1, 3]
    );
    // factor 1.0 -> 2.5833: norms 5, 4, 3
    assert_eq!(
        plan(ThresholdL2Config::relative(1.0), &NORMS, 1),
        vec![0, 1, 3, 5]
    );
    let p = ThresholdL2::new(ThresholdL2Config::relative(1.0)).unwrap();
    assert_eq!(p.mode(), Mode::Adaptive);
    assert_eq!(p.site(), PruneSite::BeforeBlock);
    assert!(!p.needs().cls_attn && !p.needs().values);
}

#[test]
fn at_least_one_patch_kept_when_threshold_removes_all() {
    assert_eq!(
        plan(ThresholdL2Config::absolute(1e9), &NORMS, 1),
        vec![0, 1]
    );
    assert_eq!(
        plan(ThresholdL2Config::relative(50.0), &NORMS, 1),
        vec![0, 1]
    );
    // single patch token image
    assert_eq!(plan(ThresholdL2Config::fixed(0.1), &[2.0], 1), vec![0, 1]);
}

#[test]
fn ties_break_to_lower_index() {
    assert_eq!(
        plan(ThresholdL2Config::fixed(0.5), &[2.0; 4], 1),
        vec![0, 1, 2]
    );
    assert_eq!(
        plan(ThresholdL2Config::fixed(0.5), &[1.0, 3.0, 3.0, 3.0], 1),
        vec![0, 2, 3]
    );
}

#[test]
fn padding_never_kept_and_neighbours_do_not_matter() {
    let a = image_with_norms(1, &NORMS, 8);
    let long = image_with_norms(1, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0], 8);
    let short = image_with_norms(1, &[7.0, 0.1], 8);
    for cfg in [
        ThresholdL2Config::fixed(0.5),
        ThresholdL2Config::absolute(2.5),
        ThresholdL2Config::relative(1.0),
    ] {
        let p = ThresholdL2::new(cfg).unwrap();
        let (alone, _) = pad_batch(std::slice::from_ref(&a), 7, 0.0);
        let want = p.plan(&PruneInput::new(&alone, 1)).unwrap().indices[0].clone();
        // padding rows have huge norms: they would win every ranking if looked at
        let (batch, lens) = pad_batch(&[short.clone(), a.clone(), long.clone()], 11, 1000.0);
        let plan = p
            .plan(&PruneInput::new(&batch, 1).with_lengths(&lens))
            .unwrap();
        assert_eq!(plan.indices[1], want, "{cfg:?}");
        for (b, idx) in plan.indices.iter().enumerate() {
            assert!(
                idx.iter().all(|&j| (j as usize) < lens[b]),
                "{cfg:?} {idx:?}"
            );
            assert_eq!(idx[0], 0);
            assert!(idx.windows(2).all(|w| w[0] < w[1]));
        }
    }
}

#[test]
fn half_precision_same_decisions() {
    let imgs = [
        image_with_norms(1, &NORMS, 16),
        image_with_norms(1, &[0.5, 9.0, 2.0], 16),
    ];
    let (t, lens) = pad_batch(&imgs, 7, 0.0);
    for cfg in [
        ThresholdL2Config::fixed(0.5),
        ThresholdL2Config::relative(1.0),
    ] {
        let p = ThresholdL2::new(cfg).unwrap();
        let want = p
            .plan(&PruneInput::new(&t, 1).with_lengths(&lens))
            .unwrap()
            .indices;
        for dt in [DType::F16, DType::BF16] {
            let th = to_dtype(&t, dt);
            let got = p
                .plan(&PruneInput::new(&th, 1).with_lengths(&lens))
                .unwrap()
                .indices;
            assert_eq!(got, want, "{dt:?}");
            assert_eq!(
                p.scores(&PruneInput::new(&th, 1)).unwrap().dtype(),
                DType::F32
            );
        }
    }
}

#[test]
fn bad_input_is_a_typed_error() {
    let p = ThresholdL2::new(ThresholdL2Config::fixed(0.5)).unwrap();
    let (t, _) = pad_batch(&[image_with_norms(1, &NORMS, 4)], 7, 0.0);
    let e = |r: pruners::Result<pruners::KeepPlan>| r.unwrap_err();
    assert!(matches!(
        e(p.plan(&PruneInput::new(&t, 1).with_lengths(&[0]))),
        PruneError::BadLength {
            image: 0,
            length: 0,
            ..
        }
    ));
    // only the class token: no patch token
    assert!(matches!(
        e(p.plan(&PruneInput::new(&t, 1).with_lengths(&[1]))),
        PruneError::BadLength { .. }
    ));
    assert!(matches!(
        e(p.plan(&PruneInput::new(&t, 1).with_lengths(&[8]))),
        PruneError::BadLength {
            length: 8,
            max: 7,
            ..
        }
    ));
    assert!(matches!(
        e(p.plan(&PruneInput::new(&t, 1).with_lengths(&[7, 7]))),
        PruneError::InvalidInput(_)
    ));
    assert!(matches!(
        e(p.plan(&PruneInput::new(&t, 0))),
        PruneError::InvalidInput(_)
    ));
    let flat = t.squeeze(0).unwrap();
    assert!(matches!(
        e(p.plan(&PruneInput::new(&flat, 1))),
        PruneError::Shape { what: "tokens", .. }
    ));
    let ints = Tensor::zeros((1, 7, 4), DType::U32, &Device::Cpu).unwrap();
    assert!(matches!(
        e(p.plan(&PruneInput::new(&ints, 1))),
        PruneError::InvalidInput(_)
    ));
    let empty = Tensor::zeros((0, 7, 4), DType::F32, &Device::Cpu).unwrap();
    assert!(matches!(
        e(p.plan(&PruneInput::new(&empty, 1))),
        PruneError::InvalidInput(_)
    ));
    assert!(matches!(
        ThresholdL2::new(ThresholdL2Config::fixed(0.0)),
        Err(PruneError::InvalidConfig(_))
    ));
    assert!(matches!(
        ThresholdL2::new(ThresholdL2Config::fixed(1.5)),
        Err(PruneError::InvalidConfig(_))
    ));
}

#[test]
fn keep_mask_and_gather_follow_the_plan() {
    let imgs = [
        image_with_norms(1, &NORMS, 4),
        image_with_norms(1, &[3.0, 1.0, 2.0], 4),
    ];
    let (t, lens) = pad_batch(&imgs, 7, 0.0);
    let p = ThresholdL2::new(ThresholdL2Config::fixed(0.5)).unwrap();
    let plan = p.plan(&PruneInput::new(&t, 1).with_lengths(&lens)).unwrap();
    assert_eq!(plan.indices, vec![vec![0, 1, 3, 5], vec![0, 1, 3]]);
    assert_eq!(plan.kept_counts(), vec![4, 3]);
    assert_eq!(plan.kept_patch_counts(), vec![3, 2]);
    assert_eq!(plan.max_len(), 4);
    let mask = plan
        .keep_mask(7, &Device::Cpu)
        .unwrap()
        .to_vec2::<u8>()
        .unwrap();
    assert_eq!(mask[0], vec![1, 1, 0, 1, 0, 1, 0]);
    assert_eq!(mask[1], vec![1, 1, 0, 1, 0, 0, 0]);
    assert!(plan.keep_mask(3, &Device::Cpu).is_err());
    let (g, new_lens) = plan.gather_padded(&t).unwrap();
    assert_eq!(new_lens, vec![4, 3]);
    assert_eq!(g.dims(), &[2, 4, 4]);
    let g = g.to_vec3::<f32>().unwrap();
    assert_eq!(g[0][2], imgs[0][3]);
    assert_eq!(g[0][3], imgs[0][5]);
    assert_eq!(g[1][2], imgs[1][3]);
    assert_eq!(g[1][3], vec![0.0; 4]);
}

/// The recipe Threshold-L2 declares (a model may compute it inside its selection kernel) is
/// what its scores are: each token's L2 norm, in every mode.
#[test]
fn scores_follow_the_declared_recipe() {
    let img = image_with_norms(1, &NORMS, 8);
    let (t, _) = pad_batch(&[img], 1 + NORMS.len(), 0.0);
    for cfg in [
        ThresholdL2Config::fixed(0.5),
        ThresholdL2Config::absolute(4.0),
        ThresholdL2Config::relative(1.0),
    ] {
        let p = ThresholdL2::new(cfg).unwrap();
        assert_eq!(p.score_recipe(), pruners::ScoreRecipe::TokenL2Norm);
        let got: Vec<f32> = p
            .scores(&PruneInput::new(&t, 1))
            .unwrap()
            .squeeze(0)
            .unwrap()
            .to_vec1()
            .unwrap();
        for (g, want) in got[1..].iter().zip(NORMS) {
            assert!((g - want).abs() < 1e-5, "{g} vs {want}");
        }
    }
}
