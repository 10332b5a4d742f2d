//! `step_scores` (lever 87: a fixed-count step's scores laid out as the select kernel reads them,
//! for candle-fastpath's `select_mlp_block`) and the fused row's batch invariance that lever
//! needs: given scores pass through; class attention and significance come, on CUDA, as the
//! `cls_probs` rows (each head's probabilities against a host softmax over the rounded logits,
//! the value rows' sums of squares), on the CPU as the final scores the CPU select ranks (ranking
//! them as given scores keeps the same rows, bit for bit). Bad input is an error. Outputs are
//! poisoned before each call.

mod common;

use candle_core::{DType, Tensor};
use candle_ragged::{
    select_top_k_by, step_scores, DroppedFusion, RaggedError, StepScoreLayout, StepScores,
    TokenScores,
};
use common::{class_scores, device, host, poison, quantize, randn, rng};

/// Each head's class-token softmax of one sequence of `qkv` (`[len, 3c]` as host f32 values
/// already rounded to the storage type), with the logits rounded as the kernels round them
/// (q_cls · scale, then each dot product, to `dtype`; the dot products as the kernel's f32
/// fused multiply-adds in ascending order), the softmax in f64; and each value row's sum of
/// squares.
fn host_probs(
    qkv: &[f32],
    len: usize,
    c: usize,
    heads: usize,
    scale: f32,
    dtype: DType,
) -> (Vec<Vec<f64>>, Vec<f64>) {
    let d = c / heads;
    let r = |v: f32| quantize(&[v], dtype)[0];
    let mut probs = Vec::with_capacity(heads);
    for h in 0..heads {
        let q: Vec<f32> = (0..d).map(|i| r(qkv[h * d + i] * scale)).collect();
        let logits: Vec<f64> = (0..len)
            .map(|j| {
                let k = &qkv[j * 3 * c + c + h * d..j * 3 * c + c + (h + 1) * d];
                // The kernel's dot_row: f32 fused multiply-adds in ascending order.
                r(q.iter()
                    .zip(k)
                    .fold(0f32, |acc, (&a, &b)| a.mul_add(b, acc))) as f64
            })
            .collect();
        let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = logits.iter().map(|l| (l - m).exp()).sum();
        probs.push(logits.iter().map(|l| (l - m).exp() / sum).collect());
    }
    let v_sq = (0..len)
        .map(|j| {
            qkv[j * 3 * c + 2 * c..j * 3 * c + 3 * c]
                .iter()
                .map(|&v| (v as f64) * (v as f64))
                .sum()
        })
        .collect();
    (probs, v_sq)
}

