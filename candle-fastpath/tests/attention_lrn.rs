//! `attention_linear_residual_norm` (one sequence's attention from its fused qkv projection, then
//! the output projection with its residual and norm2, one cluster kernel at DeiT-S's width on
//! compute capability 9.0; lever 119) against the steps it replaces: a plain host attention (f64,
//! over the rows as rounded to the storage type), its output rounded to the storage type as the
//! attention kernel stores it, then `linear_residual_norm` (lever 98's kernel where it applies,
//! else the projection with its residual and the LayerNorm). Fresh random inputs, f16 and bf16,
//! sequence lengths 1, 2, 15-17, 63-65, 138, 197 and 256 (the one-wave limit on the H100),
//! buffers of more rows than the sequence (their tail NaN), and the output memory poisoned (NaN)
//! before each call. Built with `cuda` on a GPU with clusters the kernel must apply to all of
//! them; elsewhere (CI's CPU) it must not, and calling it is a clear error.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_fastpath::{
    attention_linear_residual_norm, attention_linear_residual_norm_applies, linear_residual_norm,
    FastpathError, FusedLinear, LayerNorm,
};
use common::{device, has_clusters, host, poison, quantize, randn};
use rand::{rngs::StdRng, SeedableRng};

const C: usize = 384;
const HEADS: usize = 6;
const HEAD_DIM: usize = 64;

