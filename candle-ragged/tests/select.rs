//! select_top_k against a naive reference: every dtype, sequence lengths 2…577, one or two
//! prefix tokens, keep from 1 to everything, scores with many ties and NaNs, with and without the
//! fused token; output memory poisoned. Kept rows must be bit-identical copies; the fused row is
//! checked against an f64 sum.

mod common;

use candle_core::{DType, Tensor};
use candle_ragged::{select_top_k, DroppedFusion};
use common::{device, poison, quantize, randn, rng};
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
