//! select_by_rule against its definition, [`KeepRule::keep`] applied to each sequence's scores:
//! every rule, every dtype, ragged batches mixing lengths 2…577 (odd ones included), one or two
//! prefix tokens, scores with ties, NaN, negatives and zeros, with and without the fused token;
//! output memory poisoned. Kept rows must be bit-identical copies; the fused row is checked
//! against an f64 sum. Then the scores the op computes itself against the same scores computed
//! as tensor ops, and the checks on bad input.

mod common;

use candle_core::{DType, Device, Tensor, D};
use candle_ragged::{
    select_by_rule, DroppedFusion, KeepCount, KeepRule, RaggedBatch, TokenScores, MAX_SEQ_LEN,
};
use common::{cls_attention_by_tensor_ops, device, host, poison, quantize, randn, rng};
use rand::rngs::StdRng;
use rand::Rng;

const RULES: [KeepRule; 14] = [
    KeepRule::Top(KeepCount::CeilRatio(0.7)),
    KeepRule::Top(KeepCount::Exactly(1)),
    KeepRule::Top(KeepCount::Exactly(100_000)),
    KeepRule::AtLeast(0.5),
    KeepRule::Above(0.5),
    KeepRule::AtLeast(100.0),
    KeepRule::AtLeastMeanTimes(1.0),
    KeepRule::AtLeastMeanTimes(0.0),
    KeepRule::MassShare(0.9),
    KeepRule::MassShare(1.0),
    KeepRule::MassShare(0.3),
    KeepRule::InverseTransform {
        samples: KeepCount::CeilRatio(0.7),
    },
    KeepRule::InverseTransform {
        samples: KeepCount::Exactly(196),
    },
    KeepRule::InverseTransform {
        samples: KeepCount::Exactly(1),
    },
];

const FUSIONS: [Option<DroppedFusion>; 3] = [
    None,
    Some(DroppedFusion::WeightedMean),
    Some(DroppedFusion::WeightedSum),
];

/// Scores of one sequence: coarse values (ties), a few NaN, negatives and zeros; for the
/// inverse-transform rule mostly distinct positive values (its CDF), still with ties and zeros.
/// One sequence in eight has no positive score at all (zeros, -0.0, negatives, NaN): every
/// weight is 0, ATS's total is 0 and its ranking falls back to positions alone.
fn scores(r: &mut StdRng, len: usize, rule: KeepRule) -> Vec<f32> {
    if r.random_range(0..8) == 0 {
        return (0..len)
            .map(|_| [0.0f32, -0.0, -1.0, -0.25, f32::NAN][r.random_range(0..5)])
            .collect();
    }
    (0..len)
        .map(|_| match (rule, r.random_range(0..20)) {
            (_, 0) => f32::NAN,
            (_, 1) => 0.0,
            (KeepRule::InverseTransform { .. }, 2) => 0.25,
            (KeepRule::InverseTransform { .. }, _) => r.random_range(0.0f32..1.0),
            (_, 2) => -1.0,
            _ => (r.random_range(0..8) as f32) / 8.0,
        })
        .collect()
}

/// The dropped rows' fused row, as documented: weights `max(s, 0)` (NaN: 0), a mean's total in
/// f64, the plain mean when every weight is 0.
fn fused_reference(
    s: &[f32],
    x: &[f32],
    c: usize,
    dropped: &[usize],
    f: DroppedFusion,
) -> Vec<f64> {
    let w = |j: usize| {
        if s[j].is_nan() {
            0.0
        } else {
            (s[j] as f64).max(0.0)
        }
    };
    let total: f64 = dropped.iter().map(|&j| w(j)).sum();
    (0..c)
        .map(|ch| {
            let acc: f64 = dropped.iter().map(|&j| w(j) * x[j * c + ch] as f64).sum();
            match f {
                DroppedFusion::WeightedSum => acc,
                DroppedFusion::WeightedMean if total > 0.0 => acc / total,
                DroppedFusion::WeightedMean => {
                    dropped.iter().map(|&j| x[j * c + ch] as f64).sum::<f64>()
                        / dropped.len() as f64
                }
            }
        })
        .collect()
}

#[test]
fn matches_the_keep_rule() {
    check_against_the_rule(
        &[DType::F32, DType::F16, DType::BF16],
        &[1, 2],
        &FUSIONS,
        41,
    );
}

/// Every rule once on one mixed batch, f16, fused: the sanitizer's run (racecheck tracks every
/// shared-memory access, so the full grid above takes minutes under it).
#[test]
fn every_rule_once() {
    check_against_the_rule(
        &[DType::F16],
        &[1],
        &[Some(DroppedFusion::WeightedMean)],
        47,
    );
}

