//! The packed (ragged) pruned forward with every keep decision made on the device.
//!
//! [`DeiT::forward_pruned`] decides on the host: one read-back per pruning step, which drains
//! the GPU queue and leaves it idle while the host decides and launches again, and which no CUDA
//! graph can contain. For the fixed-ratio pruners ([`pruners::TokenPruner::fixed_count`]) the
//! counts are known before any score exists, so nothing needs the host: the top-k, the gather of
//! kept rows and EViT's fused token are one [`candle_ragged::select_top_k_by`] kernel, which also
//! computes the scores when they follow a [`pruners::ScoreRecipe`] (Threshold-L2's norms, EViT's
//! class attention; DynamicViT's predictor still runs as tensor ops). Every shape is known on the
//! host, and the whole call can be captured once and replayed
//! ([`candle_fastpath::CapturedForward`]).
//!
//! Every image keeps the same number of tokens here, so the packed `[B·L, C]` tokens are also
//! the image-shaped `[B, L, C]` ones (a free reshape): no unpack, no padding mask.
//!
//! Same decisions as the host path, ties and NaN scores included (both use f32's total order,
//! NaN lowest, ties to the lower position), given bit-identical scores.

use candle_core::{DType, Module, Tensor};
use candle_ragged::{select_top_k_by, DroppedFusion, RaggedBatch, TokenScores};
use pruners::{EvitFusion, FixedCount, PruneInput, PruneSite, ScoreRecipe};

use crate::attention::{cls_attention, AttentionInputs};
use crate::deit::DeiT;
use crate::error::ModelError;
use crate::pruned::BlockPruner;

/// One fixed-count pruning step on packed tokens `x` `[B·len, C]` of `b` images, scored by
/// `scores`: the new packed tokens `[B·len', C]` (prefix, kept patches in ascending position,
/// then EViT's fused token) and `len'`, as one [`candle_ragged::select_top_k_by`] (one kernel on
/// CUDA, scores included when they are computed inside it).
fn apply_fixed(
    x: &Tensor,
    b: usize,
    scores: TokenScores<'_>,
    num_prefix: usize,
    count: FixedCount,
) -> candle_core::Result<(Tensor, usize)> {
    let fusion = match count.fused {
        Some(EvitFusion::WeightedMean) => Some(DroppedFusion::WeightedMean),
        Some(EvitFusion::ReferenceSum) => Some(DroppedFusion::WeightedSum),
        Some(EvitFusion::Off) | None => None,
    };
    let patches = x.dim(0)? / b - num_prefix;
    let keep = count.keep.clamp(1, patches);
    Ok(select_top_k_by(x, b, scores, num_prefix, keep, fusion)?)
}

impl DeiT {
    /// Logits `[B, num_classes]` of `pixels` with fixed-count `pruners` (see
    /// [`pruners::TokenPruner::fixed_count`]) on the packed path, every keep decision made on the device:
    /// no host sync anywhere, so the call can be captured into a CUDA graph. Same tokens kept and
    /// same logits as [`DeiT::forward_pruned`] on [`crate::ExecutionPath::Ragged`] (the same
    /// selection rule, ties included); an error, before any work, for pruners that count on the host (adaptive modes,
    /// ATS).
    pub fn forward_pruned_on_device(
        &self,
        pixels: &Tensor,
        pruners: &[BlockPruner],
    ) -> Result<Tensor, ModelError> {
        self.check_pruner_blocks(pruners)?;
        let num_prefix = self.config.num_prefix_tokens();
        // Every step's count (and what it needs), checked before anything runs.
        let mut len = self.config.seq_len();
        let mut counts = Vec::with_capacity(pruners.len());
        let mut order: Vec<&BlockPruner> = pruners.iter().collect();
        order.sort_by_key(|(block, _)| *block);
        for (_, pruner) in &order {
            let count = pruner.fixed_count(len - num_prefix).ok_or_else(|| {
                ModelError::InvalidPruning(format!(
                    "{} ({}) counts its tokens from the scores, on the host; device-side \
                     decisions need fixed-ratio pruners (use forward_pruned)",
                    pruner.kind(),
                    pruner.mode()
                ))
            })?;
            if pruner.needs().values {
                return Err(ModelError::InvalidPruning(format!(
                    "{}: value norms are not provided on the device path",
                    pruner.kind()
                )));
            }
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
            // Scores the selection kernel computes itself (Threshold-L2's norms, EViT's class
            // attention) are not materialised: the whole step is one launch.
            let (next, next_len) = match (pruner.site(), pruner.score_recipe()) {
                (PruneSite::BeforeBlock, ScoreRecipe::TokenL2Norm) => {
                    apply_fixed(&x, b, TokenScores::RowL2Norm, num_prefix, *count)?
                }
                (PruneSite::BeforeBlock, _) => {
                    let image = x.reshape((b, len, c))?;
                    let input = PruneInput::new(&image, num_prefix).with_lengths(&lengths);
                    let scores = pruner.scores(&input)?.to_dtype(DType::F32)?;
                    apply_fixed(&x, b, TokenScores::Given(&scores), num_prefix, *count)?
                }
                (PruneSite::AfterAttention, recipe) => {
                    let (h, qkv) = block.attn_residual_with_qkv(&x, &inputs)?;
                    if recipe == ScoreRecipe::ClsAttentionMean {
                        let scores = TokenScores::ClsAttention {
                            qkv: &qkv,
                            heads: block.attn.heads,
                            scale: block.attn.scale as f32,
                        };
                        apply_fixed(&h, b, scores, num_prefix, *count)?
                    } else {
                        let qkv = qkv.reshape((b, len, 3 * c))?;
                        let q_cls = qkv.narrow(1, 0, 1)?.squeeze(1)?.narrow(1, 0, c)?;
                        let k = qkv.narrow(2, c, c)?;
                        let attn =
                            cls_attention(&q_cls, &k, block.attn.heads, block.attn.scale, None)?;
                        let image = h.reshape((b, len, c))?;
                        let input = PruneInput::new(&image, num_prefix)
                            .with_lengths(&lengths)
                            .with_cls_attn(&attn);
                        let scores = pruner.scores(&input)?.to_dtype(DType::F32)?;
                        apply_fixed(&h, b, TokenScores::Given(&scores), num_prefix, *count)?
                    }
                }
            };
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
