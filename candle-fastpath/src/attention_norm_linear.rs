//! [`attention_residual_norm_linear`]: a pre-norm block's attention, its output projection and
//! residual, norm2 and fc1 (→ GELU) as one kernel, for one image's tokens (batch 1) of DeiT-T's
//! width: [`crate::residual_norm_linear`]'s cluster kernel with the attention computed inside it
//! (lever 64 in `docs/LEVERS.md`). At batch 1 the attention is a launch of ~5 µs in a CUDA
//! graph's chain for a few MFLOP of work; in the cluster it adds ~3.5 µs to the kernel after it.

use candle_core::Tensor;

use crate::error::{FastpathError, Result};
use crate::{FusedLinear, LayerNorm};

const OP: &str = "attention_residual_norm_linear";

/// Whether [`attention_residual_norm_linear`] may run, from
/// `CANDLE_FASTPATH_ATTENTION_RNL` (read once): unset (yes), `0` / `off` (no: the attention
/// kernel, then [`crate::residual_norm_linear`]; for A/B measurements).
pub fn attention_residual_norm_linear_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::switches::on_unless_off(&ON, "CANDLE_FASTPATH_ATTENTION_RNL")
}

/// Attention over one sequence's tokens from their fused qkv projection, then what
/// [`crate::residual_norm_linear`] computes from its output: `x1 = residual + o·Wpᵀ + bp`,
/// `y = norm(x1)·Wᵀ + b` (then the exact GELU), one launch.
///
/// # Arguments
/// * `qkv` - `[M, 3C]`: q | k | v, each `heads × 64` head-major (timm's layout), the rows of one
///   sequence first.
/// * `cu_seqlens` - u32 `[2]` on `qkv`'s device: `[0, len]`, `len ≤ M` (read on the device
///   only; rows past `len`, a capacity-sized buffer's tail, are neither queries nor keys).
/// * `heads` - the attention's heads (of 64: the kernel's one head width).
/// * `scale` - the softmax scale (`head_dim^-0.5` for DeiT).
/// * `residual` - `[M, C]`.
/// * `proj` - `Wp` `[C, C]` with its bias; `norm` - LayerNorm over C; `linear` - `W` `[N, C]`
///   with its bias.
///
/// # Returns
/// `(x1, y)`: `[M, C]` and `[M, N]`, contiguous views of one buffer, what the attention kernel
/// followed by [`crate::residual_norm_linear`] returns for rows `< len` (the attention sums its
/// parts in another order; the rest rounds where the two launches round). Rows past `len` get
/// a zero attention output.
///
/// Only where [`attention_residual_norm_linear_applies`] says so; anything else is an error,
/// so callers check first and otherwise run the attention and [`crate::residual_norm_linear`].
#[allow(clippy::too_many_arguments)]
pub fn attention_residual_norm_linear(
    qkv: &Tensor,
    cu_seqlens: &Tensor,
    heads: usize,
    scale: f64,
    residual: &Tensor,
    proj: &FusedLinear,
    norm: &LayerNorm,
    linear: &FusedLinear,
    gelu: bool,
) -> Result<(Tensor, Tensor)> {
    if !attention_residual_norm_linear_applies(
        qkv, cu_seqlens, heads, residual, proj, norm, linear, gelu,
    ) {
        return Err(FastpathError::NotApplicable {
            op: OP,
            inputs: format!(
                "qkv {:?} {:?} on {:?}, {heads} heads, cu_seqlens {:?} {:?}, residual {:?}, N {}",
                qkv.dims(),
                qkv.dtype(),
                qkv.device().location(),
                cu_seqlens.dims(),
                cu_seqlens.dtype(),
                residual.dims(),
                linear.out_dim()
            ),
        });
    }
    #[cfg(feature = "cuda")]
    {
        let op = crate::cuda::AttentionRnlOp {
            rows: crate::cuda::ArnlRows::Sequence(cu_seqlens.clone()),
            scale_log2: (scale * std::f64::consts::LOG2_E) as f32,
            first: step_op(proj, norm, linear, gelu),
            next: None,
            norms: None,
        };
        let (m, c) = residual.dims2()?;
        launch(
            (qkv, residual, linear.weight()),
            &op,
            m,
            c,
            linear.out_dim(),
        )
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = scale;
        unreachable!("attention_residual_norm_linear_applies is false without the cuda feature")
    }
}

/// `op` on `(a, b, c)`, its one output buffer split into the residual stream's `[m, width]` rows
/// and the last GEMM's `[m, n]` ones (contiguous views): the output every kernel of this file
/// returns.
#[cfg(feature = "cuda")]
fn launch(
    (a, b, c): (&Tensor, &Tensor, &Tensor),
    op: &impl candle_core::CustomOp3,
    m: usize,
    width: usize,
    n: usize,
) -> Result<(Tensor, Tensor)> {
    let both = a.apply_op3_no_bwd(b, c, op)?;
    let x = both.narrow(0, 0, m * width)?.reshape((m, width))?;
    let y = both.narrow(0, m * width, m * n)?.reshape((m, n))?;
    Ok((x, y))
}

/// The f32 buffer a launch of `op`-like ops left in `cell` (an output besides the op's one
/// storage: attention_block's row norms, attention_residual's class-token scores) as a 1-D tensor
/// on `device`.
#[cfg(feature = "cuda")]
fn side_output(cell: &crate::cuda::RowNormsOut, device: &candle_core::Device) -> Result<Tensor> {
    let candle_core::Device::Cuda(dev) = device else {
        unreachable!("the fused ops run on CUDA only");
    };
    let slice = cell.lock().unwrap_or_else(|e| e.into_inner()).take();
    let slice = slice.unwrap_or_else(|| unreachable!("the op's launch leaves its side output"));
    let n = slice.len();
    let storage = candle_core::Storage::Cuda(candle_core::CudaStorage::wrap_cuda_slice(
        slice,
        dev.clone(),
    ));
    Ok(Tensor::from_storage(
        storage,
        n,
        candle_core::op::BackpropOp::none(),
        false,
    ))
}

