//! select_top_k against a naive reference: every dtype, sequence lengths 2…577, one or two
//! prefix tokens, keep from 1 to everything, scores with many ties and NaNs, with and without the
//! fused token; output memory poisoned. Kept rows must be bit-identical copies; the fused row is
//! checked against an f64 sum.

mod common;

use candle_core::{DType, Tensor};
use candle_ragged::{
    select_by_rule, select_top_k, select_top_k_by, select_top_k_gathering, DroppedFusion, KeepRule,
    RaggedBatch, TokenScores,
};
use common::{
    class_scores, cls_attention_by_tensor_ops, device, host, poison, quantize, randn, rng,
};
use rand::Rng;

/// Kept positions by the rule: total order with NaN lowest, ties to the lower position.
fn reference_kept(s: &[f32], prefix: usize, keep: usize) -> Vec<usize> {
    let v = |j: usize| {
        if s[j].is_nan() {
            f32::NEG_INFINITY
        } else {
            s[j]
        }
    };
    let mut kept: Vec<usize> = (prefix..s.len())
        .filter(|&j| {
            let rank = (prefix..s.len())
                .filter(|&i| {
                    v(i).total_cmp(&v(j)).is_gt() || (v(i).total_cmp(&v(j)).is_eq() && i < j)
                })
                .count();
            rank < keep
        })
        .collect();
    kept.sort_unstable();
    kept
}

