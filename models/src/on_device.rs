//! The packed (ragged) pruned forward with every keep decision made on the device.
//!
//! [`DeiT::forward_pruned`] decides on the host: one read-back per pruning step, which drains
//! the GPU queue and leaves it idle while the host decides and launches again, and which no CUDA
//! graph can contain. For the fixed-ratio pruners ([`pruners::TokenPruner::fixed_count`]) the counts are
//! known before any score exists, so nothing needs the host: scores, top-k (a sort on the
//! device), the gather of kept rows and EViT's fused token are all tensor ops, every shape is
//! known on the host, and the whole call can be captured once and replayed
//! ([`candle_fastpath::CapturedForward`]).
//!
//! Every image keeps the same number of tokens here, so the packed `[B·L, C]` tokens are also
//! the image-shaped `[B, L, C]` ones (a free reshape): no unpack, no padding mask.
//!
//! Same decisions as the host path except for exactly tied scores (the device sort orders ties
//! arbitrarily, the host breaks them to the lower position) and NaN scores (unranked here).

use candle_core::{DType, Device, Module, Tensor};
use candle_ragged::RaggedBatch;
use pruners::{EvitFusion, FixedCount, PruneInput, PruneSite};

use crate::attention::{cls_attention, AttentionInputs};
use crate::deit::DeiT;
use crate::error::ModelError;
use crate::pruned::BlockPruner;

/// Rows `b·len + offset + pos[b, j]` of a packed `[B·len, C]` tensor, as `[B·m, C]`
/// (`pos` `[B, m]` u32).
fn gather_rows(x: &Tensor, pos: &Tensor, len: usize, offset: usize) -> candle_core::Result<Tensor> {
    let (b, _) = pos.dims2()?;
    let base = row_bases(b, len, offset, x.device())?;
    let rows = pos.broadcast_add(&base)?.flatten_all()?;
    x.index_select(&rows, 0)
}

/// `[B, 1]` u32: `b·len + offset`.
fn row_bases(b: usize, len: usize, offset: usize, dev: &Device) -> candle_core::Result<Tensor> {
    let (start, step) = (offset as u32, len as u32);
    Tensor::arange_step(start, start + step * b as u32, step, dev)?.reshape((b, 1))
}

/// One fixed-count pruning step on packed tokens `x` `[B·len, C]` with per-token `scores`
/// `[B, len]` f32: the new packed tokens `[B·len', C]` (prefix, kept patches in ascending
/// position, then EViT's fused token) and `len'`.
fn apply_fixed(
    x: &Tensor,
    scores: &Tensor,
    len: usize,
    num_prefix: usize,
    count: FixedCount,
) -> candle_core::Result<(Tensor, usize)> {
    let (b, c) = (scores.dim(0)?, x.dim(1)?);
    let dev = x.device();
    let patches = len - num_prefix;
    let patch_scores = scores.narrow(1, num_prefix, patches)?.contiguous()?;
    let order = patch_scores.arg_sort_last_dim(false)?; // descending, [B, patches]
    let keep = count.keep.clamp(1, patches);
    let kept = order
        .narrow(1, 0, keep)?
        .contiguous()?
        .sort_last_dim(true)?
        .0;
    let prefix = Tensor::arange(0u32, num_prefix as u32, dev)?
        .reshape((1, num_prefix))?
        .broadcast_as((b, num_prefix))?
        .contiguous()?;
    let prefix_rows = gather_rows(x, &prefix, len, 0)?;
    let kept_rows = gather_rows(x, &kept, len, num_prefix)?;
    let kept_tokens = Tensor::cat(
        &[
            prefix_rows.reshape((b, num_prefix, c))?,
            kept_rows.reshape((b, keep, c))?,
        ],
        1,
    )?;
    let dropped = patches - keep;
    let fusion = count.fused.filter(|_| dropped > 0);
    let Some(fusion) = fusion else {
        let new_len = num_prefix + keep;
        return Ok((kept_tokens.reshape((b * new_len, c))?, new_len));
    };
    // EViT's extra token: the dropped tokens weighted by their (non-negative) scores; the
    // weighted mean falls back to the plain mean when every weight is 0 (as the host path does).
    let dropped_idx = order.narrow(1, keep, dropped)?.contiguous()?;
    let w = patch_scores.gather(&dropped_idx, 1)?.relu()?; // [B, dropped]
    let w = match fusion {
        EvitFusion::ReferenceSum => w,
        EvitFusion::WeightedMean | EvitFusion::Off => {
            let sum = w.sum_keepdim(1)?;
            let all_zero = sum.eq(0.0)?.to_dtype(DType::F32)?;
            w.broadcast_div(&(sum + &all_zero)?)?
                .broadcast_add(&(all_zero / dropped as f64)?)?
        }
    };
    let dropped_tokens = gather_rows(x, &dropped_idx, len, num_prefix)?
        .reshape((b, dropped, c))?
        .to_dtype(DType::F32)?;
    let fused = w
        .unsqueeze(1)?
        .contiguous()?
        .matmul(&dropped_tokens)?
        .to_dtype(x.dtype())?; // [B, 1, C]
    let new_len = num_prefix + keep + 1;
    let tokens = Tensor::cat(&[kept_tokens, fused], 1)?;
    Ok((tokens.reshape((b * new_len, c))?, new_len))
}

