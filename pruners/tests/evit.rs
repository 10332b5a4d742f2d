mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use pruners::{
    Evit, EvitConfig, EvitFusion, EvitMode, PruneError, PruneInput, PruneSite, TokenPruner,
};

const C: usize = 3;

/// Class token then six patch tokens with distinct, easy values.
fn image() -> Vec<Vec<f32>> {
    (0..7)
        .map(|i| vec![i as f32, 10.0 - i as f32, (i * i) as f32 * 0.5])
        .collect()
}

/// Per-head class attention over the 7 tokens (2 heads); head means of the patches are
/// [0.30, 0.05, 0.20, 0.10, 0.25, 0.02] at positions 1..=6.
fn attn_heads() -> Vec<Vec<f32>> {
    let mean = [0.08f32, 0.30, 0.05, 0.20, 0.10, 0.25, 0.02];
    let delta = [0.01f32, 0.02, -0.01, 0.04, 0.0, -0.03, 0.01];
    vec![
        mean.iter().zip(delta).map(|(m, d)| m + d).collect(),
        mean.iter().zip(delta).map(|(m, d)| m - d).collect(),
    ]
}

fn attn_tensor(heads: &[Vec<Vec<f32>>], n: usize) -> Tensor {
    // [B, H, N], padding 0
    let b = heads.len();
    let h = heads[0].len();
    let mut data = vec![0f32; b * h * n];
    for (i, img) in heads.iter().enumerate() {
        for (k, row) in img.iter().enumerate() {
            data[(i * h + k) * n..(i * h + k) * n + row.len()].copy_from_slice(row);
        }
    }
    Tensor::from_vec(data, (b, h, n), &Device::Cpu).unwrap()
}

fn weighted(rows: &[(usize, f64)], img: &[Vec<f32>], normalise: bool) -> Vec<f32> {
    let total: f64 = rows.iter().map(|r| r.1).sum();
    (0..C)
        .map(|c| {
            let s: f64 = rows.iter().map(|&(j, a)| a * img[j][c] as f64).sum();
            (if normalise { s / total } else { s }) as f32
        })
        .collect()
}

fn close(a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() <= tol, "{a:?} vs {b:?}");
    }
}

#[test]
fn fixed_keeps_most_attended_and_fuses_rest() {
    let img = image();
    let (t, _) = pad_batch(std::slice::from_ref(&img), 7, 0.0);
    let a = attn_tensor(&[attn_heads()], 7);
    let p = Evit::new(EvitConfig::fixed(0.5)).unwrap();
    assert_eq!(p.site(), PruneSite::AfterAttention);
    assert!(p.needs().cls_attn && !p.needs().values);
    let plan = p.plan(&PruneInput::new(&t, 1).with_cls_attn(&a)).unwrap();
    // k = ceil(0.5 * 6) = 3: attention 0.30 (1), 0.25 (5), 0.20 (3)
    assert_eq!(plan.indices, vec![vec![0, 1, 3, 5]]);
    let fused = plan.fused.as_ref().unwrap();
    assert_eq!(fused.present, vec![true]);
    assert_eq!(plan.kept_counts(), vec![5]);
    // dropped: 2 (0.05), 4 (0.10), 6 (0.02)
    let want = weighted(&[(2, 0.05), (4, 0.10), (6, 0.02)], &img, true);
    close(&fused.tokens.to_vec2::<f32>().unwrap()[0], &want, 1e-5);

    let reference = Evit::new(EvitConfig {
        mode: EvitMode::TopK { keep_rate: 0.5 },
        fusion: EvitFusion::ReferenceSum,
    })
    .unwrap();
    let plan_r = reference
        .plan(&PruneInput::new(&t, 1).with_cls_attn(&a))
        .unwrap();
    assert_eq!(plan_r.indices, plan.indices);
    let want = weighted(&[(2, 0.05), (4, 0.10), (6, 0.02)], &img, false);
    close(
        &plan_r.fused.unwrap().tokens.to_vec2::<f32>().unwrap()[0],
        &want,
        1e-5,
    );

    let off = Evit::new(EvitConfig {
        mode: EvitMode::TopK { keep_rate: 0.5 },
        fusion: EvitFusion::Off,
    })
    .unwrap();
    let plan_o = off.plan(&PruneInput::new(&t, 1).with_cls_attn(&a)).unwrap();
    assert!(plan_o.fused.is_none());
    assert_eq!(plan_o.kept_counts(), vec![4]);

    // gather appends the fused token after the kept ones
    let (g, lens) = plan.gather_padded(&t).unwrap();
    assert_eq!(lens, vec![5]);
    let g = g.to_vec3::<f32>().unwrap();
    assert_eq!(g[0][3], img[5]);
    close(&g[0][4], &fused.tokens.to_vec2::<f32>().unwrap()[0], 0.0);
}