#[test]
fn matches_reference() {
    let dev = device();
    let mut r = rng(21);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for &len in &[2usize, 3, 63, 64, 65, 197, 577] {
            for prefix in [1usize, 2] {
                if prefix >= len {
                    continue;
                }
                let patches = len - prefix;
                for keep in [1, (patches * 7).div_ceil(10), patches] {
                    for fusion in [
                        None,
                        Some(DroppedFusion::WeightedMean),
                        Some(DroppedFusion::WeightedSum),
                    ] {
                        let b = if len > 200 { 3 } else { 5 };
                        // 40 channels: 16-byte row copies on CUDA; 7: the scalar path.
                        let c = if len % 2 == 0 { 40 } else { 7 };
                        let x = quantize(&randn(&mut r, b * len * c, 1.0), dtype);
                        // Coarse scores (ties), a few NaN and negative ones.
                        let s: Vec<f32> = (0..b * len)
                            .map(|_| match r.random_range(0..20) {
                                0 => f32::NAN,
                                1 => -1.0,
                                _ => (r.random_range(0..8) as f32) / 8.0,
                            })
                            .collect();
                        let xt = Tensor::from_slice(&x, (b * len, c), &dev)
                            .unwrap()
                            .to_dtype(dtype)
                            .unwrap();
                        let st = Tensor::from_slice(&s, (b, len), &dev).unwrap();
                        let fused = fusion.is_some() && keep < patches;
                        let new_len = prefix + keep + fused as usize;
                        poison(&dev, b * new_len * c, dtype);
                        let (out, got_len) = select_top_k(&xt, &st, prefix, keep, fusion).unwrap();
                        assert_eq!(got_len, new_len);
                        assert_eq!(out.dims(), &[b * new_len, c]);
                        let out: Vec<f32> = out
                            .to_dtype(DType::F32)
                            .unwrap()
                            .flatten_all()
                            .unwrap()
                            .to_vec1()
                            .unwrap();
                        for bi in 0..b {
                            let sb = &s[bi * len..(bi + 1) * len];
                            let xb = &x[bi * len * c..(bi + 1) * len * c];
                            let ob = &out[bi * new_len * c..(bi + 1) * new_len * c];
                            let kept = reference_kept(sb, prefix, keep);
                            let rows: Vec<usize> =
                                (0..prefix).chain(kept.iter().copied()).collect();
                            for (o, &j) in rows.iter().enumerate() {
                                assert_eq!(
                                    &ob[o * c..(o + 1) * c],
                                    &xb[j * c..(j + 1) * c],
                                    "{dtype:?} len={len} prefix={prefix} keep={keep} {fusion:?}: row {o} (position {j}) of sequence {bi}"
                                );
                            }
                            if fused {
                                let dropped: Vec<usize> =
                                    (prefix..len).filter(|j| !kept.contains(j)).collect();
                                let w = |j: usize| {
                                    if sb[j].is_nan() {
                                        0.0
                                    } else {
                                        (sb[j] as f64).max(0.0)
                                    }
                                };
                                let total: f64 = dropped.iter().map(|&j| w(j)).sum();
                                for ch in 0..c {
                                    let acc: f64 =
                                        dropped.iter().map(|&j| w(j) * xb[j * c + ch] as f64).sum();
                                    let plain: f64 =
                                        dropped.iter().map(|&j| xb[j * c + ch] as f64).sum();
                                    let want = match fusion.unwrap() {
                                        DroppedFusion::WeightedSum => acc,
                                        DroppedFusion::WeightedMean if total > 0.0 => acc / total,
                                        DroppedFusion::WeightedMean => plain / dropped.len() as f64,
                                    };
                                    let got = ob[(prefix + keep) * c + ch] as f64;
                                    let tol = match dtype {
                                        DType::F32 => 1e-4,
                                        DType::F16 => 2e-2,
                                        _ => 8e-2,
                                    } * (1.0 + want.abs());
                                    assert!((got - want).abs() <= tol, "{dtype:?} len={len} fused [{bi}, {ch}]: got {got}, want {want}");
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn bad_inputs_are_clear_errors() {
    let dev = device();
    let x = Tensor::zeros((6, 4), DType::F32, &dev).unwrap();
    let s = Tensor::zeros((2, 3), DType::F32, &dev).unwrap();
    let err = |r: candle_ragged::Result<(Tensor, usize)>| r.unwrap_err().to_string();
    assert!(err(select_top_k(&x, &s, 1, 0, None)).contains("1 <= keep <= len - prefix"));
    assert!(err(select_top_k(&x, &s, 1, 3, None)).contains("1 <= keep <= len - prefix"));
    assert!(err(select_top_k(&x, &s, 3, 1, None)).contains("need prefix < len"));
    assert!(err(select_top_k(
        &x,
        &s.to_dtype(DType::F16).unwrap(),
        1,
        1,
        None
    ))
    .contains("scores must be f32"));
    assert!(err(select_top_k(
        &Tensor::zeros((5, 4), DType::F32, &dev).unwrap(),
        &s,
        1,
        1,
        None
    ))
    .contains("x has shape [5, 4], expected [6, 4]"));
    assert!(err(select_top_k(
        &x,
        &Tensor::zeros(6, DType::F32, &dev).unwrap(),
        1,
        1,
        None
    ))
    .contains("scores must have rank 2"));
    assert!(err(select_top_k(
        &x.to_dtype(DType::U32).unwrap(),
        &s,
        1,
        1,
        None
    ))
    .contains("unsupported dtype"));
}

/// A position permutation of `0..len` (distinct ranks for the scores built from it).
fn permuted(j: usize, len: usize) -> f32 {
    ((j * 7919 + 3) % len) as f32
}

/// Scores computed inside the op ([`TokenScores::RowL2Norm`], [`TokenScores::ClsAttention`])
/// pick exactly what the same scores computed as tensor ops (as the pruners compute them) pick;
/// the data keep the scores well apart, so rounding differences cannot swap two of them.
#[test]
fn computed_scores_pick_what_given_scores_pick() {
    let dev = device();
    let mut r = rng(31);
    // (heads, head_dim): 16-byte row loads, and 5 (scalar loads). 3 heads x 1400 tokens: more
    // logits than the kernel keeps at once (one head at a time), f32 only (with half types the
    // logits of 1400 well-separated ranks would be closer than their rounding).
    let cases = [
        (3usize, 16usize, 1usize, 2usize),
        (3, 16, 3, 65),
        (3, 16, 2, 197),
        (2, 5, 2, 66),
        (3, 16, 1, 1400),
    ];
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for &(heads, d, b, len) in &cases {
            if len > 1000 && dtype != DType::F32 {
                continue;
            }
            let c = heads * d;
            let keep = (len - 1).div_ceil(2);
            // Threshold-L2: unit rows scaled by 1 + 2 % per rank.
            let mut x = randn(&mut r, b * len * c, 1.0);
            for (i, row) in x.chunks_mut(c).enumerate() {
                let norm = row.iter().map(|v| v * v).sum::<f32>().sqrt();
                let scale = (1.0 + 0.02 * permuted(i % len, len)) / norm;
                row.iter_mut().for_each(|v| *v *= scale);
            }
            let xt = Tensor::from_slice(&x, (b * len, c), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let norms = xt
                .to_dtype(DType::F32)
                .unwrap()
                .sqr()
                .unwrap()
                .sum(1)
                .unwrap()
                .sqrt()
                .unwrap()
                .reshape((b, len))
                .unwrap();
            let (want, _) = select_top_k(&xt, &norms, 1, keep, None).unwrap();
            poison(&dev, want.elem_count(), dtype);
            let (got, got_len) =
                select_top_k_by(&xt, b, TokenScores::RowL2Norm, 1, keep, None).unwrap();
            assert_eq!(got_len, 1 + keep);
            assert_eq!(
                host(&got),
                host(&want),
                "row norms, {dtype:?} b={b} len={len}"
            );

            // EViT: k_j of every head along that head's q_cls, so the logit is 20 · rank / len.
            let scale = 0.25f32;
            let mut qkv = randn(&mut r, b * len * 3 * c, 1.0);
            for bi in 0..b {
                let q_cls: Vec<f32> = qkv[bi * len * 3 * c..bi * len * 3 * c + c].to_vec();
                for h in 0..heads {
                    let q = &q_cls[h * d..(h + 1) * d];
                    let q2: f32 = q.iter().map(|v| v * v).sum();
                    for j in 0..len {
                        let logit = 20.0 * permuted(j, len) / len as f32;
                        let k = &mut qkv[(bi * len + j) * 3 * c + c + h * d..][..d];
                        for (kv, qv) in k.iter_mut().zip(q) {
                            *kv = logit * qv / (q2 * scale);
                        }
                    }
                }
            }
            let qkv_t = Tensor::from_slice(&qkv, (b * len, 3 * c), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let seq = qkv_t.reshape((b, len, 3 * c)).unwrap();
            let attn = cls_attention_by_tensor_ops(&seq, heads, scale)
                .mean(1)
                .unwrap();
            let fusion = Some(DroppedFusion::WeightedMean);
            let (want, _) = select_top_k(&xt, &attn, 1, keep, fusion).unwrap();
            poison(&dev, want.elem_count(), dtype);
            let source = TokenScores::ClsAttention {
                qkv: &qkv_t,
                heads,
                scale,
            };
            let (got, got_len) = select_top_k_by(&xt, b, source, 1, keep, fusion).unwrap();
            let fused = keep < len - 1;
            assert_eq!(got_len, 1 + keep + fused as usize);
            let (got, want) = (host(&got), host(&want));
            let kept = (1 + keep) * c;
            let new_len = got_len * c;
            for bi in 0..b {
                let (g, w) = (&got[bi * new_len..], &want[bi * new_len..]);
                assert_eq!(
                    &g[..kept],
                    &w[..kept],
                    "cls attention, {dtype:?} b={b} len={len}"
                );
                if fused {
                    // The fused row's weights are the scores themselves: equal up to rounding.
                    for ch in 0..c {
                        let (gv, wv) = (g[kept + ch], w[kept + ch]);
                        let tol = if dtype == DType::F32 { 1e-5 } else { 2e-2 };
                        assert!(
                            (gv - wv).abs() <= tol * (1.0 + wv.abs()),
                            "fused {gv} vs {wv}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn computed_score_inputs_are_checked() {
    let dev = device();
    let x = Tensor::zeros((6, 4), DType::F32, &dev).unwrap();
    let err = |r: candle_ragged::Result<(Tensor, usize)>| r.unwrap_err().to_string();
    assert!(
        err(select_top_k_by(&x, 4, TokenScores::RowL2Norm, 1, 1, None))
            .contains("does not split into 4 sequences")
    );
    assert!(
        err(select_top_k_by(&x, 0, TokenScores::RowL2Norm, 1, 1, None))
            .contains("does not split into 0 sequences")
    );
    let qkv = Tensor::zeros((6, 12), DType::F32, &dev).unwrap();
    let cls = |qkv, heads, scale| TokenScores::ClsAttention { qkv, heads, scale };
    assert!(err(select_top_k_by(&x, 2, cls(&x, 2, 1.0), 1, 1, None))
        .contains("qkv has shape [6, 4], expected [6, 12]"));
    assert!(err(select_top_k_by(&x, 2, cls(&qkv, 3, 1.0), 1, 1, None))
        .contains("3 heads do not divide 4 channels"));
    assert!(
        err(select_top_k_by(&x, 2, cls(&qkv, 2, f32::NAN), 1, 1, None))
            .contains("softmax scale must be finite")
    );
    let half = qkv.to_dtype(DType::F16).unwrap();
    assert!(err(select_top_k_by(&x, 2, cls(&half, 2, 1.0), 1, 1, None))
        .contains("qkv is F16 but x is F32"));
}

/// `select_top_k_gathering` keeps the same rows of its second tensor as of the tokens, in one op:
/// with given scores both parts equal `select_top_k` of each tensor alone (bit for bit); with the
/// scores computed from the tokens (Threshold-L2's norms), the second tensor's rows, built as
/// [x | 2x] of the token rows, must be exactly [kept x | 2 · kept x]. Every dtype, odd lengths,
/// widths with and without 16-byte rows, the output poisoned.
#[test]
fn gathering_keeps_the_same_rows_of_both() {
    let dev = device();
    let mut r = rng(23);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for &len in &[2usize, 63, 65, 197, 577] {
            let (b, prefix) = (if len > 200 { 2 } else { 3 }, 1);
            let patches = len - prefix;
            for keep in [1, (patches * 7).div_ceil(10), patches] {
                for c in [40usize, 7] {
                    let x = quantize(&randn(&mut r, b * len * c, 1.0), dtype);
                    let s: Vec<f32> = (0..b * len)
                        .map(|_| (r.random_range(0..16) as f32) / 8.0)
                        .collect();
                    // also = [x | 2x]: 2C wide.
                    let also: Vec<f32> = x
                        .chunks(c)
                        .flat_map(|row| row.iter().copied().chain(row.iter().map(|v| 2.0 * v)))
                        .collect();
                    let xt = Tensor::from_slice(&x, (b * len, c), &dev)
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap();
                    let at = Tensor::from_slice(&also, (b * len, 2 * c), &dev)
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap();
                    let st = Tensor::from_slice(&s, (b, len), &dev).unwrap();
                    let new_len = prefix + keep;
                    let what = format!("{dtype:?} len {len} keep {keep} c {c}");

                    poison(&dev, b * new_len * 3 * c, dtype);
                    let (gx, ga, got_len) =
                        select_top_k_gathering(&xt, &at, b, TokenScores::Given(&st), prefix, keep)
                            .unwrap();
                    assert_eq!(got_len, new_len, "{what}");
                    assert_eq!(gx.dims(), &[b * new_len, c], "{what}");
                    assert_eq!(ga.dims(), &[b * new_len, 2 * c], "{what}");
                    let (wx, _) = select_top_k(&xt, &st, prefix, keep, None).unwrap();
                    let (wa, _) = select_top_k(&at, &st, prefix, keep, None).unwrap();
                    assert_eq!(host(&gx), host(&wx), "{what}: tokens, given scores");
                    assert_eq!(host(&ga), host(&wa), "{what}: second tensor, given scores");

                    poison(&dev, b * new_len * 3 * c, dtype);
                    let (gx, ga, _) =
                        select_top_k_gathering(&xt, &at, b, TokenScores::RowL2Norm, prefix, keep)
                            .unwrap();
                    let (wx, _) =
                        select_top_k_by(&xt, b, TokenScores::RowL2Norm, prefix, keep, None)
                            .unwrap();
                    let gx = host(&gx);
                    assert_eq!(gx, host(&wx), "{what}: tokens, L2 norms");
                    let want_a: Vec<f32> = gx
                        .chunks(c)
                        .flat_map(|row| row.iter().copied().chain(row.iter().map(|v| 2.0 * v)))
                        .collect();
                    assert_eq!(host(&ga), want_a, "{what}: second tensor, L2 norms");
                }
            }
        }
    }
    // A second tensor of other rows, or dtype: clear errors.
    let x = Tensor::zeros((8, 4), DType::F32, &dev).unwrap();
    let s = Tensor::zeros((2, 4), DType::F32, &dev).unwrap();
    let short = Tensor::zeros((6, 4), DType::F32, &dev).unwrap();
    assert!(select_top_k_gathering(&x, &short, 2, TokenScores::Given(&s), 1, 2).is_err());
    let half = Tensor::zeros((8, 4), DType::F16, &dev).unwrap();
    assert!(select_top_k_gathering(&x, &half, 2, TokenScores::Given(&s), 1, 2).is_err());
}

/// A sequence's scores must not depend on the batch around it: on CUDA, below one sequence per
/// SM the class-attention scores are computed in (sequence, head) blocks first (`cls_probs`),
/// from one per SM inside the selection kernels, and the two must give the same bits. 132
/// sequences are the H100's SM count, 131 below it; both launch the selection with two blocks
/// per sequence (`264 / B`), so EViT's fused row, whose summation order follows the launch
/// shape, is summed the same way too. The first 131 sequences' rows (kept rows and fused row,
/// whose weights are the scores) are compared bit for bit, for `select_top_k_by` and
/// `select_by_rule`.
#[test]
fn a_sequence_selects_the_same_in_any_batch() {
    let dev = device();
    let mut r = rng(139);
    let (heads, d) = (3, 32);
    let c = heads * d;
    let scale = (d as f32).powf(-0.5);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        // Equal lengths: select_top_k_by.
        let len = 17;
        let (big, small) = (132, 131);
        let qkv = Tensor::from_slice(
            &randn(&mut r, big * len * 3 * c, 1.0),
            (big * len, 3 * c),
            &dev,
        )
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
        let x = Tensor::from_slice(&randn(&mut r, big * len * c, 1.0), (big * len, c), &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        for (name, fusion) in [
            ("cls attention", Some(DroppedFusion::WeightedMean)),
            ("significance", None),
        ] {
            let run = |b: usize| {
                let (qkv, x) = (
                    qkv.narrow(0, 0, b * len).unwrap(),
                    x.narrow(0, 0, b * len).unwrap(),
                );
                let scores = class_scores(&qkv, heads, scale, name == "significance");
                poison(&dev, b * len * c, dtype);
                let (out, new_len) = select_top_k_by(&x, b, scores, 1, 11, fusion).unwrap();
                (host(&out), new_len)
            };
            let ((all, n_all), (part, n_part)) = (run(big), run(small));
            assert_eq!(n_all, n_part);
            for (i, (a, p)) in all[..small * n_all * c].iter().zip(&part).enumerate() {
                assert!(
                    a.to_bits() == p.to_bits(),
                    "{dtype:?} {name}: the first {small} sequences of {big} against {small} \
                     alone differ at sequence {} row {} column {}: {a} / {p}",
                    i / (n_all * c),
                    i / c % n_all,
                    i % c
                );
            }
        }
        // Varied lengths: select_by_rule with EViT's adaptive rule.
        let lengths: Vec<usize> = (0..big).map(|_| r.random_range(2..40)).collect();
        let total: usize = lengths.iter().sum();
        let small_total: usize = lengths[..small].iter().sum();
        let qkv = Tensor::from_slice(&randn(&mut r, total * 3 * c, 1.0), (total, 3 * c), &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let x = Tensor::from_slice(&randn(&mut r, total * c, 1.0), (total, c), &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let run = |n: usize, rows: usize| {
            let batch = RaggedBatch::from_lengths(&lengths[..n], &dev).unwrap();
            let (qkv, x) = (
                qkv.narrow(0, 0, rows).unwrap(),
                x.narrow(0, 0, rows).unwrap(),
            );
            poison(&dev, rows * c, dtype);
            let (out, new_batch) = select_by_rule(
                &x,
                &batch,
                TokenScores::ClsAttention {
                    qkv: &qkv,
                    heads,
                    scale,
                },
                1,
                KeepRule::MassShare(0.5),
                Some(DroppedFusion::WeightedMean),
            )
            .unwrap();
            (host(&out), new_batch.lengths().unwrap())
        };
        let ((all, l_all), (part, l_part)) = (run(big, total), run(small, small_total));
        assert_eq!(&l_all[..small], &l_part[..], "{dtype:?}: new lengths");
        let rows: usize = l_part.iter().sum();
        assert_eq!(
            &all[..rows * c],
            &part[..],
            "{dtype:?} mass share: the first {small} sequences of {big} against {small} alone"
        );
    }
}