impl DeiT {
    /// Logits `[B, num_classes]` of `pixels` with fixed-count `pruners` (see
    /// [`pruners::TokenPruner::fixed_count`]) on the packed path, every keep decision made on the device:
    /// no host sync anywhere, so the call can be captured into a CUDA graph. Same tokens kept and
    /// same logits as [`DeiT::forward_pruned`] on [`crate::ExecutionPath::Ragged`] (up to tied
    /// scores); an error, before any work, for pruners that count on the host (adaptive modes,
    /// ATS).
    pub fn forward_pruned_on_device(
        &self,
        pixels: &Tensor,
        pruners: &[BlockPruner],
    ) -> Result<Tensor, ModelError> {
        let depth = self.blocks.len();
        let num_prefix = self.config.num_prefix_tokens();
        // Every step's count, checked before anything runs.
        let mut len = self.config.seq_len();
        let mut counts = Vec::with_capacity(pruners.len());
        let mut order: Vec<&BlockPruner> = pruners.iter().collect();
        order.sort_by_key(|(block, _)| *block);
        for (i, (block, pruner)) in order.iter().enumerate() {
            if *block >= depth || (i > 0 && order[i - 1].0 == *block) {
                return Err(ModelError::InvalidPruning(format!(
                    "pruner at block {block}: the model has {depth} blocks and one pruner per block at most"
                )));
            }
            let count = pruner.fixed_count(len - num_prefix).ok_or_else(|| {
                ModelError::InvalidPruning(format!(
                    "{} ({}) counts its tokens from the scores, on the host; device-side \
                     decisions need fixed-ratio pruners (use forward_pruned)",
                    pruner.kind(),
                    pruner.mode()
                ))
            })?;
            counts.push(count);
            len = num_prefix + count.keep + count.fused.is_some() as usize;
        }

        let x = self.embed(pixels)?;
        let (b, n, c) = x.dims3()?;
        let dev = x.device().clone();
        let mut len = n;
        let mut x = x.reshape((b * n, c))?;
        let mut batch =
            RaggedBatch::from_lengths(&vec![n; b], &dev).map_err(candle_core::Error::from)?;
        let mut steps = order.iter().zip(&counts).peekable();
        for (i, block) in self.blocks.iter().enumerate() {
            let inputs = AttentionInputs::Ragged { batch: &batch };
            let Some(((_, pruner), count)) = steps.next_if(|((blk, _), _)| *blk == i) else {
                x = block.forward_with(&x, &inputs)?;
                continue;
            };
            let lengths = vec![len; b];
            let (scores, h) = match pruner.site() {
                PruneSite::BeforeBlock => {
                    let image = x.reshape((b, len, c))?;
                    let input = PruneInput::new(&image, num_prefix).with_lengths(&lengths);
                    (pruner.scores(&input)?, None)
                }
                PruneSite::AfterAttention => {
                    let (h, qkv) = block.attn_residual_with_qkv(&x, &inputs)?;
                    let qkv = qkv.reshape((b, len, 3 * c))?;
                    let q_cls = qkv.narrow(1, 0, 1)?.squeeze(1)?.narrow(1, 0, c)?;
                    let k = qkv.narrow(2, c, c)?;
                    let attn = cls_attention(&q_cls, &k, block.attn.heads, block.attn.scale, None)?;
                    let image = h.reshape((b, len, c))?;
                    let mut input = PruneInput::new(&image, num_prefix).with_lengths(&lengths);
                    input = input.with_cls_attn(&attn);
                    if pruner.needs().values {
                        return Err(ModelError::InvalidPruning(format!(
                            "{}: value norms are not provided on the device path",
                            pruner.kind()
                        )));
                    }
                    (pruner.scores(&input)?, Some(h))
                }
            };
            let source = h.as_ref().unwrap_or(&x);
            let (next, next_len) = apply_fixed(source, &scores, len, num_prefix, *count)?;
            len = next_len;
            x = next;
            batch =
                RaggedBatch::from_lengths(&vec![len; b], &dev).map_err(candle_core::Error::from)?;
            let inputs = AttentionInputs::Ragged { batch: &batch };
            x = match pruner.site() {
                PruneSite::BeforeBlock => block.forward_with(&x, &inputs)?,
                PruneSite::AfterAttention => block.mlp_residual(&x)?,
            };
        }
        let prefix = x
            .reshape((b, len, c))?
            .narrow(1, 0, num_prefix)?
            .contiguous()?;
        Ok(self.forward_head(&self.norm.forward(&prefix)?)?)
    }
}