fn check_against_the_rule(
    dtypes: &[DType],
    prefixes: &[usize],
    fusions: &[Option<DroppedFusion>],
    seed: u64,
) {
    let dev = device();
    let mut r = rng(seed);
    let pool = [2usize, 3, 63, 64, 65, 197, 577];
    for &dtype in dtypes {
        for rule in RULES {
            for &prefix in prefixes {
                for &fusion in fusions {
                    // A batch mixing lengths, and a sequence with a single patch.
                    let mut lengths: Vec<usize> = (0..5)
                        .map(|_| pool[r.random_range(0..pool.len())])
                        .filter(|&l| l > prefix)
                        .collect();
                    lengths.push(prefix + 1);
                    let b = lengths.len();
                    let total: usize = lengths.iter().sum();
                    let max_len = *lengths.iter().max().unwrap();
                    let c = if r.random_bool(0.5) { 40 } else { 7 };
                    let x = quantize(&randn(&mut r, total * c, 1.0), dtype);
                    // [B, S] with S past the longest sequence; entries past each length are
                    // huge, so reading one would change a decision.
                    let stride = max_len + 3;
                    let mut given = vec![1e30f32; b * stride];
                    let mut seq_scores = Vec::new();
                    for (bi, &len) in lengths.iter().enumerate() {
                        let s = scores(&mut r, len, rule);
                        given[bi * stride..bi * stride + len].copy_from_slice(&s);
                        seq_scores.push(s);
                    }
                    let batch = RaggedBatch::from_lengths(&lengths, &dev).unwrap();
                    let xt = Tensor::from_slice(&x, (total, c), &dev)
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap();
                    let st = Tensor::from_slice(&given, (b, stride), &dev).unwrap();
                    poison(&dev, total * c, dtype);
                    let what = format!(
                        "{dtype:?} {rule:?} prefix={prefix} {fusion:?} lengths={lengths:?}"
                    );
                    let (out, new_batch) =
                        select_by_rule(&xt, &batch, TokenScores::Given(&st), prefix, rule, fusion)
                            .unwrap();
                    let out = host(&out);
                    assert_eq!(out.len(), new_batch.total_tokens() * c, "{what}");
                    let mut start = 0;
                    for (bi, &len) in lengths.iter().enumerate() {
                        let s = &seq_scores[bi];
                        let xb = &x[start * c..(start + len) * c];
                        let kept = rule.keep(s, prefix, len);
                        let fused = fusion.filter(|_| kept.len() < len - prefix);
                        assert_eq!(
                            new_batch.lengths().unwrap()[bi],
                            prefix + kept.len() + fused.is_some() as usize,
                            "{what}: length of sequence {bi}"
                        );
                        let ob = &out[new_batch.offsets().unwrap()[bi] as usize * c..];
                        for (o, j) in (0..prefix).chain(kept.iter().copied()).enumerate() {
                            assert_eq!(
                                &ob[o * c..(o + 1) * c],
                                &xb[j * c..(j + 1) * c],
                                "{what}: row {o} (position {j}) of sequence {bi}"
                            );
                        }
                        if let Some(f) = fused {
                            let dropped: Vec<usize> =
                                (prefix..len).filter(|j| !kept.contains(j)).collect();
                            let want = fused_reference(s, xb, c, &dropped, f);
                            let row = &ob[(prefix + kept.len()) * c..][..c];
                            let scale = want.iter().fold(1f64, |m, v| m.max(v.abs()));
                            let tol = match dtype {
                                DType::F32 => 1e-5,
                                _ => 1e-2,
                            };
                            for (ch, (&g, &w)) in row.iter().zip(&want).enumerate() {
                                assert!(
                                    (g as f64 - w).abs() <= tol * scale,
                                    "{what}: fused row of sequence {bi}, channel {ch}: {g} vs {w}"
                                );
                            }
                        }
                        start += len;
                    }
                }
            }
        }
    }
}

/// A position permutation of `0..len` (distinct ranks for the scores built from it).
fn permuted(j: usize, len: usize) -> f32 {
    ((j * 7919 + 3) % len) as f32
}

/// Per sequence, the scores a pruner computes with tensor ops: row norms, the class token's
/// attention (mean or sum over heads) and value norms, from `x` `[len, c]` and `qkv`
/// `[len, 3c]` of one sequence.
fn tensor_op_scores(x: &Tensor, qkv: &Tensor, heads: usize, scale: f32) -> [Vec<f32>; 3] {
    let c = x.dim(1).unwrap();
    let norm = |t: &Tensor| -> Tensor {
        t.to_dtype(DType::F32)
            .unwrap()
            .sqr()
            .unwrap()
            .sum(D::Minus1)
            .unwrap()
            .sqrt()
            .unwrap()
    };
    let attn = cls_attention_by_tensor_ops(&qkv.unsqueeze(0).unwrap(), heads, scale)
        .squeeze(0)
        .unwrap();
    let v_norm = norm(&qkv.narrow(1, 2 * c, c).unwrap());
    let v = |t: Tensor| t.to_vec1::<f32>().unwrap();
    [
        v(norm(x)),
        v(attn.mean(0).unwrap()),
        v((attn.sum(0).unwrap() * v_norm).unwrap()),
    ]
}