/// [`crate::cuda::ResidualNormLinearOp::from_layers`] for the fused kernels, whose `*_applies`
/// checks required every bias.
#[cfg(feature = "cuda")]
fn step_op(
    front: &FusedLinear,
    norm: &LayerNorm,
    back: &FusedLinear,
    gelu: bool,
) -> crate::cuda::ResidualNormLinearOp {
    crate::cuda::ResidualNormLinearOp::from_layers(front, norm, back, gelu)
        .unwrap_or_else(|| unreachable!("the fused kernels' applies checks require every bias"))
}

/// Whether `cu_seqlens` describes one sequence the way this file's kernels read it: a contiguous
/// u32 `[2]` (`[0, len]`) on `residual`'s device.
#[cfg(feature = "cuda")]
fn one_sequence(cu_seqlens: &Tensor, residual: &Tensor) -> bool {
    cu_seqlens.dtype() == candle_core::DType::U32
        && cu_seqlens.dims() == [2]
        && cu_seqlens.is_contiguous()
        && cu_seqlens.device().same_device(residual.device())
}

/// Whether `qkv` is the fused projection of `residual`'s rows as this file's kernels read it:
/// `[M, 3C]` for `residual` `[M, C]` with C = `heads` heads of
/// [`crate::cuda::ARNL_HEAD_DIM`], in the residual's dtype and device, contiguous and 16-byte
/// aligned.
#[cfg(feature = "cuda")]
fn fused_qkv_fits(qkv: &Tensor, heads: usize, residual: &Tensor) -> bool {
    residual.dims2().is_ok_and(|(m, c)| {
        heads * crate::cuda::ARNL_HEAD_DIM == c
            && qkv.dims() == [m, 3 * c]
            && qkv.dtype() == residual.dtype()
            && qkv.device().same_device(residual.device())
            && crate::cuda::contiguous_16b(qkv.layout(), qkv.dtype().size_in_bytes())
    })
}

/// Whether [`attention_residual_norm_linear`] runs: what [`crate::residual_norm_linear_applies`]
/// requires of the proj → norm2 → fc1 step (its proj form: C = 192, N in (640, 768], compute
/// capability 9.0, a grid of one wave, its switches), `heads` heads of 64 (three), `qkv`
/// `[M, 3C]` contiguous and 16-byte aligned in the residual's dtype and device, `residual`
/// `[M, C]`, `cu_seqlens` a contiguous u32 `[2]` on the same device (one sequence), the K / V
/// rows of M tokens within the device's shared memory (M ≤ 352 on the H100, which the
/// one-wave rule already implies), and `CANDLE_FASTPATH_ATTENTION_RNL` not `0`.
#[allow(clippy::too_many_arguments)]
pub fn attention_residual_norm_linear_applies(
    qkv: &Tensor,
    cu_seqlens: &Tensor,
    heads: usize,
    residual: &Tensor,
    proj: &FusedLinear,
    norm: &LayerNorm,
    linear: &FusedLinear,
    gelu: bool,
) -> bool {
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (qkv, cu_seqlens, heads, residual, proj, norm, linear, gelu);
        false
    }
    #[cfg(feature = "cuda")]
    {
        let candle_core::Device::Cuda(dev) = residual.device() else {
            return false;
        };
        one_sequence(cu_seqlens, residual)
            && arnl_applies(qkv, heads, residual, proj, norm, linear, gelu)
            && residual
                .dims2()
                .is_ok_and(|(m, _)| crate::cuda::has_attention_rnl(dev, m))
    }
}

/// [`attention_residual_norm_linear_applies`] but for `cu_seqlens` and the shared memory of a
/// launch: the kernel's rules for the qkv, the residual and the proj → norm → linear step.
#[cfg(feature = "cuda")]
fn arnl_applies(
    qkv: &Tensor,
    heads: usize,
    residual: &Tensor,
    proj: &FusedLinear,
    norm: &LayerNorm,
    linear: &FusedLinear,
    gelu: bool,
) -> bool {
    {
        // (residual is on a CUDA device: the callers' first check.)
        let c = norm.weight().elem_count();
        let Ok((_, rc)) = residual.dims2() else {
            return false;
        };
        attention_residual_norm_linear_enabled()
            && rc == c
            && proj.in_dim() == c
            && crate::cuda::RnlForm::of(c, linear.out_dim(), gelu)
                == Some(crate::cuda::RnlForm::Proj)
            && fused_qkv_fits(qkv, heads, residual)
            // The proj form's rules (the attention output this kernel makes has the residual's
            // shape, dtype and device).
            && crate::norm_linear::residual_norm_linear_step_applies(
                residual, proj, norm, linear, gelu,
            )
    }
}

/// Whether [`attention_linear_residual_norm`] may run, from `CANDLE_FASTPATH_ATTENTION_LRN`
/// (read once): unset (yes), `0` / `off` (no: the attention kernel, then
/// [`crate::linear_residual_norm`]; for A/B measurements).
pub fn attention_linear_residual_norm_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::switches::on_unless_off(&ON, "CANDLE_FASTPATH_ATTENTION_LRN")
}

