//! [`FusedLinear`]: a Linear layer whose bias, activation and residual ride in the matmul's
//! epilogue on CUDA, and run as plain candle ops elsewhere (same semantics, same rounding points:
//! the product and bias are summed in f32 and rounded once to the storage dtype).

use candle_core::{DType, Module, Shape, Tensor};
use candle_nn::VarBuilder;

use crate::error::{FastpathError, Result};

const OP: &str = "fused_linear";

/// What happens to `x·Wᵀ + b` before it is stored.
#[derive(Debug, Clone, Copy)]
pub enum Epilogue<'a> {
    /// `x·Wᵀ + b`.
    Plain,
    /// `gelu(x·Wᵀ + b)` with the exact erf GELU (`nn.GELU()`, as timm's ViT MLP uses).
    Gelu,
    /// `r + x·Wᵀ + b`, `r` shaped like the output: a pre-norm transformer's residual add.
    Residual(&'a Tensor),
    /// `gelu(r + x·Wᵀ + b)`: a layer whose input is split in two (a concatenation of `x` and a
    /// part whose product `r` was formed elsewhere), followed by the exact GELU.
    ResidualGelu(&'a Tensor),
}

impl Epilogue<'_> {
    fn residual(&self) -> Option<&Tensor> {
        match self {
            Epilogue::Residual(r) | Epilogue::ResidualGelu(r) => Some(r),
            _ => None,
        }
    }
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn gelu(&self) -> bool {
        matches!(self, Epilogue::Gelu | Epilogue::ResidualGelu(_))
    }
}

/// `y = x·Wᵀ + b` over the last dim of `x`, with an [`Epilogue`].
///
/// * `weight` - `[out, in]` (PyTorch / candle-nn layout).
/// * `bias` - `[out]`, optional.
/// * input `x` - `[.., in]`, any leading dims; output `[.., out]`, contiguous. A rank-2 `x`
///   whose rows are strided (a column slice `t.narrow(1, a, in)` of a wider `t`) is read in
///   place on CUDA, without a copy.
#[derive(Debug, Clone)]
pub struct FusedLinear {
    weight: Tensor,
    bias: Option<Tensor>,
}

/// A [`FusedLinear`] with bias, loaded like `candle_nn::linear`: `weight` `[out, in]` and `bias`
/// `[out]` under `vb`.
pub fn linear(in_dim: usize, out_dim: usize, vb: VarBuilder) -> candle_core::Result<FusedLinear> {
    let weight = vb.get((out_dim, in_dim), "weight")?;
    let bias = vb.get(out_dim, "bias")?;
    Ok(FusedLinear::new(weight, Some(bias))?)
}

/// A [`FusedLinear`] without bias (`weight` `[out, in]` under `vb`).
pub fn linear_no_bias(
    in_dim: usize,
    out_dim: usize,
    vb: VarBuilder,
) -> candle_core::Result<FusedLinear> {
    Ok(FusedLinear::new(
        vb.get((out_dim, in_dim), "weight")?,
        None,
    )?)
}

impl FusedLinear {
    /// Checks that `weight` is `[out, in]`, `bias` `[out]` on the same device in the same dtype
    /// (f32, f16 or bf16). The weight is made contiguous once here, not per call.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Result<Self> {
        if weight.rank() != 2 {
            return Err(FastpathError::Rank {
                op: OP,
                what: "weight",
                expected: "2 ([out, in])",
                shape: weight.shape().clone(),
            });
        }
        if !matches!(weight.dtype(), DType::F32 | DType::F16 | DType::BF16) {
            return Err(FastpathError::UnsupportedDType {
                op: OP,
                dtype: weight.dtype(),
            });
        }
        if weight.elem_count() == 0 {
            return Err(FastpathError::Empty {
                op: OP,
                what: "weight",
                shape: weight.shape().clone(),
            });
        }
        let out_dim = weight.dim(0)?;
        let bias = match bias {
            None => None,
            Some(b) => {
                check_like(OP, &weight, "bias", &b, &Shape::from(out_dim))?;
                Some(b.contiguous()?)
            }
        };
        Ok(Self {
            weight: weight.contiguous()?,
            bias,
        })
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    pub fn in_dim(&self) -> usize {
        self.weight.dims()[1]
    }

