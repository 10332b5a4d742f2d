//! Shared by the tests of the kernels that compute one sequence's attention from its fused qkv
//! projection inside a bigger kernel (attention_norm_linear.rs at DeiT-T's width, attention_lrn.rs
//! at DeiT-S's): its inputs, a plain f64 attention to check them against, and the applies /
//! refuses bookkeeping.

use candle_core::{DType, Device, Tensor};
use candle_fastpath::FastpathError;
use rand::rngs::StdRng;

use super::{quantize, randn};

/// The heads' width every such kernel is built for.
pub const HEAD_DIM: usize = 64;

/// `v` rounded to `dtype`, as a tensor of `shape` on `dev`.
pub fn tensor(dev: &Device, v: &[f32], shape: &[usize], dtype: DType) -> Tensor {
    Tensor::from_slice(&quantize(v, dtype), shape, dev)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// Holds an applies check to [`super::cluster_kernels_expected`]'s answer where it has one;
/// where it has none (a smaller shared-memory limit), says which way each case went (shown with
/// `--nocapture`).
pub fn expect_applies(expected: Option<bool>, applies: bool, what: &str) {
    match expected {
        Some(expected) => assert_eq!(applies, expected, "{what}: applies"),
        None => eprintln!("{what}: applies {applies}"),
    }
}

/// `got` where the fused kernel should run (`fused`), else `None` after checking that the call
/// was refused with a `NotApplicable` error.
pub fn fused_or_refused<T: std::fmt::Debug>(
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
pub fn under_test(full: &[(usize, usize)]) -> (&'static [DType], &[(usize, usize)]) {
    if std::env::var_os("ATTENTION_RNL_TEST_QUICK").is_some() {
        (&[DType::F16], &[(197, 197), (70, 64)])
    } else {
        (&[DType::F16, DType::BF16], full)
    }
}

/// The (rows in the buffer, the sequence's length) cases of a kernel's matching test: whole
/// buffers of lengths 1, 2, 15-17, 63-65, 138, 197 and `limit` (the kernel's one-wave limit on
/// the H100), and capacity-sized ones whose tail rows hold NaN.
pub fn sequence_cases(limit: usize) -> Vec<(usize, usize)> {
    let whole = [1, 2, 15, 16, 17, 63, 64, 65, 138, 197, limit];
    let mut cases: Vec<(usize, usize)> = whole.iter().map(|&n| (n, n)).collect();
    cases.extend([(70, 64), (197, 190), (200, 1)]);
    cases
}

/// One sequence of `len` tokens in buffers of `rows`, width `c`: its qkv projection (q, k of unit
/// spread, so scores of a few units, and v; NaN past the sequence, a capacity buffer's stale
/// tail) as host values and as a tensor, the residual stream `[rows, c]`, and
/// `cu_seqlens = [0, len]`.
pub fn sequence(
    dev: &Device,
    rng: &mut StdRng,
    dtype: DType,
    rows: usize,
    len: usize,
    c: usize,
) -> (Vec<f32>, Tensor, Tensor, Tensor) {
    let mut qkv = quantize(&randn(rng, rows * 3 * c, 1.0), dtype);
    qkv[len * 3 * c..].fill(f32::NAN);
    let qkv_t = tensor(dev, &qkv, &[rows, 3 * c], dtype);
    let r_t = tensor(dev, &randn(rng, rows * c, 3.0), &[rows, c], dtype);
    let cu = Tensor::from_slice(&[0u32, len as u32], 2, dev).unwrap();
    (qkv, qkv_t, r_t, cu)
}

/// softmax(q kᵀ · scale) v per head over the first `len` rows of `qkv` (`[rows, 3c]`, q | k | v,
/// `heads` heads of [`HEAD_DIM`] head-major), in f64, rounded to `dtype` as an attention kernel
/// stores it: `[len, c]` on `dev`, heads merged.
pub fn attention_host(
    dev: &Device,
    qkv: &[f32],
    len: usize,
    c: usize,
    heads: usize,
    scale: f64,
    dtype: DType,
) -> Tensor {
    let at = |row: usize, part: usize, h: usize, d: usize| {
        qkv[row * 3 * c + part * c + h * HEAD_DIM + d] as f64
    };
    let mut out = vec![0f32; len * c];
    for h in 0..heads {
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
                out[i * c + h * HEAD_DIM + d] = (v / total) as f32;
            }
        }
    }
    tensor(dev, &out, &[len, c], dtype)
}

