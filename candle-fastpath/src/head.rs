//! [`linear_log_prob`]: one class's log-probability under a small linear classifier, per row, as
//! one kernel on CUDA (a learned pruner's keep score: DynamicViT ends its predictor with
//! `Linear(C/4, 2)` and a log-softmax, of which only the keep column is used).

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor, WithDType};

use crate::error::{FastpathError, Result};
use crate::linear::check_like;

const OP: &str = "linear_log_prob";

/// Most classes [`linear_log_prob`] takes (`HEAD_MAX_CLASSES` in kernels/fastpath.cu).
pub const HEAD_MAX_CLASSES: usize = 8;

/// Per row of `x`: `log_softmax(x·Wᵀ + b)[class]`, in f32.
///
/// * `x` - `[rows, D]`, f32 / f16 / bf16; rows may be strided (a column slice), the last dim not.
/// * `weight` - `[K, D]`, `bias` - `[K]`, in `x`'s dtype, `2 <= K <=` [`HEAD_MAX_CLASSES`].
/// * `class` - `< K`.
///
/// The logits are summed in f32 and rounded to `x`'s dtype, as that dtype's matmul with a bias
/// epilogue stores them, and the log-softmax runs in f32 over the rounded logits (what
/// `torch.autocast` does: a half `Linear`, then `log_softmax` promoted to f32). Returns `[rows]`
/// f32, contiguous.
pub fn linear_log_prob(x: &Tensor, weight: &Tensor, bias: &Tensor, class: usize) -> Result<Tensor> {
    let (k, d) = weight.dims2().map_err(|_| FastpathError::Rank {
        op: OP,
        what: "weight",
        expected: "2 ([classes, in])",
        shape: weight.shape().clone(),
    })?;
    if !(2..=HEAD_MAX_CLASSES).contains(&k) || class >= k || d == 0 {
        return Err(FastpathError::Candle(candle_core::Error::Msg(format!(
            "{OP}: needs 2..={HEAD_MAX_CLASSES} classes of at least one feature and a class \
             below them, got weight {:?} and class {class}",
            weight.dims()
        ))));
    }
    if !matches!(weight.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        return Err(FastpathError::UnsupportedDType {
            op: OP,
            dtype: weight.dtype(),
        });
    }
    let rows = match x.dims() {
        &[rows, xd] if xd == d => rows,
        _ => {
            return Err(FastpathError::ShapeMismatch {
                op: OP,
                what: "x",
                expected: Shape::from((x.dims().first().copied().unwrap_or(0), d)),
                found: x.shape().clone(),
            })
        }
    };
    check_like(OP, weight, "x", x, x.shape())?;
    check_like(OP, weight, "bias", bias, &Shape::from(k))?;
    if rows == 0 {
        return Err(FastpathError::Empty {
            op: OP,
            what: "x",
            shape: x.shape().clone(),
        });
    }
    let x = if x.stride()[1] == 1 {
        x.clone()
    } else {
        x.contiguous()?
    };
    Ok(x.apply_op3_no_bwd(
        &weight.contiguous()?,
        &bias.contiguous()?,
        &LinearLogProb { class },
    )?)
}

/// `(x [rows, D], W [K, D], b [K])` → `[rows]` f32; see [`linear_log_prob`].
pub(crate) struct LinearLogProb {
    pub class: usize,
}

/// The CPU path: the same arithmetic, the dot products summed in index order.
fn rows_log_prob<T: WithDType>(
    x: &[T],
    (x_off, ldx, rows, d): (usize, usize, usize, usize),
    w: &[T],
    b: &[T],
    class: usize,
) -> Vec<f32> {
    let k = b.len();
    let f = |v: T| v.to_f64() as f32;
    (0..rows)
        .map(|r| {
            let xr = &x[x_off + r * ldx..x_off + r * ldx + d];
            let z: Vec<f32> = (0..k)
                .map(|j| {
                    let dot = xr
                        .iter()
                        .zip(&w[j * d..(j + 1) * d])
                        .fold(0f32, |a, (&xv, &wv)| f(xv).mul_add(f(wv), a));
                    f(T::from_f64((dot + f(b[j])) as f64))
                })
                .collect();
            let m = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let s: f32 = z.iter().map(|&v| (v - m).exp()).sum();
            (z[class] - m) - s.ln()
        })
        .collect()
}

impl CustomOp3 for LinearLogProb {
    fn name(&self) -> &'static str {
        "fastpath-linear-log-prob"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, d) = lx.shape().dims2()?;
        let geo = (lx.start_offset(), lx.stride()[0], rows, d);
        let (wo, bo) = (lw.start_offset(), lb.start_offset());
        let k = lb.shape().elem_count();
        let out = match (x, w, b) {
            (CpuStorage::F32(x), CpuStorage::F32(w), CpuStorage::F32(b)) => {
                rows_log_prob(x, geo, &w[wo..wo + k * d], &b[bo..bo + k], self.class)
            }
            (CpuStorage::F16(x), CpuStorage::F16(w), CpuStorage::F16(b)) => {
                rows_log_prob(x, geo, &w[wo..wo + k * d], &b[bo..bo + k], self.class)
            }
            (CpuStorage::BF16(x), CpuStorage::BF16(w), CpuStorage::BF16(b)) => {
                rows_log_prob(x, geo, &w[wo..wo + k * d], &b[bo..bo + k], self.class)
            }
            _ => candle_core::bail!("{OP}: x, weight and bias must share a float dtype"),
        };
        Ok((CpuStorage::F32(out), Shape::from(rows)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::linear_log_prob(self.class, (x, lx), (w, lw), (b, lb))
    }
}
