//! [`FusedLinear`](crate::FusedLinear)'s CPU path: one f32 `gemm` call for the product, then
//! the bias, the residual and the GELU in one pass over the output, in pieces over rayon's
//! pool; f16 / bf16 operands are widened to f32 first and the output rounded once at
//! the end (the CUDA path's rounding).
//!
//! Why: as candle ops the layer is a matmul into a zeroed buffer, a broadcast bias add, a
//! residual add and the GELU, each a pass over the output, and candle runs every elementwise op
//! of 64 K values or more on its own barrier pool, whose worker then spins for 25,000 pauses
//! beside the next matmul's threads: in a DeiT-S batch-1 forward on the 2-core build
//! machine that worker's spinning was ~21 % of the process's samples under `perf` (docs/
//! BENCHMARKS.md, the CPU section). Here the epilogue pass runs on rayon's current pool
//! (candle's, inside a model's forward), whose workers go back to sleep after a short spin.
//! candle's CPU matmul has no f16 / bf16 kernel of its own either: it widens both operands to
//! f32 (serially) and narrows the product, as this does in pieces over the pool.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Storage, Tensor};
use half::slice::HalfFloatSliceExt;

use crate::cpu_pieces::{f32_values, for_pieces, narrow, widen};

/// `x·Wᵀ + b`, then `+ r` and the exact GELU as asked, for `x` `[rows, in]` (any strides) and a
/// contiguous weight `[out, in]`, f32, f16 or bf16; output `[rows, out]`, contiguous, in their
/// dtype. `bias` is `[out]` and `residual` `[rows, out]`, both contiguous, of that dtype, on the
/// CPU (the caller checked shapes, dtypes and devices).
pub(crate) struct CpuLinearOp {
    pub bias: Option<Tensor>,
    pub residual: Option<Tensor>,
    pub gelu: bool,
}

/// `f` on the values of a contiguous CPU tensor (the bias or the residual, `what`) as f32.
fn with_f32<R>(t: &Tensor, what: &str, f: impl FnOnce(&[f32]) -> R) -> candle_core::Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(s) = &*storage else {
        candle_core::bail!("fused_linear (CPU): the {what} is not on the CPU")
    };
    Ok(f(&f32_values(s, layout, "fused_linear", what)?))
}

/// The rows of a half-precision `x` `[rows, k]` (any strides) widened to a contiguous f32
/// `[rows, k]`.
fn widen_rows<T: Copy + Sync + Into<f32>>(x: &[T], l: &Layout, rows: usize, k: usize) -> Vec<f32>
where
    [T]: HalfFloatSliceExt,
{
    if let Some((start, end)) = l.contiguous_offsets() {
        return widen(&x[start..end]);
    }
    let (rs, cs) = (l.stride()[0], l.stride()[1]);
    let mut out = vec![0f32; rows * k];
    for (i, row) in out.chunks_exact_mut(k).enumerate() {
        let first = l.start_offset() + i * rs;
        if cs == 1 {
            x[first..first + k].convert_to_f32_slice(row);
        } else {
            for (t, o) in row.iter_mut().enumerate() {
                *o = x[first + t * cs].into();
            }
        }
    }
    out
}

impl CpuLinearOp {
    /// Adds the bias (`b`, one value a column), then the residual, then takes the GELU of whole
    /// output rows of `n` values (`r` the same positions of the residual): the order of the CUDA
    /// epilogue, `gelu((x·Wᵀ + b) + r)`.
    fn epilogue(dst: &mut [f32], n: usize, b: Option<&[f32]>, r: Option<&[f32]>, gelu: bool) {
        if let Some(b) = b {
            for row in dst.chunks_exact_mut(n) {
                for (d, b) in row.iter_mut().zip(b) {
                    *d += *b;
                }
            }
        }
        if let Some(r) = r {
            for (d, r) in dst.iter_mut().zip(r) {
                *d += *r;
            }
        }
        if gelu {
            crate::gelu_cpu::gelu_in_place(dst);
        }
    }

    /// [`Self::epilogue`] over the whole `[rows, n]` output, in pieces of whole rows over
    /// rayon's pool.
    fn epilogue_pass(dst: &mut [f32], n: usize, b: Option<&[f32]>, r: Option<&[f32]>, gelu: bool) {
        for_pieces(dst, n, |at, d| {
            Self::epilogue(d, n, b, r.map(|r| &r[at..at + d.len()]), gelu)
        });
    }