/// Attention over one sequence's tokens from their fused qkv projection, then what
/// [`crate::linear_residual_norm`] computes from its output with the attention projection in
/// front: `x1 = residual + o·Wpᵀ + bp`, `z = norm(x1)`, one launch at DeiT-S's width (lever 119
/// in `docs/LEVERS.md`): that op's cluster kernel with the attention computed inside it, as
/// [`attention_residual_norm_linear`] does at DeiT-T's width. fc1 stays a launch of its own.
///
/// Arguments as [`attention_residual_norm_linear`]'s, without the Linear after the LayerNorm
/// (`proj`: `Wp` `[C, C]` with its bias; `norm`: the LayerNorm over C).
///
/// # Returns
/// `(x1, z)`, both `[M, C]`, contiguous views of one buffer: for rows `< len`, what the attention
/// kernel followed by [`crate::linear_residual_norm`] returns (the attention sums its keys in
/// another order, one rounding of the storage type apart at most; the rest is that op's kernel
/// bit for bit). Rows past `len` get a zero attention output.
///
/// Only where [`attention_linear_residual_norm_applies`] says so; anything else is an error, so
/// callers check first and otherwise run the attention and [`crate::linear_residual_norm`].
pub fn attention_linear_residual_norm(
    qkv: &Tensor,
    cu_seqlens: &Tensor,
    heads: usize,
    scale: f64,
    residual: &Tensor,
    proj: &FusedLinear,
    norm: &LayerNorm,
) -> Result<(Tensor, Tensor)> {
    if !attention_linear_residual_norm_applies(qkv, cu_seqlens, heads, residual, proj, norm) {
        let inputs = (qkv, cu_seqlens, heads, residual, proj);
        return Err(attention_residual_refused(
            "attention_linear_residual_norm",
            inputs,
        ));
    }
    #[cfg(feature = "cuda")]
    {
        let params =
            crate::cuda::ResidualNormParams::from_layers(proj, norm).unwrap_or_else(|| {
                unreachable!(
                    "attention_linear_residual_norm_applies requires the projection's bias"
                )
            });
        let op = crate::cuda::LinearResidualNormOp {
            params,
            attention: Some(crate::cuda::LrnAttention {
                cu_seqlens: cu_seqlens.clone(),
                scale_log2: (scale * std::f64::consts::LOG2_E) as f32,
            }),
        };
        let (m, c) = residual.dims2()?;
        let both = qkv.apply_op2_no_bwd(residual, &op)?;
        // Narrowing a contiguous 1-D tensor and reshaping it are views, not copies.
        let x1 = both.narrow(0, 0, m * c)?.reshape((m, c))?;
        let z = both.narrow(0, m * c, m * c)?.reshape((m, c))?;
        Ok((x1, z))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = scale;
        unreachable!("attention_linear_residual_norm_applies is false without the cuda feature")
    }
}

/// Whether [`attention_linear_residual_norm`] runs: what [`crate::linear_residual_norm_applies`]
/// requires of the projection step on `residual`'s shape (C = 384, f16 / bf16, `proj` `[C, C]`
/// with a bias, compute capability 9.0, a grid of one wave: up to 256 rows on the H100, its
/// switch), `heads` heads of 64 (six), `qkv` `[M, 3C]` contiguous and 16-byte aligned in the
/// residual's dtype and device, `residual` `[M, C]`, `cu_seqlens` a contiguous u32 `[2]` on the
/// same device (one sequence), the K / V rows of M tokens within the device's shared memory, and
/// `CANDLE_FASTPATH_ATTENTION_LRN` not `0`.
pub fn attention_linear_residual_norm_applies(
    qkv: &Tensor,
    cu_seqlens: &Tensor,
    heads: usize,
    residual: &Tensor,
    proj: &FusedLinear,
    norm: &LayerNorm,
) -> bool {
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (qkv, cu_seqlens, heads, residual, proj, norm);
        false
    }
    #[cfg(feature = "cuda")]
    {
        let candle_core::Device::Cuda(dev) = residual.device() else {
            return false;
        };
        let Ok((m, _)) = residual.dims2() else {
            return false;
        };
        attention_linear_residual_norm_enabled()
            && one_sequence(cu_seqlens, residual)
            && fused_qkv_fits(qkv, heads, residual)
            // The projection step's rules (the attention output this kernel makes has the
            // residual's shape, dtype and device).
            && crate::linear_residual_norm_applies(residual, residual, proj, norm)
            && crate::cuda::attention_lrn_sm_count(dev, m).is_some()
    }
}

/// Whether [`attention_residual`] may run, from `CANDLE_FASTPATH_ATTENTION_RESIDUAL` (read
/// once): unset (yes), `0` / `off` (no: [`attention_residual_norm_linear`], whose norm2 → fc1
/// output the caller drops; for A/B measurements).
pub fn attention_residual_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::switches::on_unless_off(&ON, "CANDLE_FASTPATH_ATTENTION_RESIDUAL")
}

/// Attention over one sequence's tokens from their fused qkv projection, then the output
/// projection and the residual, `x1 = residual + o·Wpᵀ + bp`, in one launch (lever 86):
/// [`attention_residual_norm_linear`]'s kernel stopping at x1, for a pruning step right after
/// the attention (EViT's), which decides which rows norm2 and fc1 see.
///
/// Arguments as [`attention_residual_norm_linear`]'s (`proj`: `Wp` `[C, C]` with its bias).
///
/// # Returns
/// `x1` `[M, C]`, bit for bit the first output of [`attention_residual_norm_linear`] (the same
/// arithmetic; rows past `len` as there).
///
/// Only where [`attention_residual_applies`] says so; anything else is an error.
pub fn attention_residual(
    qkv: &Tensor,
    cu_seqlens: &Tensor,
    heads: usize,
    scale: f64,
    residual: &Tensor,
    proj: &FusedLinear,
) -> Result<Tensor> {
    if !attention_residual_applies(qkv, cu_seqlens, heads, residual, proj) {
        let inputs = (qkv, cu_seqlens, heads, residual, proj);
        return Err(attention_residual_refused("attention_residual", inputs));
    }
    #[cfg(feature = "cuda")]
    {
        let (x1, _) = attention_residual_launch(qkv, cu_seqlens, scale, residual, proj, false)?;
        Ok(x1)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = scale;
        unreachable!("attention_residual_applies is false without the cuda feature")
    }
}

/// The error of [`attention_residual`] and [`attention_residual_with_cls_probs`] where they do
/// not apply, naming `op` and describing their inputs.
fn attention_residual_refused(
    op: &'static str,
    (qkv, cu_seqlens, heads, residual, proj): (&Tensor, &Tensor, usize, &Tensor, &FusedLinear),
) -> FastpathError {
    FastpathError::NotApplicable {
        op,
        inputs: format!(
            "qkv {:?} {:?} on {:?}, {heads} heads, cu_seqlens {:?} {:?}, residual {:?}, proj {:?}",
            qkv.dims(),
            qkv.dtype(),
            qkv.device().location(),
            cu_seqlens.dims(),
            cu_seqlens.dtype(),
            residual.dims(),
            proj.weight().dims()
        ),
    }
}