/// Scores computed inside the op (row norms, class attention, ATS's significance) decide as the
/// same scores computed as tensor ops (as the pruners compute them) do, over ragged batches; the
/// data keep the scores apart, so rounding differences cannot swap two of them.
#[test]
fn computed_scores_decide_as_given_scores() {
    let dev = device();
    let mut r = rng(43);
    // (heads, head_dim): 16-byte loads, and 5 (scalar loads).
    let shapes = [(3usize, 16usize), (2, 5)];
    let rules = [
        KeepRule::Top(KeepCount::CeilRatio(0.5)),
        KeepRule::AtLeastMeanTimes(1.0),
        KeepRule::MassShare(0.8),
        KeepRule::InverseTransform {
            samples: KeepCount::CeilRatio(0.7),
        },
    ];
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for (heads, d) in shapes {
            let c = heads * d;
            let lengths = [2usize, 65, 197, 64, 130];
            let (b, total) = (lengths.len(), lengths.iter().sum::<usize>());
            let max_len = *lengths.iter().max().unwrap();
            let scale = 0.25f32;
            // Row norms 1 + 2 % per rank; every head's k_j along its q_cls so that the logit is
            // 20 · rank / len; value norms 1 + 1 % per (another) rank.
            let mut x = randn(&mut r, total * c, 1.0);
            let mut qkv = randn(&mut r, total * 3 * c, 1.0);
            let mut start = 0;
            for &len in &lengths {
                for j in 0..len {
                    let row = &mut x[(start + j) * c..(start + j + 1) * c];
                    let n = row.iter().map(|v| v * v).sum::<f32>().sqrt();
                    let s = (1.0 + 0.02 * permuted(j, len)) / n;
                    row.iter_mut().for_each(|v| *v *= s);
                }
                let q_cls: Vec<f32> = qkv[start * 3 * c..start * 3 * c + c].to_vec();
                for j in 0..len {
                    let row = &mut qkv[(start + j) * 3 * c..(start + j + 1) * 3 * c];
                    for h in 0..heads {
                        let q = &q_cls[h * d..(h + 1) * d];
                        let q2: f32 = q.iter().map(|v| v * v).sum();
                        let logit = 20.0 * permuted(j, len) / len as f32;
                        for (kv, qv) in row[c + h * d..c + (h + 1) * d].iter_mut().zip(q) {
                            *kv = logit * qv / (q2 * scale);
                        }
                    }
                    let v = &mut row[2 * c..];
                    let n = v.iter().map(|e| e * e).sum::<f32>().sqrt();
                    let s = (1.0 + 0.01 * permuted(len - 1 - j, len)) / n;
                    v.iter_mut().for_each(|e| *e *= s);
                }
                start += len;
            }
            let xt = Tensor::from_slice(&x, (total, c), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let qkv_t = Tensor::from_slice(&qkv, (total, 3 * c), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let batch = RaggedBatch::from_lengths(&lengths, &dev).unwrap();
            // The scores as tensor ops, sequence by sequence, into [B, max_len].
            let mut given = [(); 3].map(|_| vec![0f32; b * max_len]);
            let mut start = 0;
            for (bi, &len) in lengths.iter().enumerate() {
                let per = tensor_op_scores(
                    &xt.narrow(0, start, len).unwrap(),
                    &qkv_t.narrow(0, start, len).unwrap(),
                    heads,
                    scale,
                );
                for (g, s) in given.iter_mut().zip(&per) {
                    g[bi * max_len..bi * max_len + len].copy_from_slice(s);
                }
                start += len;
            }
            let sources = [
                TokenScores::RowL2Norm,
                TokenScores::ClsAttention {
                    qkv: &qkv_t,
                    heads,
                    scale,
                },
                TokenScores::Significance {
                    qkv: &qkv_t,
                    heads,
                    scale,
                },
            ];
            for (source, g) in sources.into_iter().zip(&given) {
                let g = Tensor::from_slice(g, (b, max_len), &dev).unwrap();
                for rule in rules {
                    let what = format!("{dtype:?} heads={heads} d={d} {source:?} {rule:?}");
                    let fusion = Some(DroppedFusion::WeightedMean);
                    let (want, want_batch) =
                        select_by_rule(&xt, &batch, TokenScores::Given(&g), 1, rule, fusion)
                            .unwrap();
                    poison(&dev, want.elem_count(), dtype);
                    let (got, got_batch) =
                        select_by_rule(&xt, &batch, source, 1, rule, fusion).unwrap();
                    assert_eq!(
                        got_batch.lengths().unwrap(),
                        want_batch.lengths().unwrap(),
                        "{what}"
                    );
                    let (got, want) = (host(&got), host(&want));
                    for (bi, len) in got_batch.lengths().unwrap().into_iter().enumerate() {
                        let o = got_batch.offsets().unwrap()[bi] as usize * c;
                        let fused = len < lengths[bi];
                        let kept = (len - fused as usize) * c;
                        assert_eq!(
                            &got[o..o + kept],
                            &want[o..o + kept],
                            "{what}: kept rows of sequence {bi}"
                        );
                        // The fused row's weights are the scores themselves: equal up to rounding.
                        for ch in kept..len * c {
                            let (gv, wv) = (got[o + ch], want[o + ch]);
                            let tol = if dtype == DType::F32 { 1e-5 } else { 2e-2 };
                            assert!(
                                (gv - wv).abs() <= tol * (1.0 + wv.abs()),
                                "{what}: fused {gv} vs {wv}"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn bad_inputs_are_refused() {
    let dev = device();
    let err = |r: candle_ragged::Result<(Tensor, RaggedBatch)>| r.unwrap_err().to_string();
    let top = KeepRule::Top(KeepCount::CeilRatio(0.5));
    let batch = RaggedBatch::from_lengths(&[3, 2], &dev).unwrap();
    let x = Tensor::zeros((5, 4), DType::F32, &dev).unwrap();
    let rule = |x: &Tensor, b: &RaggedBatch, s, p, k| select_by_rule(x, b, s, p, k, None);
    assert!(err(rule(
        &x.reshape((5, 2, 2)).unwrap(),
        &batch,
        TokenScores::RowL2Norm,
        1,
        top
    ))
    .contains("x must have rank 2"));
    let short = Tensor::zeros((4, 4), DType::F32, &dev).unwrap();
    assert!(err(rule(&short, &batch, TokenScores::RowL2Norm, 1, top))
        .contains("x has 4 tokens but the batch describes 5"));
    let ints = Tensor::zeros((5, 4), DType::U32, &dev).unwrap();
    assert!(err(rule(&ints, &batch, TokenScores::RowL2Norm, 1, top)).contains("unsupported dtype"));
    assert!(err(rule(&x, &batch, TokenScores::RowL2Norm, 2, top))
        .contains("sequence 1 has 2 tokens: it needs more than the 2 prefix tokens"));
    let s = Tensor::zeros((2, 2), DType::F32, &dev).unwrap();
    assert!(err(rule(&x, &batch, TokenScores::Given(&s), 1, top))
        .contains("scores has shape [2, 2], expected [2, 3]"));
    let s = Tensor::zeros((3, 3), DType::F32, &dev).unwrap();
    assert!(err(rule(&x, &batch, TokenScores::Given(&s), 1, top)).contains("scores has shape"));
    let s = Tensor::zeros((2, 3), DType::F16, &dev).unwrap();
    assert!(err(rule(&x, &batch, TokenScores::Given(&s), 1, top)).contains("scores must be f32"));
    assert!(err(rule(
        &x,
        &batch,
        TokenScores::RowL2Norm,
        1,
        KeepRule::MassShare(0.0)
    ))
    .contains("a mass share must be in (0, 1]"));
    assert!(err(rule(
        &x,
        &batch,
        TokenScores::RowL2Norm,
        1,
        KeepRule::Top(KeepCount::CeilRatio(f64::INFINITY))
    ))
    .contains("keep ratio must be finite"));
    let qkv = Tensor::zeros((5, 12), DType::F32, &dev).unwrap();
    let cls = |qkv, heads, scale| TokenScores::Significance { qkv, heads, scale };
    assert!(err(rule(&x, &batch, cls(&x, 2, 1.0), 1, top))
        .contains("qkv has shape [5, 4], expected [5, 12]"));
    assert!(err(rule(&x, &batch, cls(&qkv, 3, 1.0), 1, top))
        .contains("3 heads do not divide 4 channels"));
    let long = RaggedBatch::from_lengths(&[MAX_SEQ_LEN + 1], &dev).unwrap();
    let xl = Tensor::zeros((MAX_SEQ_LEN + 1, 4), DType::F32, &dev).unwrap();
    assert!(err(rule(&xl, &long, TokenScores::RowL2Norm, 1, top)).contains("exceeds the limit"));
    if dev.is_cuda() {
        let cpu = RaggedBatch::from_lengths(&[3, 2], &Device::Cpu).unwrap();
        assert!(err(rule(&x, &cpu, TokenScores::RowL2Norm, 1, top)).contains("cu_seqlens"));
    }
}
