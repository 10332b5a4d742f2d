//! [`patchify`]: the patch rows a ViT's stride-p patch-embedding conv multiplies, as one kernel
//! on CUDA (gather and cast in one pass) instead of a cast, a six-dim permute copy and a reshape.

use candle_core::{DType, Tensor};

use crate::error::{FastpathError, Result};

const OP: &str = "patchify";

/// Non-overlapping `patch × patch` patches of `pixels` `[B, C, H, W]` as rows
/// `[B·(H/p)·(W/p), C·p·p]`, patches in row-major grid order, each row in (channel, row, column)
/// order (a `[D, C, p, p]` conv weight flattened to `[D, C·p·p]` multiplies it), cast to `dtype`.
pub fn patchify(pixels: &Tensor, patch: usize, dtype: DType) -> Result<Tensor> {
    patchify_after_zero_rows(pixels, patch, dtype, 0)
}

/// [`patchify`] with `lead` zero rows in front of each image's patch rows:
/// `[B·(lead + (H/p)·(W/p)), C·p·p]`. A patch-embedding GEMM over these rows gives a whole token
/// sequence's rows, the class (and distillation) rows being its bias alone (lever 67 in
/// `docs/LEVERS.md`: the embedding and the first block's norm1 + qkv as one kernel).
pub fn patchify_after_zero_rows(
    pixels: &Tensor,
    patch: usize,
    dtype: DType,
    lead: usize,
) -> Result<Tensor> {
    let (b, c, h, w) = pixels.dims4().map_err(|_| FastpathError::Rank {
        op: OP,
        what: "pixels",
        expected: "4 ([B, C, H, W])",
        shape: pixels.shape().clone(),
    })?;
    if patch == 0 || h % patch != 0 || w % patch != 0 || b * c * h * w == 0 {
        return Err(FastpathError::Candle(candle_core::Error::Msg(format!(
            "{OP}: pixels {:?} do not split into {patch}×{patch} patches",
            pixels.dims()
        ))));
    }
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        return Err(FastpathError::UnsupportedDType { op: OP, dtype });
    }
    let (gh, gw) = (h / patch, w / patch);
    #[cfg(feature = "cuda")]
    // The kernel takes f32 pixels, or 16-bit ones of the rows' own type (lever 114).
    if pixels.device().is_cuda() && (pixels.dtype() == DType::F32 || pixels.dtype() == dtype) {
        let op = crate::cuda::PatchifyOp { patch, dtype, lead };
        return Ok(pixels.contiguous()?.apply_op1_no_bwd(&op)?);
    }
    let cols = c * patch * patch;
    let rows = pixels
        .to_dtype(dtype)?
        .reshape((b, c, gh, patch, gw, patch))?
        .permute((0, 2, 4, 1, 3, 5))?
        .reshape((b, gh * gw, cols))?;
    let rows = if lead == 0 {
        rows
    } else {
        let zeros = Tensor::zeros((b, lead, cols), dtype, pixels.device())?;
        Tensor::cat(&[&zeros, &rows], 1)?
    };
    Ok(rows.reshape((b * (lead + gh * gw), cols))?)
}