/// Whether [`attention_residual_with_cls_probs`] may run, from
/// `CANDLE_FASTPATH_ATTENTION_CLS_PROBS` (read once): unset (yes), `0` / `off` (no: the caller
/// computes the step's scores itself, candle-ragged's `cls_probs` launch; for A/B measurements).
pub fn attention_cls_probs_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::switches::on_unless_off(&ON, "CANDLE_FASTPATH_ATTENTION_CLS_PROBS")
}

/// [`attention_residual`] that also returns the class token's attention scores a pruning step
/// after this attention ranks (EViT's, ATS's), computed in the same launch by the warps the
/// attention leaves idle (lever 88): `[1, heads + 1, M]` f32, row `h < heads` head h's softmax
/// over the sequence's keys of `r(r(q_cls · scale) · k_j)` (`r` rounding to the storage type),
/// row `heads` the sum of squares of each token's value row (all heads), entries past the
/// sequence's `len` 0. These are bit for bit the rows candle-ragged's `step_scores` returns for
/// `ClsAttention` / `Significance` scores with the same `scale` (as f32) on the same qkv: one
/// header (candle-ragged's select_common.cuh) holds the arithmetic of both, so ranking these
/// keeps the tokens `select_top_k_by` keeps. Wrap them with
/// `candle_ragged::StepScores::from_parts`.
///
/// Only where [`attention_residual_applies`] says so and [`attention_cls_probs_enabled`];
/// anything else is an error.
pub fn attention_residual_with_cls_probs(
    qkv: &Tensor,
    cu_seqlens: &Tensor,
    heads: usize,
    scale: f64,
    residual: &Tensor,
    proj: &FusedLinear,
) -> Result<(Tensor, Tensor)> {
    if !attention_cls_probs_enabled()
        || !attention_residual_applies(qkv, cu_seqlens, heads, residual, proj)
    {
        let inputs = (qkv, cu_seqlens, heads, residual, proj);
        return Err(attention_residual_refused(
            "attention_residual_with_cls_probs",
            inputs,
        ));
    }
    #[cfg(feature = "cuda")]
    {
        let (x1, probs) = attention_residual_launch(qkv, cu_seqlens, scale, residual, proj, true)?;
        let probs = probs.unwrap_or_else(|| unreachable!("the launch was asked for the scores"));
        Ok((x1, probs))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = scale;
        unreachable!("attention_residual_applies is false without the cuda feature")
    }
}

/// [`attention_residual`]'s launch, with the class-token scores when `with_probs`.
#[cfg(feature = "cuda")]
fn attention_residual_launch(
    qkv: &Tensor,
    cu_seqlens: &Tensor,
    scale: f64,
    residual: &Tensor,
    proj: &FusedLinear,
    with_probs: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let op = crate::cuda::AttentionResidualOp {
        cu_seqlens: cu_seqlens.clone(),
        scale_log2: (scale * std::f64::consts::LOG2_E) as f32,
        proj_bias: proj
            .bias()
            .cloned()
            .unwrap_or_else(|| unreachable!("attention_residual_applies requires the bias")),
        cls_probs: with_probs.then(|| (scale as f32, Default::default())),
    };
    let x1 = qkv.apply_op3_no_bwd(residual, proj.weight(), &op)?;
    let probs = match &op.cls_probs {
        Some((_, cell)) => {
            let (m, c) = residual.dims2()?;
            let heads = c / crate::cuda::ARNL_HEAD_DIM;
            Some(side_output(cell, residual.device())?.reshape((1, heads + 1, m))?)
        }
        None => None,
    };
    Ok((x1, probs))
}

/// Whether [`attention_residual`] runs: CUDA with the kernel (compute capability 9.0) and the
/// shared memory of M rows, f16 / bf16, C = 192 in `heads` heads of 64, `proj` `[C, C]` with a
/// bias, `qkv` `[M, 3C]` and `residual` `[M, C]` contiguous and 16-byte aligned in one dtype and
/// device, `cu_seqlens` a contiguous u32 `[2]` there, a grid of one wave (six CTAs per 16 rows),
/// and `CANDLE_FASTPATH_ATTENTION_RESIDUAL` not `0`.
pub fn attention_residual_applies(
    qkv: &Tensor,
    cu_seqlens: &Tensor,
    heads: usize,
    residual: &Tensor,
    proj: &FusedLinear,
) -> bool {
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (qkv, cu_seqlens, heads, residual, proj);
        false
    }
    #[cfg(feature = "cuda")]
    {
        let candle_core::Device::Cuda(dev) = residual.device() else {
            return false;
        };
        let Ok((m, c)) = residual.dims2() else {
            return false;
        };
        let aligned =
            |t: &Tensor| crate::cuda::contiguous_16b(t.layout(), t.dtype().size_in_bytes());
        let dtype = residual.dtype();
        let same = |t: &Tensor| t.dtype() == dtype && t.device().same_device(residual.device());
        attention_residual_enabled()
            && matches!(dtype, candle_core::DType::F16 | candle_core::DType::BF16)
            && m > 0
            && c == crate::cuda::RNL_DIM
            && proj.weight().dims() == [c, c]
            && same(proj.weight())
            && aligned(proj.weight())
            && proj
                .bias()
                .is_some_and(|b| same(b) && b.is_contiguous() && b.elem_count() == c)
            && fused_qkv_fits(qkv, heads, residual)
            && aligned(residual)
            && one_sequence(cu_seqlens, residual)
            && crate::cuda::attention_residual_sm_count(dev, m)
                .is_some_and(|sms| m.div_ceil(16) * crate::cuda::RNL_SPLIT <= sms)
    }
}

