mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use pruners::{
    inverse_transform_sample, Ats, AtsConfig, PruneError, PruneInput, PruneSite, TokenPruner,
};

fn tokens(n: usize) -> Tensor {
    let rows: Vec<Vec<f32>> = (0..n).map(|i| vec![i as f32, 1.0]).collect();
    pad_batch(&[rows], n, 0.0).0
}

/// Class token + 4 patches with significance 0.3 (1), 0.1 (2), 0.4 (3), 0.2 (4)
/// (value norms 1). Sorted ascending: 2, 4, 1, 3; cdf 0.1, 0.3, 0.6, 1.0;
/// normalised (cdf - 0.1) / 0.9 = 0, 2/9, 5/9, 1.
fn plan_known(cfg: AtsConfig) -> Vec<u32> {
    let t = tokens(5);
    let a = Tensor::new(&[[0.5f32, 0.3, 0.1, 0.4, 0.2]], &Device::Cpu).unwrap();
    let v = Tensor::ones((1, 5), DType::F32, &Device::Cpu).unwrap();
    Ats::new(cfg)
        .unwrap()
        .plan(
            &PruneInput::new(&t, 1)
                .with_cls_attn(&a)
                .with_value_norms(&v),
        )
        .unwrap()
        .indices[0]
        .clone()
}

#[test]
fn known_distribution_keeps_expected_samples() {
    // K = 3 (ceil(0.75 * 4)): y = 2/9, 11/18, 1 -> sorted positions 1, 2, 3 -> tokens 4, 1, 3
    assert_eq!(plan_known(AtsConfig::fixed(0.75)), vec![0, 1, 3, 4]);
    // K = 2: y = 2/9, 1 -> tokens 4, 3
    assert_eq!(plan_known(AtsConfig::fixed(0.5)), vec![0, 3, 4]);
    // K = 1: y = 1 -> the most significant token
    assert_eq!(plan_known(AtsConfig::fixed(0.25)), vec![0, 3]);
    // adaptive, 196 sample points: every token with a non-zero normalised CDF is hit once,
    // duplicates collapse: 3 tokens, the least significant (normalised CDF 0) is dropped
    assert_eq!(plan_known(AtsConfig::adaptive(196)), vec![0, 1, 3, 4]);
    let p = Ats::new(AtsConfig::adaptive(196)).unwrap();
    assert_eq!(p.site(), PruneSite::AfterAttention);
    assert!(p.needs().cls_attn && p.needs().values);
}

#[test]
fn duplicates_collapse_below_budget() {
    // sorted: 0.01 (1), 0.01 (2), 0.01 (3), 0.97 (4); normalised CDF 0, 1/99, 2/99, 1.
    // K = 4: y = 1/99 + i * (98/99) / 3 = .0101, .3401, .6700, 1.0
    //   -> positions 1 (token 2), 2 (token 3), 3 (token 4), 3 (token 4) -> 3 unique tokens
    let picked = inverse_transform_sample(&[0.01, 0.01, 0.01, 0.97], 4);
    let mut picked = picked;
    picked.sort();
    assert_eq!(picked, vec![1, 2, 3]);
    // a dominant token and K = 2: y = 1/99, 1
    let mut p2 = inverse_transform_sample(&[0.01, 0.01, 0.01, 0.97], 2);
    p2.sort();
    assert_eq!(p2, vec![1, 3]);
}

#[test]
fn scores_use_head_sum_times_value_norm() {
    // two heads, values with chosen norms: token j value = [3s, 0 | 0, 4s] -> norm 5s
    let n = 5;
    let t = tokens(n);
    let heads = [[0.2f32, 0.1, 0.05, 0.3, 0.1], [0.2f32, 0.1, 0.15, 0.0, 0.2]];
    let scale = [1.0f32, 1.0, 4.0, 1.0, 0.5];
    // head sums: .4 .2 .2 .3 .3; norms 5 5 20 5 2.5 -> S = 2 | 1, 4, 1.5, .75 (patches 1..4)
    let a = Tensor::new(&[heads], &Device::Cpu).unwrap();
    let mut v = vec![0f32; 2 * n * 2];
    for j in 0..n {
        v[j * 2] = 3.0 * scale[j]; // head 0, token j, d 0
        v[(n + j) * 2 + 1] = 4.0 * scale[j]; // head 1, token j, d 1
    }
    let v = Tensor::from_vec(v, (1, 2, n, 2), &Device::Cpu).unwrap();
    let p = Ats::new(AtsConfig::fixed(0.5)).unwrap();
    let s = p
        .scores(&PruneInput::new(&t, 1).with_cls_attn(&a).with_values(&v))
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let want = [2.0f32, 1.0, 4.0, 1.5, 0.75];
    for (x, y) in s[0].iter().zip(want) {
        assert!((x - y).abs() < 1e-5, "{s:?}");
    }
    // sorted: .75 (4), 1 (1), 1.5 (3), 4 (2); cdf (/7.25): .1034 .2414 .4483 1
    // normalised: 0, .1538, .3846, 1; K = 2: y = .1538, 1 -> tokens 1, 2
    let plan = p
        .plan(&PruneInput::new(&t, 1).with_cls_attn(&a).with_values(&v))
        .unwrap();
    assert_eq!(plan.indices, vec![vec![0, 1, 2]]);
    assert!(plan.fused.is_none());
}

