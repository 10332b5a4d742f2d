//! [`LayerNorm`]: torch.nn.LayerNorm over the last dim, as one kernel of ours on CUDA (one warp
//! per row, statistics in f32 registers, 16-byte vectors), one pass per row of ours on the CPU
//! (`norm_cpu`), and the same formula in candle ops elsewhere.
//! candle-nn's CUDA LayerNorm moves the same bytes at about a third of the bandwidth; in a ViT
//! block the two norms are a tenth of the time at large batch.

use candle_core::{DType, Module, Shape, Tensor};
use candle_nn::VarBuilder;

use crate::error::{FastpathError, Result};

const OP: &str = "layer_norm";

/// LayerNorm with weight and bias `[C]` over the last dim of `[.., C]` inputs.
#[derive(Debug, Clone)]
pub struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f64,
}

/// A [`LayerNorm`] loaded like `candle_nn::layer_norm`: `weight` and `bias` `[size]` under `vb`.
pub fn layer_norm(size: usize, eps: f64, vb: VarBuilder) -> candle_core::Result<LayerNorm> {
    let weight = vb.get(size, "weight")?;
    let bias = vb.get(size, "bias")?;
    Ok(LayerNorm::new(weight, bias, eps)?)
}

impl LayerNorm {
    /// `weight` and `bias` `[C]`, same dtype (f32, f16, bf16) and device; `eps` finite and ≥ 0.
    pub fn new(weight: Tensor, bias: Tensor, eps: f64) -> Result<Self> {
        if weight.rank() != 1 || weight.elem_count() == 0 {
            return Err(FastpathError::Rank {
                op: OP,
                what: "weight",
                expected: "1 ([C], C > 0)",
                shape: weight.shape().clone(),
            });
        }
        if !matches!(weight.dtype(), DType::F32 | DType::F16 | DType::BF16) {
            return Err(FastpathError::UnsupportedDType {
                op: OP,
                dtype: weight.dtype(),
            });
        }
        crate::linear::check_like(OP, &weight, "bias", &bias, weight.shape())?;
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(FastpathError::Candle(candle_core::Error::Msg(format!(
                "layer_norm: eps must be finite and >= 0, got {eps}"
            ))));
        }
        Ok(Self {
            weight: weight.contiguous()?,
            bias: bias.contiguous()?,
            eps,
        })
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    pub fn bias(&self) -> &Tensor {
        &self.bias
    }

    pub fn eps(&self) -> f64 {
        self.eps
    }

    /// `[.., C]` → `[.., C]` normalised over the last dim.
    pub fn forward_checked(&self, x: &Tensor) -> Result<Tensor> {
        let c = self.weight.elem_count();
        if x.rank() == 0 || x.dims()[x.rank() - 1] != c {
            return Err(FastpathError::ShapeMismatch {
                op: OP,
                what: "x (last dim)",
                expected: Shape::from(c),
                found: x.shape().clone(),
            });
        }
        crate::linear::check_like(OP, &self.weight, "x", x, x.shape())?;
        if x.elem_count() == 0 {
            return Err(FastpathError::Empty {
                op: OP,
                what: "x",
                shape: x.shape().clone(),
            });
        }
        let x = x.contiguous()?;
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() && crate::cuda::layer_norm_supported(&x, &self.weight, &self.bias) {
            let op = crate::cuda::LayerNormOp {
                eps: self.eps as f32,
            };
            return Ok(x.apply_op3_no_bwd(&self.weight, &self.bias, &op)?);
        }
        if x.device().is_cpu() && cpu_norm() {
            let op = crate::norm_cpu::CpuLayerNormOp {
                eps: self.eps as f32,
            };
            return Ok(x.apply_op3_no_bwd(&self.weight, &self.bias, &op)?);
        }
        Ok(self.reference(&x)?)
    }

    /// The same computation as candle ops, in f32: the CPU path and the CUDA fallback. The
    /// variance is taken of the centred values (candle-nn's fused op uses E[x²] - E[x]², which
    /// loses digits when the mean is large next to the spread).
    fn reference(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        use candle_core::D;
        let xf = x.to_dtype(DType::F32)?;
        let centred = xf.broadcast_sub(&xf.mean_keepdim(D::Minus1)?)?;
        let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = centred.broadcast_div(&(var + self.eps)?.sqrt()?)?;
        let w = self.weight.to_dtype(DType::F32)?;
        let b = self.bias.to_dtype(DType::F32)?;
        normed
            .broadcast_mul(&w)?
            .broadcast_add(&b)?
            .to_dtype(x.dtype())
    }
}

/// Whether [`LayerNorm`] runs on the CPU as one pass per row of ours (`norm_cpu`): yes unless
/// `CANDLE_FASTPATH_CPU_NORM=0` (read once; the candle-ops reference, for A/B measurements).
pub fn cpu_norm() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::switches::on_unless_off(&ON, "CANDLE_FASTPATH_CPU_NORM")
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(self.forward_checked(x)?)
    }
}