#[test]
fn head_averaged_attention_given_as_rank_2() {
    let img = image();
    let (t, _) = pad_batch(std::slice::from_ref(&img), 7, 0.0);
    let mean = Tensor::new(
        &[[0.08f32, 0.30, 0.05, 0.20, 0.10, 0.25, 0.02]],
        &Device::Cpu,
    )
    .unwrap();
    let p = Evit::new(EvitConfig::fixed(0.5)).unwrap();
    let plan = p
        .plan(&PruneInput::new(&t, 1).with_cls_attn(&mean))
        .unwrap();
    assert_eq!(plan.indices, vec![vec![0, 1, 3, 5]]);
}

#[test]
fn adaptive_keeps_smallest_set_with_attention_share() {
    let img = image();
    let (t, _) = pad_batch(std::slice::from_ref(&img), 7, 0.0);
    // patch masses sum to 1.0: sorted 0.4 (2), 0.3 (5), 0.1 (1), 0.1 (4), 0.05 (3), 0.05 (6)
    let a = Tensor::new(&[[0.5f32, 0.1, 0.4, 0.05, 0.1, 0.3, 0.05]], &Device::Cpu).unwrap();
    let run = |share: f64| {
        Evit::new(EvitConfig::adaptive(share))
            .unwrap()
            .plan(&PruneInput::new(&t, 1).with_cls_attn(&a))
            .unwrap()
    };
    assert_eq!(run(0.35).indices, vec![vec![0, 2]]);
    assert_eq!(run(0.65).indices, vec![vec![0, 2, 5]]);
    // 0.4 + 0.3 + 0.1 = 0.8 >= 0.75; the tie 0.1 / 0.1 goes to the lower index (1 before 4)
    assert_eq!(run(0.75).indices, vec![vec![0, 1, 2, 5]]);
    assert_eq!(run(0.85).indices, vec![vec![0, 1, 2, 4, 5]]);
    let plan = run(0.65);
    // fused from 1, 3, 4, 6 with masses 0.1, 0.05, 0.1, 0.05
    let want = weighted(&[(1, 0.1), (3, 0.05), (4, 0.1), (6, 0.05)], &img, true);
    close(
        &plan.fused.unwrap().tokens.to_vec2::<f32>().unwrap()[0],
        &want,
        1e-5,
    );
    // share 1.0 keeps everything with mass, nothing to fuse
    let all = Tensor::new(&[[0.5f32, 0.2, 0.2, 0.2, 0.1, 0.2, 0.1]], &Device::Cpu).unwrap();
    let plan = Evit::new(EvitConfig::adaptive(1.0))
        .unwrap()
        .plan(&PruneInput::new(&t, 1).with_cls_attn(&all))
        .unwrap();
    assert_eq!(plan.indices[0].len(), 7);
    assert!(!plan.has_fused(0));
}

#[test]
fn nothing_pruned_means_no_fused_token() {
    let img = image();
    let (t, _) = pad_batch(std::slice::from_ref(&img), 7, 0.0);
    let a = attn_tensor(&[attn_heads()], 7);
    let plan = Evit::new(EvitConfig::fixed(1.0))
        .unwrap()
        .plan(&PruneInput::new(&t, 1).with_cls_attn(&a))
        .unwrap();
    assert_eq!(plan.indices, vec![vec![0, 1, 2, 3, 4, 5, 6]]);
    assert_eq!(plan.fused.as_ref().unwrap().present, vec![false]);
    assert_eq!(plan.kept_counts(), vec![7]);
    // single patch token: ceil(0.5 * 1) = 1 keeps it
    let (t1, _) = pad_batch(&[img[..2].to_vec()], 2, 0.0);
    let a1 = Tensor::new(&[[0.9f32, 0.1]], &Device::Cpu).unwrap();
    let plan = Evit::new(EvitConfig::fixed(0.5))
        .unwrap()
        .plan(&PruneInput::new(&t1, 1).with_cls_attn(&a1))
        .unwrap();
    assert_eq!(plan.indices, vec![vec![0, 1]]);
    assert!(!plan.has_fused(0));
}

