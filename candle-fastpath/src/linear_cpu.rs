//! [`FusedLinear`](crate::FusedLinear)'s CPU path: the product on the weight's packed panels
//! (`packed_cpu`, x86-64 with AVX2 + FMA; the op then takes `x` alone, the layer holding no
//! weight tensor), the bias, the residual and the GELU applied a task's block at a time;
//! elsewhere (or under `CANDLE_FASTPATH_CPU_PACKED=0`) one f32 `gemm` call on `x` and the weight,
//! then those in one pass over the output, in pieces over rayon's pool. f16 / bf16 inputs are
//! widened to f32 first and the output rounded once at the end (the CUDA path's rounding).
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
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Tensor};
use candle_ragged::half_cpu::HalfSlice;

use crate::cpu_pieces::{for_pieces, narrow, storage_f32, widen};
use crate::packed_cpu::{Finish, PackedWeight};

/// `x·Wᵀ + b`, then `+ r` and the exact GELU as asked, for `x` `[rows, in]` (any strides) and a
/// contiguous weight `[out, in]`, f32, f16 or bf16; output `[rows, out]`, contiguous, in their
/// dtype. `bias` is `[out]` and `residual` `[rows, out]`, both contiguous, of that dtype, on the
/// CPU (the caller checked shapes, dtypes and devices).
pub(crate) struct CpuLinearOp<'a> {
    pub bias: Option<Tensor>,
    pub residual: Option<Tensor>,
    pub gelu: bool,
    /// The weight's panels, when the product runs on them ([`crate::cpu_packed`]) rather than
    /// through `gemm`.
    pub packed: Option<&'a PackedWeight>,
}

/// The rows of a half-precision `x` `[rows, k]` (any strides) widened to a contiguous f32
/// `[rows, k]`.
fn widen_rows<T: HalfSlice + Into<f32>>(x: &[T], l: &Layout, rows: usize, k: usize) -> Vec<f32> {
    if let Some((start, end)) = l.contiguous_offsets() {
        return widen(&x[start..end]);
    }
    let (rs, cs) = (l.stride()[0], l.stride()[1]);
    let mut out = vec![0f32; rows * k];
    for (i, row) in out.chunks_exact_mut(k).enumerate() {
        let first = l.start_offset() + i * rs;
        if cs == 1 {
            T::widen(&x[first..first + k], row);
        } else {
            for (t, o) in row.iter_mut().enumerate() {
                *o = x[first + t * cs].into();
            }
        }
    }
    out
}

