//! embed_tokens against a host loop: every row is its prefix or patch row plus its pos row,
//! summed in f32 and rounded once to the dtype (what candle's add does), in f32 / f16 / bf16;
//! no prefix, and prefixes of 1 and 2 tokens (DeiT, distilled DeiT); widths that take the CUDA kernel's
//! 16-byte path (64, 384) and widths that do not (7, 12 in f16); output memory poisoned. Then
//! bad inputs: each a clear error.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_fastpath::{embed_tokens, FastpathError};
use common::{device, host, poison, quantize, randn};
use rand::{rngs::StdRng, SeedableRng};

#[test]
fn rows_are_prefix_or_patch_plus_pos_rounded_once() {
    let dev = device();
    let mut rng = StdRng::seed_from_u64(7);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for &(b, np, c) in &[(1, 196, 384), (3, 5, 64), (2, 3, 7), (4, 9, 12), (1, 1, 1)] {
            for p in 0..=2 {
                let n = p + np;
                let patches = quantize(&randn(&mut rng, b * np * c, 1.0), dtype);
                let prefix = quantize(&randn(&mut rng, p * c, 1.0), dtype);
                let pos = quantize(&randn(&mut rng, n * c, 0.5), dtype);
                let t = |v: &[f32], shape: &[usize]| {
                    Tensor::from_slice(v, shape, &dev)
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap()
                };
                let prefix_t = (p > 0).then(|| t(&prefix, &[p, c]));
                poison(&dev, b * n * c, dtype);
                let out = embed_tokens(
                    &t(&patches, &[b, np, c]),
                    prefix_t.as_ref(),
                    &t(&pos, &[1, n, c]),
                )
                .unwrap();
                assert_eq!(out.dims(), &[b, n, c]);
                assert_eq!(out.dtype(), dtype);
                let got = host(&out);
                let mut want = Vec::with_capacity(b * n * c);
                for bi in 0..b {
                    for i in 0..n {
                        for ch in 0..c {
                            let x = if i < p {
                                prefix[i * c + ch]
                            } else {
                                patches[(bi * np + i - p) * c + ch]
                            };
                            want.push(x + pos[i * c + ch]);
                        }
                    }
                }
                let want = quantize(&want, dtype);
                for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        g.to_bits() == w.to_bits(),
                        "{dtype:?} b={b} np={np} c={c} p={p}: element {k} got {g}, want {w}"
                    );
                }
                // And exactly what the candle ops it replaces give.
                let candle = {
                    let pt = t(&patches, &[b, np, c]);
                    let tokens = if p == 0 {
                        pt
                    } else {
                        let pre = t(&prefix, &[1, p, c]).expand((b, p, c)).unwrap();
                        Tensor::cat(&[&pre, &pt], 1).unwrap()
                    };
                    host(&tokens.broadcast_add(&t(&pos, &[1, n, c])).unwrap())
                };
                assert!(got
                    .iter()
                    .zip(&candle)
                    .all(|(g, w)| g.to_bits() == w.to_bits()));
            }
        }
    }
}

#[test]
fn bad_inputs_are_clear_errors() {
    let dev = Device::Cpu;
    let z = |shape: &[usize], dtype: DType| Tensor::zeros(shape, dtype, &dev).unwrap();
    let f = DType::F32;
    let cases: Vec<(Tensor, Tensor, Tensor, &str)> = vec![
        (
            z(&[4, 8], f),
            z(&[1, 8], f),
            z(&[1, 5, 8], f),
            "patches must have rank 3",
        ),
        (
            z(&[2, 4, 8], f),
            z(&[1, 1, 8], f),
            z(&[1, 5, 8], f),
            "prefix must have rank 2",
        ),
        (
            z(&[2, 4, 8], f),
            z(&[1, 6], f),
            z(&[1, 5, 8], f),
            "prefix has shape",
        ),
        (
            z(&[2, 4, 8], f),
            z(&[0, 8], f),
            z(&[1, 4, 8], f),
            "prefix has shape",
        ),
        (
            z(&[2, 4, 8], f),
            z(&[1, 8], f),
            z(&[1, 4, 8], f),
            "pos has shape",
        ),
        (
            z(&[2, 4, 8], f),
            z(&[1, 8], f),
            z(&[2, 5, 8], f),
            "pos has shape",
        ),
        (
            z(&[2, 0, 8], f),
            z(&[1, 8], f),
            z(&[1, 1, 8], f),
            "no elements",
        ),
        (
            z(&[2, 4, 8], f),
            z(&[1, 8], DType::F16),
            z(&[1, 5, 8], f),
            "dtype mismatch, prefix",
        ),
        (
            z(&[2, 4, 8], f),
            z(&[1, 8], f),
            z(&[1, 5, 8], DType::BF16),
            "dtype mismatch, pos",
        ),
    ];
    for (patches, prefix, pos, needle) in cases {
        match embed_tokens(&patches, Some(&prefix), &pos) {
            Err(
                e @ (FastpathError::Rank { .. }
                | FastpathError::ShapeMismatch { .. }
                | FastpathError::Empty { .. }
                | FastpathError::DTypeMismatch { .. }),
            ) => {
                let msg = e.to_string();
                assert!(msg.contains(needle), "{msg:?} should say {needle:?}");
            }
            other => panic!("expected an error saying {needle:?}, got {other:?}"),
        }
    }
}