    pub fn out_dim(&self) -> usize {
        self.weight.dims()[0]
    }

    /// `x` `[.., in]` → `[.., out]` with `epilogue` applied (see [`Epilogue`]). On CUDA: one
    /// cuBLASLt call (bias and residual in its epilogue) plus, for the GELU epilogues, one
    /// in-place GELU kernel; the output is the only allocation.
    pub fn forward_with(&self, x: &Tensor, epilogue: Epilogue) -> Result<Tensor> {
        let dims = x.dims();
        if dims.is_empty() || *dims.last().unwrap() != self.in_dim() {
            return Err(FastpathError::Rank {
                op: OP,
                what: "x",
                expected: "at least 1, with the weight's in dim last",
                shape: x.shape().clone(),
            });
        }
        check_like(OP, &self.weight, "x", x, x.shape())?;
        let mut out_dims = dims.to_vec();
        *out_dims.last_mut().unwrap() = self.out_dim();
        let out_shape = Shape::from(out_dims);
        let rows = x.elem_count() / self.in_dim();
        if rows == 0 {
            return Err(FastpathError::Empty {
                op: OP,
                what: "x",
                shape: x.shape().clone(),
            });
        }
        if let Some(r) = epilogue.residual() {
            check_like(OP, &self.weight, "residual", r, &out_shape)?;
        }
        // Rows strided but each row contiguous: cuBLASLt reads them in place (its leading
        // dimension), so a column slice costs no copy.
        let row_strided = x.rank() == 2 && x.stride()[1] == 1 && x.stride()[0] >= self.in_dim();
        let x2 = if row_strided {
            x.clone()
        } else {
            x.reshape((rows, self.in_dim()))?
        };
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            let op = crate::cuda::LinearOp {
                bias: self.bias.clone(),
                gelu: epilogue.gelu(),
                residual: match epilogue.residual() {
                    Some(r) => Some(r.reshape((rows, self.out_dim()))?.contiguous()?),
                    None => None,
                },
            };
            let x2 = if row_strided { x2 } else { x2.contiguous()? };
            let y = x2.apply_op2_no_bwd(&self.weight, &op)?;
            return Ok(y.reshape(out_shape)?);
        }
        let y = self.reference(&x2, epilogue, rows)?;
        Ok(y.reshape(out_shape)?)
    }

    /// `gelu(x·Wᵀ + b)` (exact erf GELU).
    pub fn forward_gelu(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_with(x, Epilogue::Gelu)
    }

    /// `residual + x·Wᵀ + b`.
    pub fn forward_residual(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        self.forward_with(x, Epilogue::Residual(residual))
    }

    /// The same computation as separate candle ops (the CPU path, and what the CUDA path is
    /// tested against). `x2` is `[rows, in]`.
    fn reference(&self, x2: &Tensor, epilogue: Epilogue, rows: usize) -> Result<Tensor> {
        let y = x2.matmul(&self.weight.t()?)?;
        let y = match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        };
        Ok(match epilogue {
            Epilogue::Plain => y,
            Epilogue::Gelu => y.gelu_erf()?,
            Epilogue::Residual(r) => (y + r.reshape((rows, self.out_dim()))?)?,
            Epilogue::ResidualGelu(r) => (y + r.reshape((rows, self.out_dim()))?)?.gelu_erf()?,
        })
    }
}

impl Module for FusedLinear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(self.forward_with(x, Epilogue::Plain)?)
    }
}

/// `t` must have `shape` and the weight's dtype and device.
pub(crate) fn check_like(
    op: &'static str,
    weight: &Tensor,
    what: &'static str,
    t: &Tensor,
    shape: &Shape,
) -> Result<()> {
    if t.shape() != shape {
        return Err(FastpathError::ShapeMismatch {
            op,
            what,
            expected: shape.clone(),
            found: t.shape().clone(),
        });
    }
    if t.dtype() != weight.dtype() {
        return Err(FastpathError::DTypeMismatch {
            op,
            what,
            expected: weight.dtype(),
            found: t.dtype(),
        });
    }
    FastpathError::check_same_device(op, what, t.device(), weight.device())
}