impl CpuLinearOp<'_> {
    /// `finish` over the whole `[rows, n]` output `dst`, in pieces of whole rows over rayon's
    /// pool.
    fn finish_pass(dst: &mut [f32], n: usize, finish: Finish<'_>) {
        if finish.is_none() {
            return;
        }
        for_pieces(dst, n, |at, d| {
            for (i, row) in d.chunks_exact_mut(n).enumerate() {
                finish.apply(row, at / n + i, 0..n, n)
            }
        });
    }

    /// The layer over f32 operands: `x` `[rows, k]` from element `x0` with row / column strides
    /// `(rs, cs)`, `w` `[n, k]` contiguous (read only by `gemm`, when the op has no panels); the
    /// output `[rows, n]` in f32.
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
        if x0 + (rows - 1) * rs + (k - 1) * cs >= x.len() {
            candle_core::bail!("fused_linear (CPU): x reaches past its buffer")
        }
        let bias_storage = self.bias.as_ref().map(|b| b.storage_and_layout());
        let residual_storage = self.residual.as_ref().map(|r| r.storage_and_layout());
        let bias = match &bias_storage {
            Some((guard, layout)) => Some(storage_f32(guard, layout, "fused_linear", "bias")?),
            None => None,
        };
        let residual = match &residual_storage {
            Some((guard, layout)) => Some(storage_f32(guard, layout, "fused_linear", "residual")?),
            None => None,
        };
        if bias.as_ref().is_some_and(|b| b.len() != n) {
            candle_core::bail!("fused_linear (CPU): bias is not [out]")
        }
        if residual.as_ref().is_some_and(|r| r.len() != rows * n) {
            candle_core::bail!("fused_linear (CPU): residual is not [rows, out]")
        }
        let finish = Finish {
            bias: bias.as_deref(),
            residual: residual.as_deref(),
            gelu: self.gelu,
        };
        if let Some(packed) = self.packed {
            return Ok(if cs == 1 {
                packed.product(&x[x0..], rs, rows, finish)
            } else {
                let dense: Vec<f32> = (0..rows)
                    .flat_map(|i| (0..k).map(move |t| x[x0 + i * rs + t * cs]))
                    .collect();
                packed.product(&dense, k, rows, finish)
            });
        }
        // gemm reads through raw pointers: every element it reads must lie in the buffers.
        if w.len() != n * k {
            candle_core::bail!("fused_linear (CPU): the weight is not [out, in]")
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
        Self::finish_pass(&mut dst, n, finish);
        Ok(dst)
    }

    /// The layer on `x` (`[rows, k]`, any strides) and, when the op has no panels, the weight
    /// `w` (`[n, k]`, contiguous, x's dtype).
    fn forward(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        w: Option<(&CpuStorage, &Layout)>,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, k) = xl.shape().dims2()?;
        // The weight's rows, its dtype and, for `gemm`, its storage and the range of its values.
        let (n, w_dtype, ws) = match (self.packed, w) {
            (Some(p), _) => {
                if p.depth() != k {
                    candle_core::bail!("fused_linear (CPU): x {:?} against the weight", xl.shape())
                }
                (p.out(), p.dtype(), None)
            }
            (None, Some((ws, wl))) => {
                let Some(range) = wl.contiguous_offsets() else {
                    candle_core::bail!("fused_linear (CPU): the weight is not contiguous")
                };
                let (n, wk) = wl.shape().dims2()?;
                if wk != k {
                    candle_core::bail!(
                        "fused_linear (CPU): x {:?} against weight {:?}",
                        xl.shape(),
                        wl.shape()
                    )
                }
                (n, ws.dtype(), Some((ws, range.0..range.1)))
            }
            (None, None) => candle_core::bail!("fused_linear (CPU): neither panels nor a weight"),
        };
        if rows == 0 || k == 0 {
            candle_core::bail!("fused_linear (CPU): x {:?} is empty", xl.shape())
        }
        if w_dtype != xs.dtype() {
            candle_core::bail!("fused_linear (CPU): x and weight of different dtypes")
        }
        let strides = (xl.stride()[0], xl.stride()[1]);
        let dense = (k, 1);
        let out = match xs {
            CpuStorage::F32(x) => {
                let w = match &ws {
                    Some((CpuStorage::F32(w), r)) => &w[r.clone()],
                    _ => &[][..],
                };
                CpuStorage::F32(self.forward_f32(x, xl.start_offset(), strides, w, rows, k, n)?)
            }
            CpuStorage::F16(x) => {
                let w = match &ws {
                    Some((CpuStorage::F16(w), r)) => widen(&w[r.clone()]),
                    _ => Vec::new(),
                };
                let x = widen_rows(x, xl, rows, k);
                CpuStorage::F16(narrow(&self.forward_f32(&x, 0, dense, &w, rows, k, n)?))
            }
            CpuStorage::BF16(x) => {
                let w = match &ws {
                    Some((CpuStorage::BF16(w), r)) => widen(&w[r.clone()]),
                    _ => Vec::new(),
                };
                let x = widen_rows(x, xl, rows, k);
                CpuStorage::BF16(narrow(&self.forward_f32(&x, 0, dense, &w, rows, k, n)?))
            }
            _ => candle_core::bail!(
                "fused_linear (CPU): x of f32, f16 or bf16, got {:?}",
                xs.dtype()
            ),
        };
        Ok((out, Shape::from((rows, n))))
    }
}

/// The layer with its weight as panels ([`CpuLinearOp::packed`]): `x` alone.
impl CustomOp1 for CpuLinearOp<'_> {
    fn name(&self) -> &'static str {
        "fused_linear_cpu"
    }

    fn cpu_fwd(&self, xs: &CpuStorage, xl: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        self.forward(xs, xl, None)
    }
}

/// The layer on `x` and the weight tensor (`gemm`).
impl CustomOp2 for CpuLinearOp<'_> {
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
        self.forward(xs, xl, Some((ws, wl)))
    }
}