#[test]
fn zero_attention_on_dropped_tokens_fuses_plain_mean() {
    let img = image();
    let (t, _) = pad_batch(std::slice::from_ref(&img), 7, 0.0);
    let a = Tensor::new(&[[0.5f32, 0.2, 0.0, 0.2, 0.0, 0.1, 0.0]], &Device::Cpu).unwrap();
    let plan = Evit::new(EvitConfig::fixed(0.5))
        .unwrap()
        .plan(&PruneInput::new(&t, 1).with_cls_attn(&a))
        .unwrap();
    assert_eq!(plan.indices, vec![vec![0, 1, 3, 5]]);
    let want = weighted(&[(2, 1.0), (4, 1.0), (6, 1.0)], &img, true);
    close(
        &plan.fused.unwrap().tokens.to_vec2::<f32>().unwrap()[0],
        &want,
        1e-5,
    );
}

#[test]
fn padding_and_neighbours_do_not_change_decisions() {
    let img = image();
    let heads = attn_heads();
    let other: Vec<Vec<f32>> = (0..10).map(|i| vec![1.0, i as f32, 2.0]).collect();
    let other_attn: Vec<Vec<f32>> = (0..2).map(|_| vec![0.1; 10]).collect();
    let short: Vec<Vec<f32>> = (0..3).map(|i| vec![i as f32, 1.0, 1.0]).collect();
    let short_attn: Vec<Vec<f32>> = vec![vec![0.2, 0.5, 0.3]; 2];
    for cfg in [EvitConfig::fixed(0.5), EvitConfig::adaptive(0.7)] {
        let p = Evit::new(cfg).unwrap();
        let (t1, _) = pad_batch(std::slice::from_ref(&img), 7, 0.0);
        let a1 = attn_tensor(std::slice::from_ref(&heads), 7);
        let alone = p.plan(&PruneInput::new(&t1, 1).with_cls_attn(&a1)).unwrap();
        let (tb, lens) = pad_batch(&[other.clone(), img.clone(), short.clone()], 12, 0.0);
        // padding attention is large: it would win if it were looked at
        let mut ab = attn_tensor(&[other_attn.clone(), heads.clone(), short_attn.clone()], 12)
            .to_vec3::<f32>()
            .unwrap();
        for (img_attn, len) in ab.iter_mut().zip(&lens) {
            for head in img_attn.iter_mut() {
                head[*len..].fill(5.0);
            }
        }
        let ab = Tensor::new(ab, &Device::Cpu).unwrap();
        let batch = p
            .plan(
                &PruneInput::new(&tb, 1)
                    .with_lengths(&lens)
                    .with_cls_attn(&ab),
            )
            .unwrap();
        assert_eq!(batch.indices[1], alone.indices[0], "{cfg:?}");
        for (b, idx) in batch.indices.iter().enumerate() {
            assert!(idx.iter().all(|&j| (j as usize) < lens[b]));
        }
        let f_alone = alone.fused.unwrap().tokens.to_vec2::<f32>().unwrap();
        let f_batch = batch.fused.unwrap().tokens.to_vec2::<f32>().unwrap();
        close(&f_batch[1], &f_alone[0], 1e-6);
    }
}

#[test]
fn half_precision_same_decisions() {
    let img = image();
    let (t, _) = pad_batch(std::slice::from_ref(&img), 7, 0.0);
    let a = attn_tensor(&[attn_heads()], 7);
    let p = Evit::new(EvitConfig::fixed(0.5)).unwrap();
    let want = p.plan(&PruneInput::new(&t, 1).with_cls_attn(&a)).unwrap();
    let wf = want.fused.unwrap().tokens.to_vec2::<f32>().unwrap();
    for dt in [DType::F16, DType::BF16] {
        let (th, ah) = (to_dtype(&t, dt), to_dtype(&a, dt));
        let got = p.plan(&PruneInput::new(&th, 1).with_cls_attn(&ah)).unwrap();
        assert_eq!(got.indices, want.indices);
        let f = got.fused.unwrap().tokens;
        assert_eq!(f.dtype(), dt);
        let f = to_dtype(&f, DType::F32).to_vec2::<f32>().unwrap();
        close(&f[0], &wf[0], 0.1);
    }
}

