//! The one attention seam of the model.
//!
//! Everything in a block except attention is a per-token op (LayerNorm, Linear, GELU) that
//! works on any tensor whose last dim is C, so it runs unchanged on a dense `[B, N, C]` batch
//! or on a packed `[total, C]` tensor of ragged (token-pruned) sequences. Only attention needs
//! to know how tokens are grouped into images; that knowledge lives in [`AttentionInputs`] and
//! in the three functions here: [`split_heads`] (fused qkv → per-head q, k, v), [`attend`]
//! (softmax(q kᵀ · scale) v) and [`merge_heads`] (back to per-token rows).
//!
//! Today the only layout is [`AttentionInputs::Dense`]. The padded-with-mask and packed-ragged
//! layouts are added as new variants handled by the same three functions; block and model code
//! do not change.

use candle_core::{DType, Result, Tensor};

/// How the tokens passed to a block are laid out, i.e. which tokens may attend to which.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub enum AttentionInputs {
    /// `[B, N, C]`: every image has the same N tokens and every token attends to all N.
    #[default]
    Dense,
}

/// Splits the fused qkv projection `[B, N, 3C]` (timm layout: q | k | v, each head-major) into
/// q, k, v of shape `[B, heads, N, head_dim]`, contiguous.
pub fn split_heads(
    qkv: &Tensor,
    heads: usize,
    inputs: &AttentionInputs,
) -> Result<(Tensor, Tensor, Tensor)> {
    match inputs {
        AttentionInputs::Dense => {
            let (b, n, c3) = qkv.dims3()?;
            let head_dim = c3 / 3 / heads;
            // [B, N, 3, H, D] -> [3, B, H, N, D]
            let qkv = qkv
                .reshape((b, n, 3, heads, head_dim))?
                .permute((2, 0, 3, 1, 4))?;
            let q = qkv.get(0)?.contiguous()?;
            let k = qkv.get(1)?.contiguous()?;
            let v = qkv.get(2)?.contiguous()?;
            Ok((q, k, v))
        }
    }
}

/// softmax(q kᵀ · scale) v for the given layout. Dense: q, k, v `[B, H, N, D]` → `[B, H, N, D]`.
///
/// The softmax runs in f32 when the inputs are f16/bf16: the row sums over N keys lose
/// precision in half types, and it is a small fraction of the cost.
pub fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    inputs: &AttentionInputs,
) -> Result<Tensor> {
    match inputs {
        AttentionInputs::Dense => {
            // Scaling q (N·D values) is cheaper than scaling the scores (N·N values); timm does
            // the same.
            let q = (q * scale)?;
            let scores = q.matmul(&k.t()?)?;
            let probs = softmax_last_dim_f32(&scores)?;
            probs.matmul(v)
        }
    }
}

/// Inverse of [`split_heads`] for the attention output: `[B, H, N, D]` → `[B, N, H·D]`.
pub fn merge_heads(out: &Tensor, inputs: &AttentionInputs) -> Result<Tensor> {
    match inputs {
        AttentionInputs::Dense => {
            let (b, h, n, d) = out.dims4()?;
            out.transpose(1, 2)?.reshape((b, n, h * d))
        }
    }
}

/// Softmax over the last dim, computed in f32 for half-precision inputs and cast back.
pub fn softmax_last_dim_f32(xs: &Tensor) -> Result<Tensor> {
    match xs.dtype() {
        DType::F16 | DType::BF16 => {
            let probs = candle_nn::ops::softmax_last_dim(&xs.to_dtype(DType::F32)?)?;
            probs.to_dtype(xs.dtype())
        }
        _ => candle_nn::ops::softmax_last_dim(xs),
    }
}

/// Numerically-plain softmax (exp / sum) used by tests to cross-check the fused kernel.
#[cfg(test)]
fn softmax_plain(xs: &Tensor) -> Result<Tensor> {
    use candle_core::D;
    let max = xs.max_keepdim(D::Minus1)?;
    let e = xs.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn dense_attention_matches_plain_formula() -> Result<()> {
        let dev = Device::Cpu;
        let (b, h, n, d) = (2, 3, 5, 4);
        let q = Tensor::randn(0f32, 1., (b, h, n, d), &dev)?;
        let k = Tensor::randn(0f32, 1., (b, h, n, d), &dev)?;
        let v = Tensor::randn(0f32, 1., (b, h, n, d), &dev)?;
        let scale = 0.5;
        let got = attend(&q, &k, &v, scale, &AttentionInputs::Dense)?;
        let want = softmax_plain(&(q.matmul(&k.t()?)? * scale)?)?.matmul(&v)?;
        let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "diff {diff}");
        Ok(())
    }

    #[test]
    fn split_merge_round_trip() -> Result<()> {
        let dev = Device::Cpu;
        let (b, n, heads, hd) = (2, 7, 3, 4);
        let c = heads * hd;
        let qkv = Tensor::randn(0f32, 1., (b, n, 3 * c), &dev)?;
        let (q, k, v) = split_heads(&qkv, heads, &AttentionInputs::Dense)?;
        assert_eq!(q.dims(), &[b, heads, n, hd]);
        // q is the first C columns, head-major.
        let q_back = merge_heads(&q, &AttentionInputs::Dense)?;
        let diff = (q_back - qkv.narrow(2, 0, c)?)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert_eq!(diff, 0.0);
        let v_back = merge_heads(&v, &AttentionInputs::Dense)?;
        let diff = (v_back - qkv.narrow(2, 2 * c, c)?)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert_eq!(diff, 0.0);
        assert_eq!(k.dims(), q.dims());
        Ok(())
    }

    #[test]
    fn half_precision_softmax_runs_in_f32() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 3., (4, 9), &dev)?;
        let want = softmax_plain(&x)?;
        let got = softmax_last_dim_f32(&x.to_dtype(DType::BF16)?)?;
        assert_eq!(got.dtype(), DType::BF16);
        let diff = (got.to_dtype(DType::F32)? - want)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert!(diff < 1e-2, "diff {diff}");
        Ok(())
    }
}