/// Whether [`attention_block`] may run, from `CANDLE_FASTPATH_ATTENTION_BLOCK` (read once): unset
/// (yes), `0` / `off` (no: [`attention_residual_norm_linear`], then
/// [`crate::residual_norm_linear`]'s fc2 form; for A/B measurements).
pub fn attention_block_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::switches::on_unless_off(&ON, "CANDLE_FASTPATH_ATTENTION_BLOCK")
}

/// The weights of one pre-norm ViT block after its attention, and the next block's norm1 and
/// qkv: what [`attention_block`] runs from a block's qkv to the next one's.
#[derive(Clone, Copy, Debug)]
pub struct BlockTail<'a> {
    pub proj: &'a FusedLinear,
    pub norm2: &'a LayerNorm,
    pub fc1: &'a FusedLinear,
    pub fc2: &'a FusedLinear,
    /// The next block's norm1 and qkv projection.
    pub next_norm1: &'a LayerNorm,
    pub next_qkv: &'a FusedLinear,
}

impl<'a> BlockTail<'a> {
    /// Its MLP half and the next block's norm1 and qkv, as [`mlp_block`] takes them.
    pub fn mlp(&self) -> MlpTail<'a> {
        MlpTail {
            norm2: self.norm2,
            fc1: self.fc1,
            fc2: self.fc2,
            next_norm1: self.next_norm1,
            next_qkv: self.next_qkv,
        }
    }
}

/// What the fused block kernels require of a block's MLP half on rows like `x` beyond
/// [`crate::norm_linear`]'s rules for norm2 → fc1: fc1 exactly 4C wide, and
/// [`crate::residual_norm_linear_applies`]'s fc2 form for fc2, the next block's norm1 and qkv
/// (fc2's K = 4C, the next qkv weight's dtype and device, N in (480, 576]).
#[cfg(feature = "cuda")]
fn fc2_step_applies(x: &Tensor, w: &MlpTail) -> bool {
    w.fc1.out_dim() == 4 * w.norm2.weight().elem_count()
        && crate::norm_linear::residual_norm_linear_step_applies(
            x,
            w.fc2,
            w.next_norm1,
            w.next_qkv,
            false,
        )
}

/// A whole pre-norm block of one sequence from its qkv projection, and the next block's qkv, in
/// one launch (lever 65): [`attention_residual_norm_linear`] (with the GELU) and then
/// [`crate::residual_norm_linear`]'s fc2 form, `x2 = x1 + fc2(h)`, `qkv' = next_qkv(next_norm1(x2))`,
/// with `x1` and `h` kept on chip.
///
/// Arguments as [`attention_residual_norm_linear`]'s (`residual` the block's input).
///
/// # Returns
/// `(x2, qkv')`: `[M, C]` and `[M, N2]`, contiguous views of one buffer, exactly what the two
/// kernels return (the same arithmetic in the same order; rows past `len` as there).
///
/// Only where [`attention_block_applies`] says so; anything else is an error.
pub fn attention_block(
    qkv: &Tensor,
    cu_seqlens: &Tensor,
    heads: usize,
    scale: f64,
    residual: &Tensor,
    w: &BlockTail,
) -> Result<(Tensor, Tensor)> {
    let (x2, next_qkv, _) =
        attention_block_launch(qkv, cu_seqlens, heads, scale, residual, w, false)?;
    Ok((x2, next_qkv))
}

/// [`attention_block`] that also returns the L2 norm of each row of `x2`, computed in the same
/// launch (lever 77): what a Threshold-L2 step before the next block ranks, without reading x2
/// back.
///
/// # Returns
/// `(x2, qkv', norms)`: the first two as [`attention_block`]'s; `norms` `[M]` f32, row `i`'s
/// `sqrt(Σ x2[i, c]²)` over the stored (rounded) values, by candle-ragged's row-norm arithmetic
/// (`select_top_k` with `ScoreSource::RowL2Norm`: each 8-element chunk's squares fused-multiply-
/// added in column order from 0, the chunks' sums added by a butterfly over 32 lanes, xor 16, 8,
/// 4, 2, 1; C = 192 fills 24 lanes), so ranking them keeps the same tokens bit for bit.
pub fn attention_block_with_norms(
    qkv: &Tensor,
    cu_seqlens: &Tensor,
    heads: usize,
    scale: f64,
    residual: &Tensor,
    w: &BlockTail,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (x2, next_qkv, norms) =
        attention_block_launch(qkv, cu_seqlens, heads, scale, residual, w, true)?;
    let norms = norms.unwrap_or_else(|| unreachable!("the launch was asked for the norms"));
    Ok((x2, next_qkv, norms))
}

/// [`attention_block`]'s one launch, with x2's row norms when `with_norms`.
fn attention_block_launch(
    qkv: &Tensor,
    cu_seqlens: &Tensor,
    heads: usize,
    scale: f64,
    residual: &Tensor,
    w: &BlockTail,
    with_norms: bool,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    if !attention_block_applies(qkv, cu_seqlens, heads, residual, w) {
        return Err(FastpathError::NotApplicable {
            op: "attention_block",
            inputs: format!(
                "qkv {:?} {:?}, {heads} heads, cu_seqlens {:?}, residual {:?}, fc1 N {}, next qkv N {}",
                qkv.dims(),
                qkv.dtype(),
                cu_seqlens.dims(),
                residual.dims(),
                w.fc1.out_dim(),
                w.next_qkv.out_dim()
            ),
        });
    }
    #[cfg(feature = "cuda")]
    {
        let rows = crate::cuda::ArnlRows::Sequence(cu_seqlens.clone());
        block_launch(qkv, residual, rows, residual.dim(0)?, scale, w, with_norms)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (scale, with_norms);
        unreachable!("attention_block_applies is false without the cuda feature")
    }
}