    /// The epilogue pass over the product `dst` (`[rows, n]`) with the bias `b` and this op's
    /// residual and GELU; no pass when there is nothing to add.
    fn finish(&self, dst: &mut [f32], n: usize, b: Option<&[f32]>) -> candle_core::Result<()> {
        match &self.residual {
            Some(r) => with_f32(r, "residual", |r| {
                if r.len() != dst.len() {
                    candle_core::bail!("fused_linear (CPU): residual is not [rows, out]")
                }
                Self::epilogue_pass(dst, n, b, Some(r), self.gelu);
                Ok(())
            })?,
            None if b.is_some() || self.gelu => {
                Self::epilogue_pass(dst, n, b, None, self.gelu);
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// The layer over f32 operands: `x` `[rows, k]` from element `x0` with row / column strides
    /// `(rs, cs)`, `w` `[n, k]` contiguous; the output `[rows, n]` in f32.
    #[allow(clippy::too_many_arguments)]
    fn forward_f32(
        &self,
        x: &[f32],
        x0: usize,
        (rs, cs): (usize, usize),
        w: &[f32],
        rows: usize,
        k: usize,
        n: usize,
    ) -> candle_core::Result<Vec<f32>> {
        // gemm reads through raw pointers: every element it reads must lie in the buffers.
        if x0 + (rows - 1) * rs + (k - 1) * cs >= x.len() || w.len() != n * k {
            candle_core::bail!("fused_linear (CPU): x or the weight reaches past its buffer")
        }
        let len = rows * n;
        let mut dst = vec![0f32; len];
        let threads = candle_core::utils::get_num_threads();
        let parallelism = if threads > 1 {
            gemm::Parallelism::Rayon(threads)
        } else {
            gemm::Parallelism::None
        };
        // SAFETY: dst is [rows, n] row-major and initialised (`read_dst` false, so its values do
        // not count, but gemm copies partial edge tiles through a buffer before overwriting
        // them); x's elements lie within its buffer and the weight is [n, k] contiguous (checked
        // above), read as Wᵀ ([k, n]: row stride 1, column stride k).
        unsafe {
            gemm::gemm(
                rows,
                n,
                k,
                dst.as_mut_ptr(),
                1,
                n as isize,
                false,
                x[x0..].as_ptr(),
                cs as isize,
                rs as isize,
                w.as_ptr(),
                k as isize,
                1,
                0f32,
                1f32,
                false,
                false,
                false,
                parallelism,
            )
        }
        // The bias, residual and GELU in one pass over the product.
        match &self.bias {
            Some(b) => with_f32(b, "bias", |b| {
                if b.len() != n {
                    candle_core::bail!("fused_linear (CPU): bias is not [out]")
                }
                self.finish(&mut dst, n, Some(b))
            })??,
            None => self.finish(&mut dst, n, None)?,
        }
        Ok(dst)
    }
}

impl CustomOp2 for CpuLinearOp {
    fn name(&self) -> &'static str {
        "fused_linear_cpu"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, k) = xl.shape().dims2()?;
        let (n, wk) = wl.shape().dims2()?;
        let Some((w0, w1)) = wl.contiguous_offsets() else {
            candle_core::bail!("fused_linear (CPU): the weight is not contiguous")
        };
        if wk != k || rows == 0 || k == 0 {
            candle_core::bail!(
                "fused_linear (CPU): x {:?} against weight {:?}",
                xl.shape(),
                wl.shape()
            )
        }
        let strides = (xl.stride()[0], xl.stride()[1]);
        let dense = (k, 1);
        let out = match (xs, ws) {
            (CpuStorage::F32(x), CpuStorage::F32(w)) => CpuStorage::F32(self.forward_f32(
                x,
                xl.start_offset(),
                strides,
                &w[w0..w1],
                rows,
                k,
                n,
            )?),
            (CpuStorage::F16(x), CpuStorage::F16(w)) => {
                let (x, w) = (widen_rows(x, xl, rows, k), widen(&w[w0..w1]));
                CpuStorage::F16(narrow(&self.forward_f32(&x, 0, dense, &w, rows, k, n)?))
            }
            (CpuStorage::BF16(x), CpuStorage::BF16(w)) => {
                let (x, w) = (widen_rows(x, xl, rows, k), widen(&w[w0..w1]));
                CpuStorage::BF16(narrow(&self.forward_f32(&x, 0, dense, &w, rows, k, n)?))
            }
            _ => candle_core::bail!(
                "fused_linear (CPU): x and weight of one dtype among f32, f16, bf16, got {:?} \
                 and {:?}",
                xs.dtype(),
                ws.dtype()
            ),
        };
        Ok((out, Shape::from((rows, n))))
    }
}
