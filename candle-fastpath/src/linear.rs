//! [`FusedLinear`]: a Linear layer whose bias, activation and residual ride in the matmul's
//! epilogue on CUDA, in the tiles of a product over the weight's packed panels on the CPU
//! (`linear_cpu`, `packed_cpu`; one f32 `gemm` call and one pass after it on CPUs without
//! AVX2 and FMA), and as plain candle ops elsewhere (same semantics; on CUDA and the CPU the product, bias and
//! residual are summed in f32 and rounded once to the storage dtype, candle's ops round each
//! step).

use candle_core::{DType, Module, Shape, Tensor};
use candle_nn::VarBuilder;

use std::sync::{Arc, OnceLock};

use crate::error::{FastpathError, Result};
use crate::packed_cpu::{cpu_packed, PackedWeight};

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
    weight: Weight,
    bias: Option<Tensor>,
}

/// How a [`FusedLinear`] holds its weight.
#[derive(Debug, Clone)]
enum Weight {
    /// As given (made contiguous): on CUDA, and on CPUs without the packed product.
    Tensor(Tensor),
    /// On the CPU where [`cpu_packed`] holds: as the panels the product reads, in the weight's
    /// dtype, and nothing else, so the layer costs the weight's bytes once (holding the tensor
    /// too doubled a CPU model's memory). [`FusedLinear::weight`] unpacks a copy on its first
    /// call; no forward path on the CPU asks for it.
    Packed {
        panels: Arc<PackedWeight>,
        unpacked: Arc<OnceLock<Tensor>>,
    },
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
        let weight = weight.contiguous()?;
        let weight = if weight.device().is_cpu() && cpu_packed() {
            Weight::Packed {
                panels: Arc::new(PackedWeight::pack(&weight)?),
                unpacked: Arc::default(),
            }
        } else {
            Weight::Tensor(weight)
        };
        Ok(Self { weight, bias })
    }

    /// The weight, `[out, in]`. A CPU layer that holds only its panels (see [`cpu_packed`])
    /// unpacks them into a tensor on the first call and keeps it (the weight's bytes again).
    pub fn weight(&self) -> &Tensor {
        match &self.weight {
            Weight::Tensor(w) => w,
            Weight::Packed { panels, unpacked } => unpacked.get_or_init(|| panels.unpack()),
        }
    }

    fn dtype(&self) -> DType {
        match &self.weight {
            Weight::Tensor(w) => w.dtype(),
            Weight::Packed { panels, .. } => panels.dtype(),
        }
    }

    fn device(&self) -> &candle_core::Device {
        match &self.weight {
            Weight::Tensor(w) => w.device(),
            Weight::Packed { .. } => &candle_core::Device::Cpu,
        }
    }

    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The weight's panels, where the layer holds them ([`cpu_packed`] on the CPU).
    pub(crate) fn packed(&self) -> Option<&PackedWeight> {
        match &self.weight {
            Weight::Packed { panels, .. } => Some(panels),
            Weight::Tensor(_) => None,
        }
    }

    pub fn in_dim(&self) -> usize {
        match &self.weight {
            Weight::Tensor(w) => w.dims()[1],
            Weight::Packed { panels, .. } => panels.depth(),
        }
    }

    pub fn out_dim(&self) -> usize {
        match &self.weight {
            Weight::Tensor(w) => w.dims()[0],
            Weight::Packed { panels, .. } => panels.out(),
        }
    }

    /// `x` `[.., in]` → `[.., out]` with `epilogue` applied (see [`Epilogue`]). On CUDA: one
    /// cuBLASLt call (bias and residual in its epilogue) plus, for the GELU epilogues, one
    /// in-place GELU kernel; the output is the only allocation. On the CPU: the product on the
    /// weight's panels (packed when the layer was made), with the bias, the residual and the GELU
    /// applied to each task's block of the output ([`cpu_packed`]; one f32 `gemm` call and one
    /// pass after it where that does not apply); f16 / bf16 inputs widened first, the output
    /// rounded once at the end ([`cpu_gemm`]).
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
        check_parts(OP, self.dtype(), self.device(), "x", x, x.shape())?;
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
            check_parts(OP, self.dtype(), self.device(), "residual", r, &out_shape)?;
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
            if let (true, Some(bias)) = (self.thin_applies(&x2, rows, epilogue), &self.bias) {
                let op = crate::cuda::ThinGemmOp {
                    bias: bias.clone(),
                    gelu: epilogue.gelu(),
                };
                let y = x2.apply_op2_no_bwd(self.weight(), &op)?;
                return Ok(y.reshape(out_shape)?);
            }
            let op = crate::cuda::LinearOp {
                bias: self.bias.clone(),
                gelu: epilogue.gelu(),
                residual: match epilogue.residual() {
                    Some(r) => Some(r.reshape((rows, self.out_dim()))?.contiguous()?),
                    None => None,
                },
            };
            let x2 = if row_strided { x2 } else { x2.contiguous()? };
            let y = x2.apply_op2_no_bwd(self.weight(), &op)?;
            return Ok(y.reshape(out_shape)?);
        }
        if x.device().is_cpu() && cpu_gemm() {
            let op = crate::linear_cpu::CpuLinearOp {
                bias: self.bias.clone(),
                residual: match epilogue.residual() {
                    Some(r) => Some(r.reshape((rows, self.out_dim()))?.contiguous()?),
                    None => None,
                },
                gelu: epilogue.gelu(),
                packed: match &self.weight {
                    Weight::Packed { panels, .. } => Some(panels.as_ref()),
                    Weight::Tensor(_) => None,
                },
            };
            let y = match &self.weight {
                Weight::Packed { .. } => x2.apply_op1_no_bwd(&op)?,
                Weight::Tensor(w) => x2.apply_op2_no_bwd(w, &op)?,
            };
            return Ok(y.reshape(out_shape)?);
        }
        let y = self.reference(&x2, epilogue, rows)?;
        Ok(y.reshape(out_shape)?)
    }

    /// Whether [`Self::forward_with`] runs `x` with `epilogue` through the thin GEMM (lever 100 in
    /// `docs/LEVERS.md`) rather than cuBLASLt (and, for the GELU, the GELU pass after it):
    /// see [`thin_gemm_mode`] for when. For tests and A/B measurements.
    pub fn thin_gemm_applies(&self, x: &Tensor, epilogue: Epilogue) -> bool {
        let k = self.in_dim();
        x.dims().last() == Some(&k) && self.thin_applies(x, x.elem_count() / k, epilogue)
    }

    /// [`Self::thin_gemm_applies`] for `x` of `rows` rows of the weight's in dim: CUDA with
    /// compute capability 9.0 (TMA and wgmma), a bias, the Plain or GELU epilogue (the GELU in
    /// its default Φ form) as [`thin_gemm_mode`] allows, f16 or bf16, K = 384 (DeiT-S's C) or,
    /// unless [`thin_gemm_wide`] says no, 768 (DeiT-B's, and every DeiT's patch embedding) for
    /// at most 320 rows, N even, `x` and the weight contiguous and 16-byte aligned, and a grid
    /// of 64-row tiles (64 columns at K = 384, 128 at 768) within one wave (one CTA per SM:
    /// batch-1 row counts).
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    fn thin_applies(&self, x: &Tensor, rows: usize, epilogue: Epilogue) -> bool {
        #[cfg(not(feature = "cuda"))]
        return false;
        #[cfg(feature = "cuda")]
        {
            let candle_core::Device::Cuda(dev) = x.device() else {
                return false;
            };
            let mode = thin_gemm_mode();
            let allowed = match epilogue {
                Epilogue::Plain => mode == ThinGemmMode::On,
                Epilogue::Gelu => {
                    mode != ThinGemmMode::Off
                        && crate::gelu_form::gelu_form() == crate::gelu_form::GeluForm::Phi
                }
                _ => false,
            };
            let size = x.dtype().size_in_bytes();
            let (k, n, tile) = (self.in_dim(), self.out_dim(), crate::cuda::THIN_GEMM_TILE);
            let Some(width) = crate::cuda::ThinGemmWidth::of(k) else {
                return false;
            };
            // K = 768 at batch-1 row counts only: a batch-8 DeiT-T / S patch embedding (1,568
            // rows, 50-75 CTAs of 128 columns) measured ~1 % slower than cuBLASLt's (lever 130).
            let wide_ok = thin_gemm_wide() && rows <= crate::cuda::THIN_GEMM_WIDE_MAX_ROWS;
            allowed
                && (width == crate::cuda::ThinGemmWidth::K384 || wide_ok)
                && self.bias.is_some()
                && matches!(x.dtype(), DType::F16 | DType::BF16)
                && n % 2 == 0
                && rows > 0
                && crate::cuda::contiguous_16b(x.layout(), size)
                && crate::cuda::contiguous_16b(self.weight().layout(), size)
                && crate::cuda::thin_gemm_sm_count(dev)
                    .is_some_and(|sms| rows.div_ceil(tile) * n.div_ceil(width.tile_n()) <= sms)
        }
    }

    /// `gelu(x·Wᵀ + b)` (exact erf GELU).
    pub fn forward_gelu(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_with(x, Epilogue::Gelu)
    }

    /// `residual + x·Wᵀ + b`.
    pub fn forward_residual(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        self.forward_with(x, Epilogue::Residual(residual))
    }

    /// The same computation as separate candle ops (the CPU path under
    /// `CANDLE_FASTPATH_CPU_LINEAR=0`, and what the CUDA path falls back to). `x2` is
    /// `[rows, in]`.
    fn reference(&self, x2: &Tensor, epilogue: Epilogue, rows: usize) -> Result<Tensor> {
        let y = x2.matmul(&self.weight().t()?)?;
        let y = match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        };
        Ok(match epilogue {
            Epilogue::Plain => y,
            Epilogue::Gelu => crate::gelu_erf(&y)?,
            Epilogue::Residual(r) => (y + r.reshape((rows, self.out_dim()))?)?,
            Epilogue::ResidualGelu(r) => {
                crate::gelu_erf(&(y + r.reshape((rows, self.out_dim()))?)?)?
            }
        })
    }
}