/// The one launch of [`attention_block`] and [`select_attention_block`]: the attention kernel with
/// `next` over `rows` (one sequence, or a step's input), `m` output rows; `(x2, qkv', norms)`,
/// x2's row norms when `with_norms`. W is fc1's weight; the second output is the next block's
/// qkv.
#[cfg(feature = "cuda")]
fn block_launch(
    qkv: &Tensor,
    residual: &Tensor,
    rows: crate::cuda::ArnlRows,
    m: usize,
    scale: f64,
    w: &BlockTail,
    with_norms: bool,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    let op = crate::cuda::AttentionRnlOp {
        rows,
        scale_log2: (scale * std::f64::consts::LOG2_E) as f32,
        first: step_op(w.proj, w.norm2, w.fc1, true),
        next: Some((
            step_op(w.fc2, w.next_norm1, w.next_qkv, false),
            w.next_qkv.weight().clone(),
        )),
        norms: with_norms.then(Default::default),
    };
    let operands = (qkv, residual, w.fc1.weight());
    let (x2, next_qkv) = launch(operands, &op, m, residual.dim(1)?, w.next_qkv.out_dim())?;
    let norms = match &op.norms {
        Some(cell) => Some(side_output(cell, residual.device())?),
        None => None,
    };
    Ok((x2, next_qkv, norms))
}

/// Whether [`attention_block`] runs: [`attention_residual_norm_linear_applies`] for the block's
/// attention, proj, norm2 and fc1 (with the GELU), fc1 exactly 4C wide, what
/// [`crate::residual_norm_linear_applies`] requires of its fc2 form for fc2, the next block's
/// norm1 and qkv (N in (480, 576]), the shared memory of the longer kernel, and
/// `CANDLE_FASTPATH_ATTENTION_BLOCK` not `0`.
pub fn attention_block_applies(
    qkv: &Tensor,
    cu_seqlens: &Tensor,
    heads: usize,
    residual: &Tensor,
    w: &BlockTail,
) -> bool {
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (qkv, cu_seqlens, heads, residual, w);
        false
    }
    #[cfg(feature = "cuda")]
    {
        let candle_core::Device::Cuda(dev) = residual.device() else {
            return false;
        };
        attention_block_enabled()
            && fc2_step_applies(residual, &w.mlp())
            && attention_residual_norm_linear_applies(
                qkv, cu_seqlens, heads, residual, w.proj, w.norm2, w.fc1, true,
            )
            && residual
                .dims2()
                .is_ok_and(|(m, _)| crate::cuda::has_attention_block(dev, m))
    }
}

/// Whether [`select_attention_block`] may run, from `CANDLE_FASTPATH_SELECT_ATTENTION_BLOCK`
/// (read once): unset (yes), `0` / `off` (no: candle-ragged's `select_top_k_gathering`, then
/// [`attention_block`]; for A/B measurements).
pub fn select_attention_block_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::switches::on_unless_off(&ON, "CANDLE_FASTPATH_SELECT_ATTENTION_BLOCK")
}

/// A fixed-count pruning step before a block (Threshold-L2's, DynamicViT's: no fused row) and
/// then the whole block and the next block's qkv, in one launch (lever 90): what candle-ragged's
/// `select_top_k_gathering` (keep the `prefix` tokens and the `keep` best-scored patches, in
/// position order, with the same rows of the block's qkv projection) followed by
/// [`attention_block`] over the kept rows compute, with the ranking run by every CTA of the
/// block's kernel at its head (candle-ragged's arithmetic, one header for both kernels) and the
/// kept rows read in place.
///
/// # Arguments
/// * `qkv` - `[len, 3C]`: the block's qkv projection of every input token (the block before
///   computes it with its fc2).
/// * `residual` - `[len, C]`: the step's input tokens (one sequence).
/// * `scores` - that sequence's scores from `candle_ragged::step_scores` (batch 1, `len`).
/// * `prefix`, `keep` - as `select_top_k_gathering`'s.
/// * `heads`, `scale`, `w` - as [`attention_block`]'s.
///
/// # Returns
/// `(x2, qkv')`: `[M, C]` and `[M, N2]` with `M = prefix + keep`, contiguous views of one
/// buffer, bit for bit what `select_top_k_gathering` and then [`attention_block`] return.
///
/// Only where [`select_attention_block_applies`] says so; anything else is an error.
#[allow(clippy::too_many_arguments)]
pub fn select_attention_block(
    qkv: &Tensor,
    residual: &Tensor,
    scores: &candle_ragged::StepScores,
    prefix: usize,
    keep: usize,
    heads: usize,
    scale: f64,
    w: &BlockTail,
) -> Result<(Tensor, Tensor)> {
    let (x2, next_qkv, _) =
        select_attention_block_launch(qkv, residual, scores, prefix, keep, heads, scale, w, false)?;
    Ok((x2, next_qkv))
}

/// [`select_attention_block`] that also returns the L2 norms of x2's rows, as
/// [`attention_block_with_norms`] does (for a Threshold-L2 step right after this block).
#[allow(clippy::too_many_arguments)]
pub fn select_attention_block_with_norms(
    qkv: &Tensor,
    residual: &Tensor,
    scores: &candle_ragged::StepScores,
    prefix: usize,
    keep: usize,
    heads: usize,
    scale: f64,
    w: &BlockTail,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (x2, next_qkv, norms) =
        select_attention_block_launch(qkv, residual, scores, prefix, keep, heads, scale, w, true)?;
    let norms = norms.unwrap_or_else(|| unreachable!("the launch was asked for the norms"));
    Ok((x2, next_qkv, norms))
}