/// `got` (a kernel's output, rows of `width`) against `want` (the steps' rows `< len`): every
/// element of those rows finite and within `tol` relative, and the rows from `len` on finite
/// (a zero attention output there, never the NaN of their qkv rows or of the poisoned memory).
pub fn assert_rows_close(
    what: &str,
    part: &str,
    (got, want): (&[f32], &[f32]),
    len: usize,
    width: usize,
    tol: f32,
) {
    for (i, (g, e)) in got[..len * width].iter().zip(want.iter()).enumerate() {
        assert!(
            g.is_finite() && (g - e).abs() <= tol * (1.0 + e.abs()),
            "{what}: {part} element {i} (row {}) is {g}, the steps give {e}",
            i / width
        );
    }
    assert!(
        got[len * width..].iter().all(|v| v.is_finite()),
        "{what}: {part} rows past the sequence must be finite"
    );
}

/// What the refusal tests hand the kernels at width `c` (f16): an 8-token sequence's qkv and
/// residual with `[0, 8]` (`one`) and two sequences' offsets (`two`), and a 577-token one (DeiT at
/// 384 pixels, past every one-wave limit) with its offsets.
pub struct RefusalInputs {
    pub qkv: Tensor,
    pub r: Tensor,
    pub one: Tensor,
    pub two: Tensor,
    pub qkv_big: Tensor,
    pub r_big: Tensor,
    pub cu_big: Tensor,
}

impl RefusalInputs {
    pub fn new(dev: &Device, rng: &mut StdRng, c: usize) -> Self {
        let rows = |rng: &mut StdRng, n: usize, w: usize| {
            tensor(dev, &randn(rng, n * w, 1.0), &[n, w], DType::F16)
        };
        let big = 577;
        Self {
            qkv: rows(rng, 8, 3 * c),
            r: rows(rng, 8, c),
            one: Tensor::from_slice(&[0u32, 8], 2, dev).unwrap(),
            two: Tensor::from_slice(&[0u32, 4, 8], 3, dev).unwrap(),
            qkv_big: rows(rng, big, 3 * c),
            r_big: rows(rng, big, c),
            cu_big: Tensor::from_slice(&[0u32, big as u32], 2, dev).unwrap(),
        }
    }

    /// `refused(qkv, cu_seqlens, heads, residual)` over the cases every such kernel must refuse:
    /// two sequences; heads of another width (`heads` is the kernel's count); a residual of other
    /// rows or dtype; qkv of another width (`c` the kernel's); u8 offsets; past the one-wave limit.
    pub fn each_common_refusal(
        &self,
        heads: usize,
        c: usize,
        mut refused: impl FnMut(&Tensor, &Tensor, usize, &Tensor),
    ) {
        let (qkv, r, one) = (&self.qkv, &self.r, &self.one);
        refused(qkv, &self.two, heads, r);
        refused(qkv, one, if heads == 6 { 3 } else { 6 }, r);
        refused(qkv, one, heads, &r.narrow(0, 0, 4).unwrap());
        refused(qkv, one, heads, &r.to_dtype(DType::F32).unwrap());
        refused(&qkv.narrow(1, 0, 2 * c).unwrap(), one, heads, r);
        refused(qkv, &one.to_dtype(DType::U8).unwrap(), heads, r);
        refused(&self.qkv_big, &self.cu_big, heads, &self.r_big);
    }
}