impl Module for FusedLinear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(self.forward_with(x, Epilogue::Plain)?)
    }
}

/// Whether [`FusedLinear`] runs on the CPU through this crate's kernels (`linear_cpu`: the
/// product on the weight's packed panels where [`cpu_packed`] says so, else one f32 `gemm`
/// call, with the bias, residual and GELU applied once): yes unless
/// `CANDLE_FASTPATH_CPU_LINEAR=0` (read once; candle's ops, for A/B measurements).
pub fn cpu_gemm() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::switches::on_unless_off(&ON, "CANDLE_FASTPATH_CPU_LINEAR")
}

/// When [`FusedLinear`] takes its thin GEMM (lever 100 in `docs/LEVERS.md`), from
/// `CANDLE_FASTPATH_THIN_GEMM` (read once).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ThinGemmMode {
    /// The default: the Plain and GELU epilogues.
    On,
    /// The GELU epilogue only (`=gelu`; for A/B measurements).
    GeluOnly,
    /// Never (`=0`): cuBLASLt (and the GELU pass) everywhere.
    Off,
}

/// The mode `CANDLE_FASTPATH_THIN_GEMM` selects (read once): unset, `gelu`, `0`.
///
/// The thin GEMM computes `x·Wᵀ + b` (then the exact GELU) in 64-row tiles over the whole of K,
/// one wave of CTAs whose operands the TMA loads and wgmma multiplies, where cuBLASLt's GEMM
/// and the GELU pass after it are two launches of a few µs each: the few rows of a batch-1
/// forward at DeiT-S's width and (see [`thin_gemm_wide`]) DeiT-B's.
pub fn thin_gemm_mode() -> ThinGemmMode {
    static MODE: std::sync::OnceLock<ThinGemmMode> = std::sync::OnceLock::new();
    crate::switches::read_once(&MODE, "CANDLE_FASTPATH_THIN_GEMM", |v| match v {
        Some("gelu") => ThinGemmMode::GeluOnly,
        Some("0") | Some("off") => ThinGemmMode::Off,
        _ => ThinGemmMode::On,
    })
}

/// Whether [`FusedLinear`]'s thin GEMM also takes K = 768 (DeiT-B's width, lever 130 in
/// `docs/LEVERS.md`), within what [`thin_gemm_mode`] allows: yes unless
/// `CANDLE_FASTPATH_THIN_GEMM_WIDE=0` (read once; for A/B measurements).
pub fn thin_gemm_wide() -> bool {
    static WIDE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::switches::on_unless_off(&WIDE, "CANDLE_FASTPATH_THIN_GEMM_WIDE")
}

/// `t` must have `shape` and the weight's dtype and device.
pub(crate) fn check_like(
    op: &'static str,
    weight: &Tensor,
    what: &'static str,
    t: &Tensor,
    shape: &Shape,
) -> Result<()> {
    check_parts(op, weight.dtype(), weight.device(), what, t, shape)
}

/// [`check_like`] against a weight's dtype and device.
fn check_parts(
    op: &'static str,
    dtype: DType,
    device: &candle_core::Device,
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
    if t.dtype() != dtype {
        return Err(FastpathError::DTypeMismatch {
            op,
            what,
            expected: dtype,
            found: t.dtype(),
        });
    }
    FastpathError::check_same_device(op, what, t.device(), device)
}