/// [`select_attention_block`]'s one launch, with x2's row norms when `with_norms`.
#[allow(clippy::too_many_arguments)]
fn select_attention_block_launch(
    qkv: &Tensor,
    residual: &Tensor,
    scores: &candle_ragged::StepScores,
    prefix: usize,
    keep: usize,
    heads: usize,
    scale: f64,
    w: &BlockTail,
    with_norms: bool,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    let scores_fit = one_sequence_scores(scores, residual);
    let out_rows = prefix + keep;
    if !scores_fit || !select_attention_block_applies(qkv, heads, residual, w, out_rows) {
        return Err(FastpathError::NotApplicable {
            op: "select_attention_block",
            inputs: format!(
                "qkv {:?} {:?}, {heads} heads, residual {:?} on {:?}, scores {:?} of {} sequence(s) on {:?}, {out_rows} kept, fc1 N {}, next qkv N {}",
                qkv.dims(),
                qkv.dtype(),
                residual.dims(),
                residual.device().location(),
                scores.layout(),
                scores.batch_size(),
                scores.tensor().device().location(),
                w.fc1.out_dim(),
                w.next_qkv.out_dim()
            ),
        });
    }
    #[cfg(feature = "cuda")]
    {
        let select = crate::cuda::SelectStep::new(scores, prefix, keep, 0)?;
        let rows = crate::cuda::ArnlRows::Step(select);
        block_launch(qkv, residual, rows, out_rows, scale, w, with_norms)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (scale, with_norms);
        unreachable!("select_attention_block_applies is false without the cuda feature")
    }
}

/// Whether [`select_attention_block`] runs for a step keeping `out_rows` of `residual`'s tokens:
/// what [`attention_block_applies`] requires of `qkv`, `residual` (the step's input, at most 512
/// rows: the kernel's selection scratch) and the weights but for `cu_seqlens`, 1 ≤ `out_rows` ≤
/// the input's rows, the kernel and the shared memory of `out_rows` rows on the device, and
/// `CANDLE_FASTPATH_SELECT_ATTENTION_BLOCK` not `0`. The step's own arguments are checked by the
/// call, which errs on scores that are not one sequence of the residual's tokens on its device,
/// and on bad `prefix` / `keep`.
pub fn select_attention_block_applies(
    qkv: &Tensor,
    heads: usize,
    residual: &Tensor,
    w: &BlockTail,
    out_rows: usize,
) -> bool {
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (qkv, heads, residual, w, out_rows);
        false
    }
    #[cfg(feature = "cuda")]
    {
        let candle_core::Device::Cuda(dev) = residual.device() else {
            return false;
        };
        select_attention_block_enabled()
            && attention_block_enabled()
            && residual.dims2().is_ok_and(|(len, _)| {
                len <= crate::cuda::SELECT_STEP_MAX_LEN && (1..=len).contains(&out_rows)
            })
            && fc2_step_applies(residual, &w.mlp())
            && arnl_applies(qkv, heads, residual, w.proj, w.norm2, w.fc1, true)
            && crate::cuda::has_select_attention_block(dev, out_rows)
    }
}

/// Whether [`mlp_block`] may run, from `CANDLE_FASTPATH_MLP_BLOCK` (read once): unset (yes), `0` /
/// `off` (no: [`crate::norm_linear`] and then [`crate::residual_norm_linear`]'s fc2 form; for A/B
/// measurements).
pub fn mlp_block_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::switches::on_unless_off(&ON, "CANDLE_FASTPATH_MLP_BLOCK")
}

/// The weights of a pre-norm ViT block's MLP half and the next block's norm1 and qkv: what
/// [`mlp_block`] runs from a block's hidden states after its attention to the next block's qkv.
#[derive(Clone, Copy, Debug)]
pub struct MlpTail<'a> {
    pub norm2: &'a LayerNorm,
    pub fc1: &'a FusedLinear,
    pub fc2: &'a FusedLinear,
    /// The next block's norm1 and qkv projection.
    pub next_norm1: &'a LayerNorm,
    pub next_qkv: &'a FusedLinear,
}

/// A pre-norm block's MLP half on tokens `x1` (its hidden states after attention + residual),
/// and the next block's qkv, in one launch (lever 72): `h = GELU(fc1(norm2(x1)))`,
/// `x2 = x1 + fc2(h)`, `qkv' = next_qkv(next_norm1(x2))`, with `h` kept on chip: what
/// [`crate::norm_linear`] (with the GELU) and then [`crate::residual_norm_linear`]'s fc2 form
/// compute, for a block whose halves a pruning step separates (EViT's, after the attention).
///
/// # Arguments
/// * `x1` - `[M, C]`, any rows (one image's, or several; no attention here).
/// * `w` - the weights ([`MlpTail`]).
///
/// # Returns
/// `(x2, qkv')`: `[M, C]` and `[M, N2]`, contiguous views of one buffer, exactly what the two
/// kernels return (the same arithmetic in the same order).
///
/// Only where [`mlp_block_applies`] says so; anything else is an error.
pub fn mlp_block(x1: &Tensor, w: &MlpTail) -> Result<(Tensor, Tensor)> {
    if !mlp_block_applies(x1, w) {
        return Err(FastpathError::NotApplicable {
            op: "mlp_block",
            inputs: format!(
                "x1 {:?} {:?} on {:?}, fc1 N {}, next qkv N {}",
                x1.dims(),
                x1.dtype(),
                x1.device().location(),
                w.fc1.out_dim(),
                w.next_qkv.out_dim()
            ),
        });
    }
    #[cfg(feature = "cuda")]
    {
        mlp_launch(x1, w, None, x1.dim(0)?)
    }
    #[cfg(not(feature = "cuda"))]
    unreachable!("mlp_block_applies is false without the cuda feature")
}

/// The one launch of [`mlp_block`] and [`select_mlp_block`] (with `select`): `m` output rows of
/// x2 and of the next qkv.
#[cfg(feature = "cuda")]
fn mlp_launch(
    x1: &Tensor,
    w: &MlpTail,
    select: Option<crate::cuda::SelectStep>,
    m: usize,
) -> Result<(Tensor, Tensor)> {
    let fc1_bias = w.fc1.bias().cloned();
    let fc1_bias =
        fc1_bias.unwrap_or_else(|| unreachable!("mlp_block_applies requires every bias"));
    let op = crate::cuda::MlpBlockOp {
        ln_weight: w.norm2.weight().clone(),
        ln_bias: w.norm2.bias().clone(),
        fc1_bias,
        eps: w.norm2.eps() as f32,
        second: step_op(w.fc2, w.next_norm1, w.next_qkv, false),
        select,
    };
    let operands = (x1, w.fc1.weight(), w.next_qkv.weight());
    launch(operands, &op, m, x1.dim(1)?, w.next_qkv.out_dim())
}

