//! linear_log_prob against an f64 reference (with the logits rounded to the dtype as the op
//! specifies) on fresh random inputs: every dtype, 2..8 classes, row counts 1..577, strided
//! rows, output poisoned first; bad inputs are clear errors.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_fastpath::{linear_log_prob, HEAD_MAX_CLASSES};
use common::{device, poison, quantize, randn};
use rand::{rngs::StdRng, SeedableRng};

/// `log_softmax(z)[class]` in f64 with each logit rounded to `dtype` (via f32).
fn reference(
    x: &[f32],
    ldx: usize,
    d: usize,
    w: &[f32],
    b: &[f32],
    class: usize,
    dtype: DType,
) -> Vec<f64> {
    let k = b.len();
    let rows = x.len() / ldx;
    (0..rows)
        .map(|r| {
            let z: Vec<f32> = (0..k)
                .map(|j| {
                    let dot: f64 = (0..d)
                        .map(|i| x[r * ldx + i] as f64 * w[j * d + i] as f64)
                        .sum();
                    (dot + b[j] as f64) as f32
                })
                .collect();
            let z: Vec<f64> = quantize(&z, dtype).iter().map(|&v| v as f64).collect();
            let m = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let s: f64 = z.iter().map(|v| (v - m).exp()).sum();
            z[class] - m - s.ln()
        })
        .collect()
}

#[test]
fn matches_the_reference_in_every_dtype() {
    let dev = device();
    let mut rng = StdRng::seed_from_u64(21);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for &(d, k) in &[
            (96usize, 2usize),
            (48, 2),
            (192, 2),
            (1, 2),
            (33, 3),
            (64, HEAD_MAX_CLASSES),
        ] {
            for &rows in &[1usize, 2, 63, 64, 65, 197, 577] {
                for extra in [0usize, 5] {
                    let ldx = d + extra;
                    let class = rows % k;
                    let x = quantize(&randn(&mut rng, rows * ldx, 1.0), dtype);
                    let w = quantize(&randn(&mut rng, k * d, 1.0 / (d as f32).sqrt()), dtype);
                    let b = quantize(&randn(&mut rng, k, 0.5), dtype);
                    let t = |v: &[f32], shape: &[usize]| {
                        Tensor::from_slice(v, shape, &dev)
                            .unwrap()
                            .to_dtype(dtype)
                            .unwrap()
                    };
                    let xt = t(&x, &[rows, ldx]).narrow(1, 0, d).unwrap();
                    poison(&dev, rows, DType::F32);
                    let got = linear_log_prob(&xt, &t(&w, &[k, d]), &t(&b, &[k]), class).unwrap();
                    assert_eq!(got.dims(), &[rows]);
                    assert_eq!(got.dtype(), DType::F32);
                    let got = got.to_vec1::<f32>().unwrap();
                    let want = reference(&x, ldx, d, &w, &b, class, dtype);
                    // A logit summed in a different order may round to the neighbouring value of
                    // the dtype: allow one unit in the last place of the largest logit.
                    let ulp = match dtype {
                        DType::F32 => 1e-5,
                        DType::F16 => 2e-3,
                        _ => 1.6e-2,
                    };
                    for (r, (&g, &want)) in got.iter().zip(&want).enumerate() {
                        let scale = 1.0 + want.abs();
                        assert!(
                            g.is_finite() && (g as f64 - want).abs() <= ulp * 4.0 * scale,
                            "{dtype:?} d={d} k={k} rows={rows} extra={extra} row {r}: got {g}, want {want}"
                        );
                        assert!(g <= 0.0, "a log-probability is at most 0, got {g}");
                    }
                }
            }
        }
    }
}

#[test]
fn device_agrees_with_cpu() {
    let dev = device();
    let mut rng = StdRng::seed_from_u64(22);
    let (rows, d) = (300, 96);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let x = quantize(&randn(&mut rng, rows * d, 1.0), dtype);
        let w = quantize(&randn(&mut rng, 2 * d, 0.1), dtype);
        let b = quantize(&randn(&mut rng, 2, 0.1), dtype);
        let run = |on: &Device| {
            let t = |v: &[f32], shape: &[usize]| {
                Tensor::from_slice(v, shape, on)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap()
            };
            linear_log_prob(&t(&x, &[rows, d]), &t(&w, &[2, d]), &t(&b, &[2]), 0)
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        let (a, c) = (run(&dev), run(&Device::Cpu));
        let worst = a
            .iter()
            .zip(&c)
            .map(|(p, q)| (p - q).abs())
            .fold(0f32, f32::max);
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
        assert!(worst <= tol, "{dtype:?}: device vs CPU differ by {worst}");
    }
}

#[test]
fn bad_inputs_are_clear_errors() {
    let dev = device();
    let x = Tensor::zeros((4, 6), DType::F32, &dev).unwrap();
    let w = Tensor::zeros((2, 6), DType::F32, &dev).unwrap();
    let b = Tensor::zeros(2, DType::F32, &dev).unwrap();
    let err = |r: candle_fastpath::Result<Tensor>| r.expect_err("expected an error").to_string();
    assert!(err(linear_log_prob(&x, &w, &b, 2)).contains("class 2"));
    let w9 = Tensor::zeros((9, 6), DType::F32, &dev).unwrap();
    let b9 = Tensor::zeros(9, DType::F32, &dev).unwrap();
    assert!(err(linear_log_prob(&x, &w9, &b9, 0)).contains("classes"));
    let e = err(linear_log_prob(&x.narrow(1, 0, 5).unwrap(), &w, &b, 0));
    assert!(e.contains("x has shape"), "{e}");
    let e = err(linear_log_prob(&x.to_dtype(DType::F16).unwrap(), &w, &b, 0));
    assert!(e.contains("dtype mismatch"), "{e}");
    let e = err(linear_log_prob(
        &x,
        &w,
        &Tensor::zeros(3, DType::F32, &dev).unwrap(),
        0,
    ));
    assert!(e.contains("bias has shape"), "{e}");
    let e = err(linear_log_prob(&x.narrow(0, 0, 0).unwrap(), &w, &b, 0));
    assert!(e.contains("no elements"), "{e}");
}
