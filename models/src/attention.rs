//! The one attention seam of the model.
//!
//! Everything in a block except attention is a per-token op (LayerNorm, Linear, GELU) that
//! works on any tensor whose last dim is C, so it runs unchanged on a dense `[B, N, C]` batch,
//! on a padded `[B, L, C]` batch or on a packed `[total, C]` tensor of ragged (token-pruned)
//! sequences. Only attention needs to know how tokens are grouped into images; that knowledge
//! lives in [`AttentionInputs`] and in the three functions here: [`split_heads`] (fused qkv →
//! per-head q, k, v), [`attend`] (softmax(q kᵀ · scale) v) and [`merge_heads`] (back to
//! per-token rows). Block and model code do not depend on the layout.

use candle_core::{DType, Device, IndexOp, Result, Tensor};
use candle_ragged::{ragged_attention, RaggedBatch};

/// How the tokens passed to a block are laid out, i.e. which tokens may attend to which.
#[derive(Debug, Clone, Copy, Default)]
#[non_exhaustive]
pub enum AttentionInputs<'a> {
    /// `[B, N, C]`: every image has the same N tokens and every token attends to all N.
    #[default]
    Dense,
    /// `[B, L, C]`, image `b` owning its leading `lengths[b]` rows: keys past an image's length
    /// get `-inf` before the softmax. Padding query rows produce finite values nobody reads.
    Padded { mask: &'a KeyPaddingMask },
    /// `[total, C]` packed: image `b` owns rows `cu_seqlens[b]..cu_seqlens[b+1]`; attention runs
    /// in one [`candle_ragged::ragged_attention`] launch on strided views of the fused qkv.
    Ragged { batch: &'a RaggedBatch },
}

/// Per-image valid lengths of a padded batch and the additive key mask built from them.
#[derive(Debug, Clone)]
pub struct KeyPaddingMask {
    lengths: Vec<usize>,
    max_len: usize,
    /// `[B, 1, 1, L]` f32: 0 for real keys, `-inf` for padding.
    bias: Tensor,
}

impl KeyPaddingMask {
    /// The mask for images of `lengths` padded to `max_len` tokens (built on the host and
    /// uploaded: no device sync). Every length must be in `1..=max_len`.
    pub fn new(lengths: &[usize], max_len: usize, device: &Device) -> Result<Self> {
        if lengths.is_empty() || lengths.iter().any(|&l| l == 0 || l > max_len) {
            candle_core::bail!("key padding mask: lengths {lengths:?} must be in 1..={max_len}");
        }
        let mut bias = vec![0f32; lengths.len() * max_len];
        for (row, &len) in bias.chunks_mut(max_len).zip(lengths) {
            row[len..].fill(f32::NEG_INFINITY);
        }
        let bias = Tensor::from_vec(bias, (lengths.len(), 1, 1, max_len), device)?;
        Ok(Self {
            lengths: lengths.to_vec(),
            max_len,
            bias,
        })
    }

    pub fn lengths(&self) -> &[usize] {
        &self.lengths
    }

    /// The padded length L.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// `[B, 1, 1, L]` f32 additive bias (0 / `-inf`).
    pub fn bias(&self) -> &Tensor {
        &self.bias
    }

    /// Whether no image is padded (then the plain dense attention is the same computation).
    pub fn is_full(&self) -> bool {
        self.lengths.iter().all(|&l| l == self.max_len)
    }

    /// `[B, L, 1]` tensor in `dtype`: 1 on real rows, 0 on padding rows.
    pub fn row_mask(&self, dtype: DType) -> Result<Tensor> {
        let (b, l) = (self.lengths.len(), self.max_len);
        let mut m = vec![0f32; b * l];
        for (row, &len) in m.chunks_mut(l).zip(&self.lengths) {
            row[..len].fill(1.0);
        }
        Tensor::from_vec(m, (b, l, 1), self.bias.device())?.to_dtype(dtype)
    }
}

/// Splits the fused qkv projection (timm layout: q | k | v, each head-major) into q, k, v.
/// Dense / padded: `[B, N, 3C]` → three `[B, heads, N, head_dim]`, contiguous.
/// Ragged: `[total, 3C]` → three `[total, heads, head_dim]` strided views (no copies).
pub fn split_heads(
    qkv: &Tensor,
    heads: usize,
    inputs: &AttentionInputs,
) -> Result<(Tensor, Tensor, Tensor)> {
    match inputs {
        AttentionInputs::Dense | AttentionInputs::Padded { .. } => {
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
        AttentionInputs::Ragged { .. } => {
            let (total, c3) = qkv.dims2()?;
            let head_dim = c3 / 3 / heads;
            let qkv = qkv.reshape((total, 3, heads, head_dim))?;
            Ok((qkv.i((.., 0))?, qkv.i((.., 1))?, qkv.i((.., 2))?))
        }
    }
}

/// softmax(q kᵀ · scale) v for the given layout. Dense / padded: q, k, v `[B, H, N, D]` →
/// `[B, H, N, D]`; ragged: `[total, H, D]` → `[total, H, D]`.
///
/// The softmax runs in f32 when the inputs are f16/bf16: the row sums over N keys lose
/// precision in half types, and it is a small fraction of the cost. The ragged kernel
/// accumulates everything in f32.
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
        AttentionInputs::Padded { mask } => {
            let q = (q * scale)?;
            let scores = q.matmul(&k.t()?)?;
            let probs = masked_softmax_f32(&scores, mask)?;
            probs.matmul(v)
        }
        AttentionInputs::Ragged { batch } => Ok(ragged_attention(q, k, v, batch, scale as f32)?),
    }
}