#[test]
fn padding_and_neighbours_do_not_change_decisions() {
    let a_row = vec![0.5f32, 0.3, 0.1, 0.4, 0.2];
    let long_row: Vec<f32> = (0..9).map(|i| 0.05 + i as f32 * 0.01).collect();
    for cfg in [
        AtsConfig::fixed(0.75),
        AtsConfig::adaptive(196),
        AtsConfig::fixed(0.5),
    ] {
        let p = Ats::new(cfg).unwrap();
        let alone = plan_known(cfg);
        let rows = vec![long_row.clone(), a_row.clone(), vec![0.5, 0.5]];
        let (t, lens) = pad_batch(
            &rows
                .iter()
                .map(|r| (0..r.len()).map(|i| vec![i as f32, 2.0]).collect())
                .collect::<Vec<_>>(),
            9,
            0.0,
        );
        // padding has huge attention and norms
        let a = pad_rows(&rows, 9, 9.0);
        let v = pad_rows(
            &rows.iter().map(|r| vec![1.0; r.len()]).collect::<Vec<_>>(),
            9,
            9.0,
        );
        let plan = p
            .plan(
                &PruneInput::new(&t, 1)
                    .with_lengths(&lens)
                    .with_cls_attn(&a)
                    .with_value_norms(&v),
            )
            .unwrap();
        assert_eq!(plan.indices[1], alone, "{cfg:?}");
        for (b, idx) in plan.indices.iter().enumerate() {
            assert!(idx.len() >= 2 && idx[0] == 0);
            assert!(idx.iter().all(|&j| (j as usize) < lens[b]));
        }
    }
}

#[test]
fn degenerate_scores_still_keep_a_patch() {
    let t = tokens(4);
    let zeros = Tensor::zeros((1, 4), DType::F32, &Device::Cpu).unwrap();
    let ones = Tensor::ones((1, 4), DType::F32, &Device::Cpu).unwrap();
    for cfg in [AtsConfig::fixed(0.1), AtsConfig::adaptive(196)] {
        let plan = Ats::new(cfg)
            .unwrap()
            .plan(
                &PruneInput::new(&t, 1)
                    .with_cls_attn(&zeros)
                    .with_value_norms(&ones),
            )
            .unwrap();
        assert!(plan.indices[0].len() >= 2);
        assert_eq!(plan.indices[0][0], 0);
    }
    // a NaN score is treated as zero significance
    let nan = Tensor::new(&[[0.5f32, f32::NAN, 0.2, 0.8]], &Device::Cpu).unwrap();
    let plan = Ats::new(AtsConfig::fixed(0.34))
        .unwrap()
        .plan(
            &PruneInput::new(&t, 1)
                .with_cls_attn(&nan)
                .with_value_norms(&ones),
        )
        .unwrap();
    // patches: 0 (NaN), 0.2, 0.8; normalised CDF 0, 0.2, 1; K = ceil(1.02) = 2: y = 0.2, 1
    assert_eq!(plan.indices, vec![vec![0, 2, 3]]);
}

#[test]
fn half_precision_same_decisions() {
    let t = tokens(5);
    let a = Tensor::new(&[[0.5f32, 0.3, 0.1, 0.4, 0.2]], &Device::Cpu).unwrap();
    let v = Tensor::new(&[[1.0f32, 2.0, 1.0, 1.0, 3.0]], &Device::Cpu).unwrap();
    let p = Ats::new(AtsConfig::fixed(0.75)).unwrap();
    let want = p
        .plan(
            &PruneInput::new(&t, 1)
                .with_cls_attn(&a)
                .with_value_norms(&v),
        )
        .unwrap()
        .indices;
    for dt in [DType::F16, DType::BF16] {
        let got = p
            .plan(
                &PruneInput::new(&to_dtype(&t, dt), 1)
                    .with_cls_attn(&to_dtype(&a, dt))
                    .with_value_norms(&to_dtype(&v, dt)),
            )
            .unwrap()
            .indices;
        assert_eq!(got, want, "{dt:?}");
    }
}

#[test]
fn missing_inputs_are_errors() {
    let t = tokens(5);
    let a = Tensor::ones((1, 5), DType::F32, &Device::Cpu).unwrap();
    let p = Ats::new(AtsConfig::fixed(0.5)).unwrap();
    assert!(matches!(
        p.plan(&PruneInput::new(&t, 1).with_value_norms(&a)),
        Err(PruneError::MissingInput { pruner: "ats", .. })
    ));
    assert!(matches!(
        p.plan(&PruneInput::new(&t, 1).with_cls_attn(&a)),
        Err(PruneError::MissingInput { pruner: "ats", .. })
    ));
    let bad_v = Tensor::ones((1, 2, 4, 3), DType::F32, &Device::Cpu).unwrap();
    assert!(matches!(
        p.plan(&PruneInput::new(&t, 1).with_cls_attn(&a).with_values(&bad_v)),
        Err(PruneError::Shape { what: "values", .. })
    ));
    let bad_n = Tensor::ones((2, 5), DType::F32, &Device::Cpu).unwrap();
    assert!(matches!(
        p.plan(
            &PruneInput::new(&t, 1)
                .with_cls_attn(&a)
                .with_value_norms(&bad_n)
        ),
        Err(PruneError::Shape {
            what: "value_norms",
            ..
        })
    ));
    assert!(matches!(
        Ats::new(AtsConfig::adaptive(0)),
        Err(PruneError::InvalidConfig(_))
    ));
}
