//! [`FusedLinear`](crate::FusedLinear)'s CPU path in f32: one `gemm` call whose destination
//! starts as the bias rows (`gemm` computes `dst + x·Wᵀ`), then the residual and the GELU in one
//! pass over the output.
//!
//! Why: as candle ops the layer is a matmul into a zeroed buffer, a broadcast bias add, a
//! residual add and the GELU, each a pass over the output, and candle runs every elementwise op
//! of 64 K values or more on its own barrier pool, whose worker then spins for 25,000 pauses
//! (~0.5 ms) beside the next matmul's threads: in a DeiT-S batch-1 forward on the 2-core build
//! machine that worker's spinning was ~18 % of the process's samples under `perf` (docs/
//! BENCHMARKS.md, the CPU section). Here the bias costs nothing past the copy that starts the
//! destination, and the epilogue pass runs on rayon's current pool (candle's, inside a model's
//! forward), whose workers go back to sleep after a short spin.
//!
//! f16 / bf16 keep candle's ops (candle's CPU matmul widens bf16 to f32 itself).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Storage, Tensor};

/// From this many output values the epilogue pass is split over rayon's pool (candle splits its
/// own elementwise ops from 64 K values too).
const PARALLEL_MIN: usize = 1 << 16;

/// `x·Wᵀ + b`, then `+ r` and the exact GELU as asked, for an f32 `x` `[rows, in]` (any strides)
/// and a contiguous f32 weight `[out, in]`; output `[rows, out]`, contiguous. `bias` is `[out]`
/// and `residual` `[rows, out]`, both contiguous f32 on the CPU (the caller checked shapes,
/// dtypes and devices).
pub(crate) struct CpuLinearOp {
    pub bias: Option<Tensor>,
    pub residual: Option<Tensor>,
    pub gelu: bool,
}

/// The f32 values of a contiguous CPU tensor, and its start offset within them.
fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> candle_core::Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("fused_linear (CPU): a bias or residual that is not contiguous")
    };
    match &*storage {
        Storage::Cpu(CpuStorage::F32(v)) => Ok(f(&v[start..end])),
        _ => {
            candle_core::bail!("fused_linear (CPU): a bias or residual that is not f32 on the CPU")
        }
    }
}

impl CpuLinearOp {
    /// Adds the residual to, then takes the GELU of, one run of output values (`r` the same
    /// positions of the residual).
    fn epilogue(dst: &mut [f32], r: Option<&[f32]>, gelu: bool) {
        if let Some(r) = r {
            for (d, r) in dst.iter_mut().zip(r) {
                *d += *r;
            }
        }
        if gelu {
            crate::gelu_cpu::gelu_in_place(dst);
        }
    }
}

impl CpuLinearOp {
    /// [`Self::epilogue`] over the whole output, split over rayon's pool from
    /// [`PARALLEL_MIN`] values.
    fn epilogue_pass(dst: &mut [f32], r: Option<&[f32]>, gelu: bool) {
        if dst.len() < PARALLEL_MIN {
            return Self::epilogue(dst, r, gelu);
        }
        let piece = dst
            .len()
            .div_ceil(rayon::current_num_threads().max(1))
            .next_multiple_of(64);
        rayon::scope(|s| {
            for (i, d) in dst.chunks_mut(piece).enumerate() {
                let r = r.map(|r| &r[i * piece..i * piece + d.len()]);
                s.spawn(move |_| Self::epilogue(d, r, gelu));
            }
        });
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
        let (CpuStorage::F32(x), CpuStorage::F32(w)) = (xs, ws) else {
            candle_core::bail!(
                "fused_linear (CPU): the gemm path takes f32, got {:?} and {:?}",
                xs.dtype(),
                ws.dtype()
            )
        };
        let (rows, k) = xl.shape().dims2()?;
        let (n, wk) = wl.shape().dims2()?;
        let Some((w_start, w_end)) = wl.contiguous_offsets() else {
            candle_core::bail!("fused_linear (CPU): the weight is not contiguous")
        };
        if wk != k || w_end - w_start != n * k || rows == 0 {
            candle_core::bail!(
                "fused_linear (CPU): x {:?} against weight {:?}",
                xl.shape(),
                wl.shape()
            )
        }
        let (x_rs, x_cs) = (xl.stride()[0], xl.stride()[1]);
        // gemm reads through raw pointers: the last element it reads must lie in the buffer.
        let x_last = xl.start_offset() + (rows - 1) * x_rs + (k - 1) * x_cs;
        if x_last >= x.len() {
            candle_core::bail!("fused_linear (CPU): x's layout {xl:?} reaches past its buffer")
        }
        let len = rows * n;
        let mut dst = match &self.bias {
            Some(b) => with_f32(b, |b| {
                if b.len() != n {
                    return None;
                }
                let mut dst = Vec::with_capacity(len);
                for _ in 0..rows {
                    dst.extend_from_slice(b);
                }
                Some(dst)
            })?
            .ok_or_else(|| {
                candle_core::Error::Msg("fused_linear (CPU): bias is not [out]".into())
            })?,
            None => vec![0f32; len],
        };
        let threads = candle_core::utils::get_num_threads();
        let parallelism = if threads > 1 {
            gemm::Parallelism::Rayon(threads)
        } else {
            gemm::Parallelism::None
        };
        // SAFETY: dst is [rows, n] row-major and initialised (read when there is a bias); x's
        // elements lie within its buffer (checked above), the weight's [n, k] block is
        // contiguous, read as Wᵀ ([k, n]: row stride 1, column stride k).
        unsafe {
            gemm::gemm(
                rows,
                n,
                k,
                dst.as_mut_ptr(),
                1,
                n as isize,
                self.bias.is_some(),
                x[xl.start_offset()..].as_ptr(),
                x_cs as isize,
                x_rs as isize,
                w[w_start..].as_ptr(),
                k as isize,
                1,
                1f32,
                1f32,
                false,
                false,
                false,
                parallelism,
            )
        }
        match &self.residual {
            Some(r) => with_f32(r, |r| {
                if r.len() != len {
                    candle_core::bail!("fused_linear (CPU): residual is not [rows, out]")
                }
                Self::epilogue_pass(&mut dst, Some(r), self.gelu);
                Ok(())
            })??,
            None if self.gelu => Self::epilogue_pass(&mut dst, None, true),
            None => {}
        }
        Ok((CpuStorage::F32(dst), Shape::from((rows, n))))
    }
}