/// Inverse of [`split_heads`] for the attention output: `[B, H, N, D]` → `[B, N, H·D]`
/// (dense / padded), `[total, H, D]` → `[total, H·D]` (ragged, free: the kernel's output is
/// contiguous).
pub fn merge_heads(out: &Tensor, inputs: &AttentionInputs) -> Result<Tensor> {
    match inputs {
        AttentionInputs::Dense | AttentionInputs::Padded { .. } => {
            let (b, h, n, d) = out.dims4()?;
            out.transpose(1, 2)?.reshape((b, n, h * d))
        }
        AttentionInputs::Ragged { .. } => {
            let (t, h, d) = out.dims3()?;
            out.reshape((t, h * d))
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

/// Softmax over the keys of scores `[B, H, Lq, L]` with the padding keys masked out (`-inf`),
/// in f32, cast back to the scores' dtype. Every image has at least one real key, so every row
/// is finite.
pub fn masked_softmax_f32(scores: &Tensor, mask: &KeyPaddingMask) -> Result<Tensor> {
    let s = scores.to_dtype(DType::F32)?.broadcast_add(mask.bias())?;
    candle_nn::ops::softmax_last_dim(&s)?.to_dtype(scores.dtype())
}

/// Softmax attention of the class token's query over the keys of its image, per head:
/// `softmax_j(q_cls · k_j · scale)` → `[B, H, L]` f32 (0 at padding keys when `mask` is given).
///
/// * `q_cls` - `[B, C]`, the class token's query (any strides).
/// * `k` - `[B, L, C]` keys in image layout (padded / unpacked; any strides).
///
/// This is the input EViT and ATS need; no attention kernel outputs probabilities, and
/// recomputing one row per image is cheap. Scores in the model dtype, softmax in f32, as
/// [`attend`] does.
pub fn cls_attention(
    q_cls: &Tensor,
    k: &Tensor,
    heads: usize,
    scale: f64,
    mask: Option<&KeyPaddingMask>,
) -> Result<Tensor> {
    let (b, l, c) = k.dims3()?;
    let d = c / heads;
    let q = (q_cls.reshape((b, heads, 1, d))? * scale)?;
    let k = k.reshape((b, l, heads, d))?.transpose(1, 2)?.contiguous()?;
    let scores = q.matmul(&k.t()?)?.to_dtype(DType::F32)?;
    let scores = match mask {
        Some(m) => scores.broadcast_add(m.bias())?,
        None => scores,
    };
    candle_nn::ops::softmax_last_dim(&scores)?.squeeze(2)
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

    /// Image `b` of a padded batch attends exactly as the dense attention on its own leading
    /// `lengths[b]` tokens; the ragged layout gives the same rows, and the class-token row of the
    /// probabilities matches [`cls_attention`] (zeros at padding keys).
    #[test]
    fn padded_and_ragged_match_per_image_dense() -> Result<()> {
        let dev = Device::Cpu;
        let (heads, d, lengths, l) = (2, 32, [3usize, 5, 1], 5);
        let c = heads * d;
        let qkv = Tensor::randn(0f32, 1., (3, l, 3 * c), &dev)?;
        let mask = KeyPaddingMask::new(&lengths, l, &dev)?;
        let padded = AttentionInputs::Padded { mask: &mask };
        let (q, k, v) = split_heads(&qkv, heads, &padded)?;
        let out = merge_heads(&attend(&q, &k, &v, 0.3, &padded)?, &padded)?;
        let batch = RaggedBatch::from_lengths(&lengths, &dev).map_err(candle_core::Error::from)?;
        let ragged = AttentionInputs::Ragged { batch: &batch };
        let packed = candle_ragged::pack(&qkv, &batch)?;
        let (rq, rk, rv) = split_heads(&packed, heads, &ragged)?;
        let rout = merge_heads(&attend(&rq, &rk, &rv, 0.3, &ragged)?, &ragged)?;
        let k_img = qkv.narrow(2, c, c)?;
        let q_cls = qkv.narrow(1, 0, 1)?.squeeze(1)?.narrow(1, 0, c)?;
        let cls = cls_attention(&q_cls, &k_img, heads, 0.3, Some(&mask))?;
        let mut start = 0;
        for (b, &len) in lengths.iter().enumerate() {
            let own = qkv.narrow(0, b, 1)?.narrow(1, 0, len)?.contiguous()?;
            let (q1, k1, v1) = split_heads(&own, heads, &AttentionInputs::Dense)?;
            let want = merge_heads(
                &attend(&q1, &k1, &v1, 0.3, &AttentionInputs::Dense)?,
                &AttentionInputs::Dense,
            )?;
            let got = out.narrow(0, b, 1)?.narrow(1, 0, len)?;
            let diff = (got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < 1e-5, "padded image {b}: {diff}");
            let got = rout.narrow(0, start, len)?.unsqueeze(0)?;
            let diff = (got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < 1e-5, "ragged image {b}: {diff}");
            start += len;
            // Class row: softmax(q0 · kᵀ · scale) over the image's own keys, per head.
            let q0 = (q1.narrow(2, 0, 1)? * 0.3)?;
            let probs = softmax_plain(&q0.matmul(&k1.t()?)?)?
                .squeeze(2)?
                .squeeze(0)?;
            let got = cls.get(b)?;
            let diff = (got.narrow(1, 0, len)? - probs)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            assert!(diff < 1e-6, "cls row image {b}: {diff}");
            if len < l {
                let pad = got
                    .narrow(1, len, l - len)?
                    .abs()?
                    .max_all()?
                    .to_scalar::<f32>()?;
                assert_eq!(pad, 0.0);
            }
        }
        assert!(out
            .flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .all(|x| x.is_finite()));
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