/// Whether `scores` are one sequence's, of `x`'s tokens and on its device: what the fused step
/// kernels take.
fn one_sequence_scores(scores: &candle_ragged::StepScores, x: &Tensor) -> bool {
    scores.batch_size() == 1
        && x.dim(0).is_ok_and(|len| len == scores.len())
        && scores.tensor().device().same_device(x.device())
}

/// Whether [`mlp_block`] runs: norm2 → fc1 with the GELU as [`crate::norm_linear`]'s kernel takes
/// them (f16 / bf16, biases, C = 192 here) with fc1 exactly 4C wide, what
/// [`crate::residual_norm_linear_applies`] requires of its fc2 form for fc2, the next block's
/// norm1 and qkv (N in (480, 576], a grid of one wave: M ≤ 352 on the H100), the kernel and its
/// shared memory on the device, and `CANDLE_FASTPATH_MLP_BLOCK` not `0`.
pub fn mlp_block_applies(x1: &Tensor, w: &MlpTail) -> bool {
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (x1, w);
        false
    }
    #[cfg(feature = "cuda")]
    {
        let candle_core::Device::Cuda(dev) = x1.device() else {
            return false;
        };
        let c = w.norm2.weight().elem_count();
        mlp_block_enabled()
            && x1.dims2().is_ok_and(|(_, xc)| xc == c)
            && fc2_step_applies(x1, w)
            && crate::norm_linear::norm_linear_eligible(x1, w.norm2, w.fc1, true)
            && crate::cuda::has_mlp_block(dev)
    }
}

/// Whether [`select_mlp_block`] may run, from `CANDLE_FASTPATH_SELECT_MLP_BLOCK` (read once):
/// unset (yes), `0` / `off` (no: candle-ragged's `select_top_k_by`, then [`mlp_block`]; for A/B
/// measurements).
pub fn select_mlp_block_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::switches::on_unless_off(&ON, "CANDLE_FASTPATH_SELECT_MLP_BLOCK")
}

/// A fixed-count pruning step after a block's attention and then the block's MLP half and the
/// next block's qkv, in one launch (lever 87): what candle-ragged's `select_top_k_by` (keep the
/// `prefix` tokens and the `keep` best-scored patches, in position order, then the dropped
/// patches fused into one row when `fusion` says so) followed by [`mlp_block`] on its output
/// compute, with the selection run by every CTA of the MLP kernel at its head (the ranking and
/// the fused row by candle-ragged's own arithmetic, one header for both kernels).
///
/// # Arguments
/// * `x1` - `[len, C]`: one sequence's hidden states after attention + residual (the step's
///   input).
/// * `scores` - that sequence's scores from `candle_ragged::step_scores` (batch 1, `len`).
/// * `prefix`, `keep`, `fusion` - as `select_top_k_by`'s (no fused row when nothing is dropped).
/// * `w` - the MLP half's weights and the next block's norm1 and qkv ([`MlpTail`]).
///
/// # Returns
/// `(x2, qkv')`: `[M, C]` and `[M, N2]` with `M = prefix + keep` (+ 1 for the fused row),
/// contiguous views of one buffer, bit for bit what `select_top_k_by` and then [`mlp_block`]
/// return.
///
/// Only where [`select_mlp_block_applies`] says so; anything else is an error.
pub fn select_mlp_block(
    x1: &Tensor,
    scores: &candle_ragged::StepScores,
    prefix: usize,
    keep: usize,
    fusion: Option<candle_ragged::DroppedFusion>,
    w: &MlpTail,
) -> Result<(Tensor, Tensor)> {
    let scores_fit = one_sequence_scores(scores, x1);
    if !scores_fit || !select_mlp_block_applies(x1, w) {
        return Err(FastpathError::NotApplicable {
            op: "select_mlp_block",
            inputs: format!(
                "x1 {:?} {:?} on {:?}, scores {:?} of {} sequence(s) on {:?}, fc1 N {}, next qkv N {}",
                x1.dims(),
                x1.dtype(),
                x1.device().location(),
                scores.layout(),
                scores.batch_size(),
                scores.tensor().device().location(),
                w.fc1.out_dim(),
                w.next_qkv.out_dim()
            ),
        });
    }
    #[cfg(feature = "cuda")]
    {
        let len = x1.dim(0)?;
        let fuse = match fusion.filter(|_| keep < len.saturating_sub(prefix)) {
            None => 0,
            Some(candle_ragged::DroppedFusion::WeightedMean) => 1,
            Some(candle_ragged::DroppedFusion::WeightedSum) => 2,
        };
        let select = crate::cuda::SelectStep::new(scores, prefix, keep, fuse)?;
        let m = select.out_rows();
        mlp_launch(x1, w, Some(select), m)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (prefix, keep, fusion);
        unreachable!("select_mlp_block_applies is false without the cuda feature")
    }
}

/// Whether [`select_mlp_block`] runs: [`mlp_block_applies`] for `x1` and `w` (its grid then
/// fits one wave for any step output, which has at most x1's rows), `x1` at most 512 rows (the
/// kernel's selection scratch), the kernel on the device, and `CANDLE_FASTPATH_SELECT_MLP_BLOCK`
/// not `0`. The step's own arguments are checked by the call, which errs on scores that are not
/// one sequence of x1's tokens on its device, and on bad `prefix` / `keep`.
pub fn select_mlp_block_applies(x1: &Tensor, w: &MlpTail) -> bool {
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (x1, w);
        false
    }
    #[cfg(feature = "cuda")]
    {
        let candle_core::Device::Cuda(dev) = x1.device() else {
            return false;
        };
        select_mlp_block_enabled()
            && x1
                .dims2()
                .is_ok_and(|(len, _)| len <= crate::cuda::SELECT_STEP_MAX_LEN)
            && mlp_block_applies(x1, w)
            && crate::cuda::has_select_mlp_block(dev)
    }
}