fn tensor(dev: &Device, v: &[f32], shape: &[usize], dtype: DType) -> Tensor {
    Tensor::from_slice(&quantize(v, dtype), shape, dev)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// The attention projection (with a bias unless `bias` is false) and norm2, random.
fn layers(dev: &Device, rng: &mut StdRng, dtype: DType, bias: bool) -> (FusedLinear, LayerNorm) {
    let proj = FusedLinear::new(
        tensor(
            dev,
            &randn(rng, C * C, 1.0 / (C as f32).sqrt()),
            &[C, C],
            dtype,
        ),
        bias.then(|| tensor(dev, &randn(rng, C, 0.5), &[C], dtype)),
    )
    .unwrap();
    let gamma: Vec<f32> = randn(rng, C, 0.3).iter().map(|g| 1.0 + g).collect();
    let norm = LayerNorm::new(
        tensor(dev, &gamma, &[C], dtype),
        tensor(dev, &randn(rng, C, 0.2), &[C], dtype),
        1e-6,
    )
    .unwrap();
    (proj, norm)
}

/// One sequence of `len` tokens in buffers of `rows`: its qkv projection (NaN past the sequence,
/// a capacity buffer's stale tail) as host values and as a tensor, the residual stream
/// `[rows, C]`, and `cu_seqlens = [0, len]`.
fn sequence(
    dev: &Device,
    rng: &mut StdRng,
    dtype: DType,
    rows: usize,
    len: usize,
) -> (Vec<f32>, Tensor, Tensor, Tensor) {
    let mut qkv = quantize(&randn(rng, rows * 3 * C, 1.0), dtype);
    qkv[len * 3 * C..].fill(f32::NAN);
    let qkv_t = tensor(dev, &qkv, &[rows, 3 * C], dtype);
    let r_t = tensor(dev, &randn(rng, rows * C, 3.0), &[rows, C], dtype);
    let cu = Tensor::from_slice(&[0u32, len as u32], 2, dev).unwrap();
    (qkv, qkv_t, r_t, cu)
}

/// softmax(q kᵀ · scale) v per head over the first `len` rows of `qkv` (`[rows, 3C]`, q | k | v
/// head-major), in f64: `[len, C]`, heads merged.
fn attention_host(qkv: &[f32], len: usize, scale: f64) -> Vec<f32> {
    let at = |row: usize, part: usize, h: usize, d: usize| {
        qkv[row * 3 * C + part * C + h * HEAD_DIM + d] as f64
    };
    let mut out = vec![0f32; len * C];
    for h in 0..HEADS {
        for i in 0..len {
            let scores: Vec<f64> = (0..len)
                .map(|j| {
                    (0..HEAD_DIM)
                        .map(|d| at(i, 0, h, d) * at(j, 1, h, d))
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            for d in 0..HEAD_DIM {
                let v: f64 = (0..len).map(|j| weights[j] * at(j, 2, h, d)).sum();
                out[i * C + h * HEAD_DIM + d] = (v / total) as f32;
            }
        }
    }
    out
}

/// `got` where the fused kernel should run (`fused`), else `None` after checking that the call
/// was refused with a `NotApplicable` error.
fn fused_or_refused<T: std::fmt::Debug>(
    got: Result<T, FastpathError>,
    fused: bool,
    what: &str,
) -> Option<T> {
    if fused {
        return Some(got.unwrap());
    }
    assert!(
        matches!(got, Err(FastpathError::NotApplicable { .. })),
        "{what}: not applicable here, got {got:?}"
    );
    None
}

/// The dtypes and (rows, length) cases a test runs: f16 and bf16 over `full`, or with
/// ATTENTION_RNL_TEST_QUICK=1 (for racecheck, thousands of times slower per launch) f16 over
/// 197 rows and a 64-token sequence in a 70-row buffer.
fn under_test(full: &'static [(usize, usize)]) -> (&'static [DType], &'static [(usize, usize)]) {
    if std::env::var_os("ATTENTION_RNL_TEST_QUICK").is_some() {
        (&[DType::F16], &[(197, 197), (70, 64)])
    } else {
        (&[DType::F16, DType::BF16], full)
    }
}

#[test]
fn matches_attention_then_the_projection_step() {
    let dev = device();
    let fused_expected = dev.is_cuda() && has_clusters(&dev);
    let mut rng = StdRng::seed_from_u64(119);
    let scale = (HEAD_DIM as f64).powf(-0.5);
    // (rows in the buffer, the sequence's length): whole buffers, and capacity-sized ones whose
    // tail rows hold NaN.
    let (dtypes, cases) = under_test(&[
        (1, 1),
        (2, 2),
        (15, 15),
        (16, 16),
        (17, 17),
        (63, 63),
        (64, 64),
        (65, 65),
        (138, 138),
        (197, 197),
        (256, 256),
        (70, 64),
        (197, 190),
        (200, 1),
    ]);
    for &dtype in dtypes {
        let (proj, norm) = layers(&dev, &mut rng, dtype, true);
        for &(rows, len) in cases {
            let (qkv, qkv_t, r_t, cu) = sequence(&dev, &mut rng, dtype, rows, len);
            let o = tensor(&dev, &attention_host(&qkv, len, scale), &[len, C], dtype);
            let (want_x1, want_z) =
                linear_residual_norm(&o, &r_t.narrow(0, 0, len).unwrap(), &proj, &norm).unwrap();
            let (want_x1, want_z) = (host(&want_x1), host(&want_z));

            let applies =
                attention_linear_residual_norm_applies(&qkv_t, &cu, HEADS, &r_t, &proj, &norm);
            let what = format!("{dtype:?} rows {rows} len {len}");
            assert_eq!(applies, fused_expected, "{what}: applies");
            poison(&dev, 2 * rows * C, dtype);
            let got = attention_linear_residual_norm(&qkv_t, &cu, HEADS, scale, &r_t, &proj, &norm);
            let Some((x1, z)) = fused_or_refused(got, fused_expected, &what) else {
                continue;
            };
            assert_eq!(x1.dims(), &[rows, C]);
            assert_eq!(z.dims(), &[rows, C]);
            // The attention output may land one rounding of the storage type away (another
            // summation order), which the projection spreads over x1 and the LayerNorm over z.
            let (tol_x1, tol_z) = match dtype {
                DType::F16 => (2e-3, 8e-3),
                _ => (1.6e-2, 6e-2),
            };
            let (x1, z) = (host(&x1), host(&z));
            for (part, got, want, tol) in [("x1", &x1, &want_x1, tol_x1), ("z", &z, &want_z, tol_z)]
            {
                for (i, (g, e)) in got[..len * C].iter().zip(want.iter()).enumerate() {
                    assert!(
                        g.is_finite() && (g - e).abs() <= tol * (1.0 + e.abs()),
                        "{what}: {part} element {i} (row {}) is {g}, the steps give {e}",
                        i / C
                    );
                }
                // Rows past the sequence: a zero attention output, so finite values (x1 = r +
                // bp), never the NaN of their qkv rows or of the poisoned memory.
                assert!(
                    got[len * C..].iter().all(|v| v.is_finite()),
                    "{what}: {part} rows past the sequence must be finite"
                );
            }
        }
    }
}

#[test]
fn inputs_it_does_not_take_are_refused() {
    let dev = device();
    let mut rng = StdRng::seed_from_u64(120);
    let (proj, norm) = layers(&dev, &mut rng, DType::F16, true);
    let qkv = tensor(
        &dev,
        &randn(&mut rng, 8 * 3 * C, 1.0),
        &[8, 3 * C],
        DType::F16,
    );
    let r = tensor(&dev, &randn(&mut rng, 8 * C, 1.0), &[8, C], DType::F16);
    let one = Tensor::from_slice(&[0u32, 8], 2, &dev).unwrap();
    let two = Tensor::from_slice(&[0u32, 4, 8], 3, &dev).unwrap();
    let refused = |qkv: &Tensor, cu: &Tensor, heads: usize, r: &Tensor, proj: &FusedLinear| {
        assert!(!attention_linear_residual_norm_applies(
            qkv, cu, heads, r, proj, &norm
        ));
        let got = attention_linear_residual_norm(qkv, cu, heads, 0.125, r, proj, &norm);
        fused_or_refused(got, false, "attention_linear_residual_norm");
    };
    // Two sequences; heads of another width; a residual of other rows or dtype; qkv of another
    // width; a projection without its bias; u8 offsets; past the one-wave limit (577 rows, DeiT
    // at 384 pixels).
    refused(&qkv, &two, HEADS, &r, &proj);
    refused(&qkv, &one, 3, &r, &proj);
    refused(&qkv, &one, HEADS, &r.narrow(0, 0, 4).unwrap(), &proj);
    refused(&qkv, &one, HEADS, &r.to_dtype(DType::F32).unwrap(), &proj);
    refused(&qkv.narrow(1, 0, 2 * C).unwrap(), &one, HEADS, &r, &proj);
    let (no_bias, _) = layers(&dev, &mut rng, DType::F16, false);
    refused(&qkv, &one, HEADS, &r, &no_bias);
    refused(&qkv, &one.to_dtype(DType::U8).unwrap(), HEADS, &r, &proj);
    let big = 577;
    let qkv_big = tensor(
        &dev,
        &randn(&mut rng, big * 3 * C, 1.0),
        &[big, 3 * C],
        DType::F16,
    );
    let r_big = tensor(&dev, &randn(&mut rng, big * C, 1.0), &[big, C], DType::F16);
    let cu_big = Tensor::from_slice(&[0u32, big as u32], 2, &dev).unwrap();
    refused(&qkv_big, &cu_big, HEADS, &r_big, &proj);
}