#[test]
fn step_scores_are_what_the_selection_ranks() {
    let dev = device();
    let mut r = rng(870);
    let (heads, d) = (3, 64);
    let c = heads * d;
    let scale = (d as f32).powf(-0.5);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for (b, len) in [(1, 2), (1, 65), (1, 197), (3, 63), (2, 577)] {
            let what = format!("{dtype:?} b {b} len {len}");
            let qkv_host = quantize(&randn(&mut r, b * len * 3 * c, 1.0), dtype);
            let qkv = Tensor::from_slice(&qkv_host, (b * len, 3 * c), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let x = Tensor::from_slice(&randn(&mut r, b * len * c, 1.0), (b * len, c), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            for significance in [false, true] {
                let scores = class_scores(&qkv, heads, scale, significance);
                poison(&dev, b * (heads + 1) * len, DType::F32);
                let step = step_scores(&x, b, scores).unwrap();
                assert_eq!((step.batch_size(), step.len()), (b, len), "{what}");
                assert_eq!(step.tensor().dtype(), DType::F32);
                if !dev.is_cuda() {
                    // The CPU's final scores: ranked as given scores they keep the same rows.
                    assert_eq!(step.layout(), StepScoreLayout::Final, "{what}");
                    assert_eq!(step.tensor().dims(), &[b, len]);
                    if len > 2 {
                        let keep = (len - 1) / 2;
                        let fused = Some(DroppedFusion::WeightedMean);
                        let (own, _) = select_top_k_by(&x, b, scores, 1, keep, fused).unwrap();
                        let given = TokenScores::Given(step.tensor());
                        let (from, _) = select_top_k_by(&x, b, given, 1, keep, fused).unwrap();
                        assert_eq!(host(&own), host(&from), "{what}");
                    }
                    continue;
                }
                let want_layout = if significance {
                    StepScoreLayout::HeadProbsTimesValueNorm
                } else {
                    StepScoreLayout::HeadProbs
                };
                assert_eq!(step.layout(), want_layout, "{what}");
                assert_eq!(step.heads(), heads);
                assert_eq!(step.tensor().dims(), &[b, heads + 1, len]);
                let got = host(step.tensor());
                for s in 0..b {
                    let seq = &qkv_host[s * len * 3 * c..(s + 1) * len * 3 * c];
                    let (probs, v_sq) = host_probs(seq, len, c, heads, scale, dtype);
                    let row = |h: usize| &got[(s * (heads + 1) + h) * len..][..len];
                    for (h, want) in probs.iter().enumerate() {
                        for (j, (&g, &w)) in row(h).iter().zip(want).enumerate() {
                            assert!(
                                g.is_finite() && (g as f64 - w).abs() <= 1e-5 + 1e-4 * w,
                                "{what}: sequence {s} head {h} token {j}: {g}, host {w}"
                            );
                        }
                    }
                    for (j, (&g, &w)) in row(heads).iter().zip(&v_sq).enumerate() {
                        assert!(
                            (g as f64 - w).abs() <= 1e-5 * w.max(1.0),
                            "{what}: sequence {s} token {j} value sum of squares {g}, host {w}"
                        );
                    }
                }
            }
        }
    }
    // Given scores: the same tensor, `Final`.
    let x = Tensor::zeros((6, 8), DType::F32, &dev).unwrap();
    let s = Tensor::from_slice(&[3f32, 1.0, 2.0, 0.5, f32::NAN, 4.0], (2, 3), &dev).unwrap();
    let step = step_scores(&x, 2, TokenScores::Given(&s)).unwrap();
    assert_eq!(step.layout(), StepScoreLayout::Final);
    assert_eq!(host(step.tensor())[..4], host(&s)[..4]);
    // Bad input.
    let bad = |r: Result<_, RaggedError>, what: &str| {
        let e = r.expect_err(what).to_string();
        assert!(e.contains("step_scores"), "{what}: {e}");
    };
    bad(step_scores(&x, 2, TokenScores::RowL2Norm), "row norms");
    bad(step_scores(&x, 4, TokenScores::Given(&s)), "6 rows into 4");
    bad(
        step_scores(&x, 3, TokenScores::Given(&s)),
        "scores [2, 3] for 3 x 2",
    );
    bad(step_scores(&x, 0, TokenScores::Given(&s)), "empty batch");
    let qkv = Tensor::zeros((6, 20), DType::F32, &dev).unwrap();
    let cls = TokenScores::ClsAttention {
        qkv: &qkv,
        heads: 2,
        scale: 1.0,
    };
    bad(step_scores(&x, 2, cls), "qkv of the wrong width");
}

/// EViT's fused row must not depend on the batch around its sequence: select_top_k spreads a
/// sequence over `264 / B` blocks (at least one) and the fused row's columns over those blocks,
/// and its summation order (select_common.cuh) is fixed by the data alone. Before lever 87 a
/// lone sequence summed each column in 64 groups and one among 264 in 2. One sequence alone
/// against the same sequence first of 264, every output row compared bit for bit (the fused
/// one included), scores with ties, negatives and a NaN.
#[test]
fn the_fused_row_is_the_same_in_any_batch() {
    let dev = device();
    let mut r = rng(871);
    let (len, c, big) = (130, 192, 264);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let x = Tensor::from_slice(&randn(&mut r, big * len * c, 1.0), (big * len, c), &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let mut s = randn(&mut r, big * len, 1.0);
        s[5] = f32::NAN;
        s[7] = s[9];
        let s = Tensor::from_slice(&s, (big, len), &dev).unwrap();
        for fusion in [DroppedFusion::WeightedMean, DroppedFusion::WeightedSum] {
            let run = |b: usize| {
                let (x, s) = (x.narrow(0, 0, b * len).unwrap(), s.narrow(0, 0, b).unwrap());
                poison(&dev, b * len * c, dtype);
                let (out, n) =
                    select_top_k_by(&x, b, TokenScores::Given(&s), 1, 90, Some(fusion)).unwrap();
                (host(&out), n)
            };
            let ((all, n_all), (one, n_one)) = (run(big), run(1));
            assert_eq!((n_all, n_one), (92, 92));
            for (i, (a, o)) in all[..n_one * c].iter().zip(&one).enumerate() {
                assert!(
                    a.to_bits() == o.to_bits(),
                    "{dtype:?} {fusion:?}: row {} column {}: {a} in a batch of {big}, {o} alone",
                    i / c,
                    i % c
                );
            }
        }
    }
}

/// `StepScores::from_parts` (scores another kernel computed in a layout's form): the shapes each
/// layout takes, f32 only; anything else is an error naming the op.
#[test]
fn step_scores_from_parts_checks_its_layout() {
    let dev = device();
    let probs = Tensor::zeros((1, 4, 10), DType::F32, &dev).unwrap();
    let s = StepScores::from_parts(probs.clone(), StepScoreLayout::HeadProbs, 3).unwrap();
    assert_eq!((s.batch_size(), s.len(), s.heads()), (1, 10, 3));
    let s = StepScores::from_parts(probs.clone(), StepScoreLayout::HeadProbsTimesValueNorm, 3);
    assert_eq!(s.unwrap().layout().kernel_mode(), 5);
    let fin = Tensor::zeros((2, 7), DType::F32, &dev).unwrap();
    let s = StepScores::from_parts(fin.clone(), StepScoreLayout::Final, 1).unwrap();
    assert_eq!(
        (s.batch_size(), s.len(), s.layout().kernel_mode()),
        (2, 7, 0)
    );
    for (what, t, layout, heads) in [
        ("4 rows for 2 heads", &probs, StepScoreLayout::HeadProbs, 2),
        ("no heads", &probs, StepScoreLayout::HeadProbs, 0),
        ("final of rank 3", &probs, StepScoreLayout::Final, 1),
        ("head rows of rank 2", &fin, StepScoreLayout::HeadProbs, 3),
    ] {
        let e = StepScores::from_parts(t.clone(), layout, heads).expect_err(what);
        assert!(e.to_string().contains("step_scores"), "{what}: {e}");
    }
    let half = probs.to_dtype(DType::F16).unwrap();
    assert!(StepScores::from_parts(half, StepScoreLayout::HeadProbs, 3).is_err());
    let empty = Tensor::zeros((1, 4, 0), DType::F32, &dev).unwrap();
    assert!(StepScores::from_parts(empty, StepScoreLayout::HeadProbs, 3).is_err());
}