#[test]
fn missing_or_misshaped_attention_is_an_error() {
    let (t, _) = pad_batch(&[image()], 7, 0.0);
    let p = Evit::new(EvitConfig::fixed(0.5)).unwrap();
    assert!(matches!(
        p.plan(&PruneInput::new(&t, 1)),
        Err(PruneError::MissingInput { pruner: "evit", .. })
    ));
    let bad = Tensor::zeros((1, 2, 6), DType::F32, &Device::Cpu).unwrap();
    assert!(matches!(
        p.plan(&PruneInput::new(&t, 1).with_cls_attn(&bad)),
        Err(PruneError::Shape {
            what: "cls_attn",
            ..
        })
    ));
    let bad_b = Tensor::zeros((2, 7), DType::F32, &Device::Cpu).unwrap();
    assert!(matches!(
        p.plan(&PruneInput::new(&t, 1).with_cls_attn(&bad_b)),
        Err(PruneError::Shape { .. })
    ));
    let rank4 = Tensor::zeros((1, 2, 7, 7), DType::F32, &Device::Cpu).unwrap();
    assert!(matches!(
        p.plan(&PruneInput::new(&t, 1).with_cls_attn(&rank4)),
        Err(PruneError::Shape { .. })
    ));
    assert!(matches!(
        Evit::new(EvitConfig::adaptive(0.0)),
        Err(PruneError::InvalidConfig(_))
    ));
}

#[test]
fn prefix_of_two_is_never_ranked() {
    let img = image();
    let (t, _) = pad_batch(std::slice::from_ref(&img), 7, 0.0);
    // the distillation token (position 1) has the lowest attention, but is kept
    let a = Tensor::new(&[[0.3f32, 0.0, 0.05, 0.2, 0.1, 0.25, 0.1]], &Device::Cpu).unwrap();
    let plan = Evit::new(EvitConfig::fixed(0.4))
        .unwrap()
        .plan(&PruneInput::new(&t, 2).with_cls_attn(&a))
        .unwrap();
    // 5 patches, k = ceil(2.0) = 2: positions 5 (0.25), 3 (0.2)
    assert_eq!(plan.indices, vec![vec![0, 1, 3, 5]]);
    // fused from 2, 4, 6 (0.05, 0.1, 0.1)
    let want = weighted(&[(2, 0.05), (4, 0.1), (6, 0.1)], &img, true);
    close(
        &plan.fused.unwrap().tokens.to_vec2::<f32>().unwrap()[0],
        &want,
        1e-5,
    );
}

/// The recipe EViT declares (a model may compute it inside its selection kernel) is what its
/// scores are: the class attention averaged over heads, in every mode.
#[test]
fn scores_follow_the_declared_recipe() {
    let (t, _) = pad_batch(&[image()], 7, 0.0);
    let a = attn_tensor(&[attn_heads()], 7);
    for mode in [
        EvitMode::TopK { keep_rate: 0.5 },
        EvitMode::AttentionMass { share: 0.9 },
    ] {
        let p = Evit::new(EvitConfig {
            mode,
            fusion: EvitFusion::WeightedMean,
        })
        .unwrap();
        assert_eq!(p.score_recipe(), pruners::ScoreRecipe::ClsAttentionMean);
        let got: Vec<f32> = p
            .scores(&PruneInput::new(&t, 1).with_cls_attn(&a))
            .unwrap()
            .squeeze(0)
            .unwrap()
            .to_vec1()
            .unwrap();
        let heads = attn_heads();
        for (j, g) in got.iter().enumerate() {
            let want = (heads[0][j] + heads[1][j]) / 2.0;
            assert!((g - want).abs() < 1e-7, "token {j}: {g} vs {want}");
        }
    }
}
