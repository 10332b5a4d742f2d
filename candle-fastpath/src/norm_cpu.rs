//! [`LayerNorm`](crate::LayerNorm)'s CPU path: one pass per row (mean, then the variance of the
//! centred values, then the scaled output) in f32, rows split over rayon's pool.
//!
//! Why: as candle ops the same formula is nine ops (two means, a square, a square root, four
//! broadcast ops, the casts), each a pass over the tensor, and every elementwise op of 64 K values
//! or more runs on candle's barrier pool, whose worker then spins for 25,000 pauses beside the
//! next op's threads (see `linear_cpu`): a DeiT-S block's two norms at batch 1 are eight such ops.
//!
//! Same formula as the candle-ops reference (`LayerNorm::reference`): mean, variance of the
//! centred values (no E[x²] − E[x]² cancellation), `(x − mean) / sqrt(var + eps) · w + b`, all in
//! f32, one rounding to f16 / bf16 at the end. The sums run over eight interleaved partial sums
//! (so that they vectorise), then those eight in order: not candle's summation order, so the
//! last bits may differ from the reference.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Shape};
use candle_ragged::half_cpu::HalfSlice;

use crate::cpu_pieces::{collect_pieces, f32_values};

/// `[.., C]` → `[.., C]`, contiguous x; weight and bias `[C]` (the caller checked shapes, dtypes
/// and devices).
pub(crate) struct CpuLayerNormOp {
    pub eps: f32,
}

/// The sum of `v` as eight interleaved partial sums, then those in order.
#[inline(always)]
fn sum8(v: &[f32], mut f: impl FnMut(f32) -> f32) -> f32 {
    let mut acc = [0f32; 8];
    let mut chunks = v.chunks_exact(8);
    for c in &mut chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += f(x);
        }
    }
    for (a, &x) in acc.iter_mut().zip(chunks.remainder()) {
        *a += f(x);
    }
    acc.iter().sum()
}

#[inline(always)]
fn norm_rows_f32(x: &[f32], w: &[f32], b: &[f32], eps: f32, out: &mut [f32]) {
    let c = w.len();
    for (row, out) in x.chunks_exact(c).zip(out.chunks_exact_mut(c)) {
        let mean = sum8(row, |v| v) / c as f32;
        let var = sum8(row, |v| (v - mean) * (v - mean)) / c as f32;
        let std = (var + eps).sqrt();
        for (((o, &v), &w), &b) in out.iter_mut().zip(row).zip(w).zip(b) {
            *o = (v - mean) / std * w + b;
        }
    }
}

/// [`norm_rows_f32`] compiled for AVX2 when the CPU has it (no FMA: the baseline build's bits).
pub(crate) fn norm_rows_dispatch(x: &[f32], w: &[f32], b: &[f32], eps: f32, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        #[target_feature(enable = "avx2")]
        unsafe fn avx2(x: &[f32], w: &[f32], b: &[f32], eps: f32, out: &mut [f32]) {
            norm_rows_f32(x, w, b, eps, out)
        }
        // SAFETY: the CPU reports AVX2.
        return unsafe { avx2(x, w, b, eps, out) };
    }
    norm_rows_f32(x, w, b, eps, out)
}

/// f16 / bf16 rows through f32 ([`candle_ragged::half_cpu`]'s conversions), one rounding at the end.
fn norm_rows_half<T: HalfSlice>(x: &[T], w: &[f32], b: &[f32], eps: f32, out: &mut [T]) {
    let c = w.len();
    let mut wide = vec![0f32; c];
    let mut wide_out = vec![0f32; c];
    for (row, out) in x.chunks_exact(c).zip(out.chunks_exact_mut(c)) {
        T::widen(row, &mut wide);
        norm_rows_dispatch(&wide, w, b, eps, &mut wide_out);
        T::narrow(&wide_out, out);
    }
}

/// The rows of `x` (whole rows of `c` values) through `rows(x_piece, out_piece)` into a new
/// vector, in pieces over rayon's pool.
fn split_rows<T: Copy + Default + Send + Sync>(
    x: &[T],
    c: usize,
    rows: impl Fn(&[T], &mut [T]) + Sync,
) -> Vec<T> {
    collect_pieces(x.len(), c, |at, o| rows(&x[at..at + o.len()], o))
}

impl CustomOp3 for CpuLayerNormOp {
    fn name(&self) -> &'static str {
        "layer_norm_cpu"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let Some((start, end)) = xl.contiguous_offsets() else {
            candle_core::bail!("layer_norm (CPU): x is not contiguous")
        };
        let w = f32_values(ws, wl, "layer_norm", "weight")?;
        let b = f32_values(bs, bl, "layer_norm", "bias")?;
        let c = w.len();
        if c == 0 || b.len() != c || (end - start) % c != 0 || xl.dims().last() != Some(&c) {
            candle_core::bail!(
                "layer_norm (CPU): x {:?} against weight {:?} and bias {:?}",
                xl.shape(),
                wl.shape(),
                bl.shape()
            )
        }
        let eps = self.eps;
        let out = match xs {
            CpuStorage::F32(v) => {
                let x = &v[start..end];
                CpuStorage::F32(split_rows(x, c, |x, o| {
                    norm_rows_dispatch(x, &w, &b, eps, o)
                }))
            }
            CpuStorage::F16(v) => {
                let x = &v[start..end];
                CpuStorage::F16(split_rows(x, c, |x, o| norm_rows_half(x, &w, &b, eps, o)))
            }
            CpuStorage::BF16(v) => {
                let x = &v[start..end];
                CpuStorage::BF16(split_rows(x, c, |x, o| norm_rows_half(x, &w, &b, eps, o)))
            }
            other => candle_core::bail!("layer_norm (CPU): no kernel for {:?}", other.dtype()),
        };
        Ok((out, xl.shape().clone()))
    }
}
