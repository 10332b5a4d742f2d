//! [`embed_tokens`]: the tokens entering a ViT's first block, `[prefix tokens, patch tokens] +
//! pos_embed`, as one kernel on CUDA instead of a concatenation (two copies) and a broadcast add
//! (candle's strided broadcast kernel, the slowest pass of the embedding at large batch).

#[cfg(feature = "cuda")]
use candle_core::DType;
use candle_core::{Shape, Tensor};

use crate::error::{FastpathError, Result};

const OP: &str = "embed_tokens";

/// `[B, P + Np, C]` tokens: row `i < P` of every image is `prefix[i] + pos[i]`, row `P + j` is
/// `patches[b, j] + pos[P + j]`. Bit for bit what `Tensor::cat(&[prefix expanded, patches], 1)`
/// followed by `broadcast_add(pos)` gives (one rounding of the f32 sum), on every device.
///
/// * `patches` - `[B, Np, C]` (the patch embedding's output), `B ≥ 1`, `C ≥ 1`.
/// * `prefix` - `[P, C]`, `P ≥ 1` (the class token, and the distillation token of distilled
///   DeiTs); `None` for a ViT without one (`P = 0`).
/// * `pos` - `[1, P + Np, C]` or `[P + Np, C]` (timm's `pos_embed`).
///
/// All three of one dtype and on one device.
pub fn embed_tokens(patches: &Tensor, prefix: Option<&Tensor>, pos: &Tensor) -> Result<Tensor> {
    let (b, np, c) = patches.dims3().map_err(|_| FastpathError::Rank {
        op: OP,
        what: "patches",
        expected: "3 ([B, Np, C])",
        shape: patches.shape().clone(),
    })?;
    if b * np * c == 0 {
        return Err(FastpathError::Empty {
            op: OP,
            what: "patches",
            shape: patches.shape().clone(),
        });
    }
    let p = match prefix {
        None => 0,
        Some(prefix) => {
            let (p, pc) = prefix.dims2().map_err(|_| FastpathError::Rank {
                op: OP,
                what: "prefix",
                expected: "2 ([P, C])",
                shape: prefix.shape().clone(),
            })?;
            if pc != c || p == 0 {
                return Err(FastpathError::ShapeMismatch {
                    op: OP,
                    what: "prefix",
                    expected: Shape::from((p.max(1), c)),
                    found: prefix.shape().clone(),
                });
            }
            p
        }
    };
    let n = p + np;
    let pos = match pos.dims() {
        [1, pn, pc] | [pn, pc] if *pn == n && *pc == c => pos.reshape((n, c))?,
        _ => {
            return Err(FastpathError::ShapeMismatch {
                op: OP,
                what: "pos",
                expected: Shape::from((1, n, c)),
                found: pos.shape().clone(),
            })
        }
    };
    for (what, t) in [("prefix", prefix), ("pos", Some(&pos))] {
        let Some(t) = t else { continue };
        if t.dtype() != patches.dtype() {
            return Err(FastpathError::DTypeMismatch {
                op: OP,
                what,
                expected: patches.dtype(),
                found: t.dtype(),
            });
        }
        FastpathError::check_same_device(OP, what, t.device(), patches.device())?;
    }
    #[cfg(feature = "cuda")]
    if patches.device().is_cuda()
        && matches!(patches.dtype(), DType::F32 | DType::F16 | DType::BF16)
        && !candle_ops_forced()
    {
        let op = crate::cuda::EmbedTokensOp { prefix: p };
        let pos = pos.contiguous()?;
        // Without a prefix the kernel reads no prefix row: `pos` stands in for the operand.
        let prefix = prefix.map_or(Ok(pos.clone()), |t| t.contiguous())?;
        return Ok(patches.contiguous()?.apply_op3_no_bwd(&prefix, &pos, &op)?);
    }
    let tokens = match prefix {
        None => patches.clone(),
        Some(prefix) => Tensor::cat(&[&prefix.unsqueeze(0)?.expand((b, p, c))?, patches], 1)?,
    };
    Ok(tokens.broadcast_add(&pos.unsqueeze(0)?)?)
}

/// `CANDLE_FASTPATH_EMBED=ops`: the candle ops (cat + broadcast_add) on CUDA too, for A/B runs.
#[cfg(feature = "cuda")]
fn candle_ops_forced() -> bool {
    static OPS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::switches::read_once(&OPS, "CANDLE_FASTPATH_EMBED", |v| v == Some("ops"))
}
