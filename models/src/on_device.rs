//! The packed (ragged) pruned forward with every keep decision made on the device.
//!
//! [`DeiT::forward_pruned`] decides on the host: each step reads the `[B, L]` scores back, decides
//! image by image on the CPU and uploads the gather rows, with the GPU idle meanwhile. Here the
//! decision is a kernel, a pruner's [`pruners::TokenPruner::keep_rule`] applied to its scores on
//! the device, which computes the scores itself when they follow a [`pruners::ScoreRecipe`]
//! (Threshold-L2's norms, EViT's class attention, ATS's significance; DynamicViT's predictor runs
//! first, on the packed tokens: [`pruners::TokenPruner::packed_scores`]):
//!
//! - **Fixed counts** (every pruner has [`pruners::TokenPruner::fixed_count`]: the fixed-ratio
//!   Threshold-L2, DynamicViT and EViT): the top-k, the gather and EViT's fused token are one
//!   [`candle_ragged::select_top_k_by`] kernel per step, and every image keeps the same number of
//!   tokens, so the packed `[B·L, C]` tokens are also the image-shaped `[B, L, C]` ones. Every
//!   shape is known on the host: **no host sync**, and the whole call can be captured once and
//!   replayed ([`candle_fastpath::CapturedForward`]).
//! - **Counts from the scores** (adaptive modes, ATS): each step is a
//!   [`candle_ragged::select_by_rule`]: two kernels and **one host read of B u32** (the new
//!   lengths, to allocate the new packed tensor). Not capturable.
//!
//! [`DeiT::forward_pruned_capturable`] runs the second kind without the reads: each step is a
//! [`candle_ragged::select_by_rule_bounded`], the new lengths and offsets stay on the device and
//! the packed tokens keep a capacity the host bounds from the rule (ATS: its sample count;
//! thresholds and mass shares: every token), so the whole call can be captured and one graph
//! replays every keep pattern. The per-token ops then run over the capacity's rows, which costs
//! nothing extra where a matmul takes as long for 140 rows as for 197 (small batches) and, for the
//! rules that can keep everything, all of pruning's matmul savings at large ones.
//! [`DeiT::forward_to_first_step`] and [`DeiT::forward_from_step`] cut that forward after its
//! first step, so that a caller can read that step's total in between and run the rest over that
//! many rows; [`DeiT::forward_to_next_step`] cuts the same way at the next step
//! ([`crate::StagedGraph`] replays the parts as CUDA graphs).
//!
//! Same decisions as the host path, ties and NaN scores included, given bit-identical scores
//! (the rules are one definition, [`candle_ragged::KeepRule`]).

use candle_core::{DType, Tensor};
use candle_ragged::{
    leading_rows, select_by_rule, select_by_rule_bounded, select_top_k_by, select_top_k_gathering,
    unpack, DroppedFusion, RaggedBatch, StepScoreLayout, StepScores, TokenScores,
};
use pruners::{EvitFusion, FixedCount, PruneInput, PruneSite, ScoreRecipe, TokenPruner};

use crate::attention::{cls_attention, AttentionInputs};
use crate::deit::{Block, DeiT};
use crate::error::ModelError;
use crate::pruned::BlockPruner;

/// What [`DeiT::forward_pruned_on_device`] returns.
#[derive(Debug, Clone)]
pub struct DevicePrunedForward {
    /// `[B, num_classes]` in the model dtype.
    pub logits: Tensor,
    /// Per pruning step (block order), per image: tokens after the step (prefix and fused token
    /// included). Known on the host without a sync: fixed counts are, and the other steps read
    /// their lengths back anyway.
    pub kept_tokens: Vec<Vec<usize>>,
}

impl DevicePrunedForward {
    /// Mean over images of the tokens left after the last pruning step (`initial` when there
    /// is none).
    pub fn mean_final_tokens(&self, initial: usize) -> f64 {
        mean_final_tokens(&self.kept_tokens, initial)
    }
}

/// Mean over images of the last step's kept tokens, `initial` when there is no step.
fn mean_final_tokens(kept_tokens: &[Vec<usize>], initial: usize) -> f64 {
    match kept_tokens.last() {
        None => initial as f64,
        Some(k) => k.iter().sum::<usize>() as f64 / k.len().max(1) as f64,
    }
}

/// What [`DeiT::forward_pruned_capturable`] returns: the logits and, without having read them
/// back, the lengths each pruning step left.
#[derive(Debug, Clone)]
pub struct CapturablePrunedForward {
    /// `[B, num_classes]` in the model dtype.
    pub logits: Tensor,
    kept: KeptLengths,
}

#[derive(Debug, Clone)]
enum KeptLengths {
    /// Fixed counts: known on the host.
    Host(Vec<Vec<usize>>),
    /// Each step's batch, its lengths on the device only.
    Device(Vec<RaggedBatch>),
}

impl CapturablePrunedForward {
    /// Per pruning step (block order), per image: tokens after the step, as
    /// [`DevicePrunedForward::kept_tokens`]. Reads the lengths back (a host sync on CUDA) when the
    /// counts came from the scores.
    pub fn kept_tokens(&self) -> Result<Vec<Vec<usize>>, ModelError> {
        match &self.kept {
            KeptLengths::Host(k) => Ok(k.clone()),
            KeptLengths::Device(batches) => Ok(batches
                .iter()
                .map(|b| b.lengths())
                .collect::<Result<_, _>>()?),
        }
    }

    /// Mean over images of the tokens left after the last pruning step (`initial` when there
    /// is none); reads back like [`Self::kept_tokens`].
    pub fn mean_final_tokens(&self, initial: usize) -> Result<f64, ModelError> {
        Ok(mean_final_tokens(&self.kept_tokens()?, initial))
    }
}

/// How a step whose counts come from the scores learns its new layout.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Lengths {
    /// Read the `B` new lengths back (exact totals, one sync per step).
    ReadBack,
    /// Keep them on the device, the packed tokens at a host-bounded capacity (no sync).
    OnDevice,
}

/// Where [`DeiT::ragged_blocks`] starts.
#[derive(Debug, Clone, Copy)]
enum Resume {
    /// At the start of this block.
    Block(usize),
    /// Inside `block`, its pruning step's selection done (at `site`).
    AfterSelection { block: usize, site: PruneSite },
}

/// A pruned forward stopped right after a pruning step's selection
/// ([`DeiT::forward_to_first_step`], [`DeiT::forward_to_next_step`]): the selected tokens,
/// packed, and their batch, whose lengths live on the device; the packed rows are a capacity
/// (rows past the total hold no token). [`DeiT::forward_from_step`] finishes the forward.
#[derive(Debug, Clone)]
pub struct PrunedTokens {
    tokens: Tensor,
    batch: RaggedBatch,
    block: usize,
    site: PruneSite,
}

impl PrunedTokens {
    /// `[rows, C]`: the selected tokens, packed, then spare rows up to the capacity.
    pub fn tokens(&self) -> &Tensor {
        &self.tokens
    }

    /// The tokens' batch (lengths on the device only).
    pub fn batch(&self) -> &RaggedBatch {
        &self.batch
    }

    /// The block whose pruning step made them.
    pub fn block(&self) -> usize {
        self.block
    }

    /// Reads the step's total (`cu_seqlens[B]`, one u32: a host sync on CUDA) and keeps
    /// `capacity(total)` rows, clamped to at least the total and at most the rows held: the
    /// rest of the forward then runs over those rows. Returns the total as well.
    pub fn fit(&self, capacity: impl FnOnce(usize) -> usize) -> Result<(Self, usize), ModelError> {
        let total = self.batch.read_total()?;
        let rows = capacity(total).clamp(total, self.batch.total_tokens());
        Ok((self.with_rows(rows)?, total))
    }

    /// The first `rows` packed rows (at least the total, which the caller has read) over the
    /// same lengths.
    fn with_rows(&self, rows: usize) -> Result<Self, ModelError> {
        // SAFETY: the `cu_seqlens` is this batch's, written by a selection kernel (valid offsets,
        // no sequence longer than `max_len`), and `rows` is at least its total (`fit` clamps).
        let batch = unsafe {
            RaggedBatch::from_device_cu_seqlens_unchecked(
                self.batch.cu_seqlens().clone(),
                rows,
                self.batch.max_len(),
            )?
        };
        Ok(Self {
            tokens: self.tokens.narrow(0, 0, rows)?,
            batch,
            block: self.block,
            site: self.site,
        })
    }

    /// The same step over other buffers: `tokens` (`[rows, C]`) and `cu_seqlens` (`[B + 1]`,
    /// u32), as a captured graph's input buffers are.
    ///
    /// # Safety
    /// `cu_seqlens` must hold, whenever a kernel reads it, offsets as valid as this step's (from
    /// 0, non-decreasing, no sequence empty or longer than [`RaggedBatch::max_len`]) whose total
    /// is at most `tokens`' rows.
    pub(crate) unsafe fn over(
        &self,
        tokens: Tensor,
        cu_seqlens: Tensor,
    ) -> Result<Self, ModelError> {
        let rows = tokens.dim(0)?;
        let batch =
            RaggedBatch::from_device_cu_seqlens_unchecked(cu_seqlens, rows, self.batch.max_len())?;
        Ok(Self {
            tokens,
            batch,
            block: self.block,
            site: self.site,
        })
    }
}

/// Whether a fixed step before its block gathers that block's qkv rows with the tokens (lever 66;
/// [`DeiT::chainable_next_fixed`]), unless `CANDLE_DEIT_GATHER_QKV=0` (read once; the step's
/// block then computes its own norm1 + qkv, for A/B measurements).
fn gather_qkv_at_steps() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    !crate::env_switch(&OFF, "CANDLE_DEIT_GATHER_QKV", "0")
}

/// Whether the block before a pruning step after the attention computes the step block's qkv
/// with its fc2 (lever 71; [`DeiT::chainable_next_fixed`]), unless
/// `CANDLE_DEIT_CHAIN_AFTER_ATTENTION=0` (read once; the step's block then computes its own
/// norm1 + qkv and runs its attention and projection as two kernels, for A/B measurements).
fn chain_after_attention() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    !crate::env_switch(&OFF, "CANDLE_DEIT_CHAIN_AFTER_ATTENTION", "0")
}

/// The next fixed step's block, site and whether it fuses its dropped tokens, from the peeked
/// item of the steps iterator of `forward_fixed_on_device`.
fn peek_step(step: Option<&(&&BlockPruner, &FixedCount)>) -> Option<(usize, PruneSite, bool)> {
    step.map(|(pruner, count)| (pruner.0, pruner.1.site(), count.fused.is_some()))
}

/// Whether the step after block `i` (`step`, the next one in the schedule) is a Threshold-L2 step
/// right before block `i + 1`, which ranks the L2 norms of block `i`'s output: block `i` then
/// computes them on the way (Block::forward_chained_with_norms, lever 77).
fn next_step_ranks_norms(step: Option<&(&&BlockPruner, &FixedCount)>, i: usize) -> bool {
    step.is_some_and(|((blk, pruner), _)| {
        *blk == i + 1
            && pruner.site() == PruneSite::BeforeBlock
            && pruner.score_recipe() == ScoreRecipe::TokenL2Norm
    })
}

fn fusion_of(f: Option<EvitFusion>) -> Option<DroppedFusion> {
    match f {
        Some(EvitFusion::WeightedMean) => Some(DroppedFusion::WeightedMean),
        Some(EvitFusion::ReferenceSum) => Some(DroppedFusion::WeightedSum),
        Some(EvitFusion::Off) | None => None,
    }
}

/// The scores a step's kernel computes itself, from a recipe (`None`: use the pruner's
/// `scores`). `qkv` is the block's fused projection (after-attention sites only).
fn computed_scores<'a>(
    recipe: ScoreRecipe,
    site: PruneSite,
    qkv: Option<&'a Tensor>,
    heads: usize,
    scale: f32,
) -> Option<TokenScores<'a>> {
    match (recipe, site, qkv) {
        (ScoreRecipe::TokenL2Norm, PruneSite::BeforeBlock, _) => Some(TokenScores::RowL2Norm),
        (ScoreRecipe::ClsAttentionMean, PruneSite::AfterAttention, Some(qkv)) => {
            Some(TokenScores::ClsAttention { qkv, heads, scale })
        }
        (ScoreRecipe::Significance, PruneSite::AfterAttention, Some(qkv)) => {
            Some(TokenScores::Significance { qkv, heads, scale })
        }
        _ => None,
    }
}

impl DeiT {
    /// The block after block `i` when no pruning step sits before it (`next_step`: the block
    /// and site of the next step, if any): the one whose qkv block `i` may compute with its fc2
    /// ([`Block::forward_chained`]), the tokens being the same for both. A step after that
    /// block's attention sees the same tokens (lever 71, unless
    /// `CANDLE_DEIT_CHAIN_AFTER_ATTENTION=0`).
    fn chainable_next(&self, i: usize, next_step: Option<(usize, PruneSite)>) -> Option<&Block> {
        match next_step {
            Some((blk, PruneSite::AfterAttention)) if blk == i + 1 && !chain_after_attention() => {
                None
            }
            Some((blk, PruneSite::BeforeBlock)) if blk == i + 1 => None,
            _ => self.blocks.get(i + 1),
        }
    }

    /// [`Self::chainable_next`] for the fixed-count path, which also chains into a step's block
    /// when the step sits after that block's attention (its qkv is of the same tokens), and when
    /// the step gathers the qkv rows with the tokens (`select_top_k_gathering`): one image (where
    /// the chained kernels run; at larger batches the projection of rows the step drops would be
    /// wasted work), a step before its block, no fused token. `next_step`: the next step's
    /// block, site and whether it fuses.
    fn chainable_next_fixed(
        &self,
        i: usize,
        next_step: Option<(usize, PruneSite, bool)>,
        batch_size: usize,
    ) -> Option<&Block> {
        match next_step {
            Some((blk, PruneSite::BeforeBlock, false))
                if blk == i + 1 && batch_size == 1 && gather_qkv_at_steps() =>
            {
                self.blocks.get(i + 1)
            }
            _ => self.chainable_next(i, next_step.map(|(blk, site, _)| (blk, site))),
        }
    }

    /// Logits `[B, num_classes]` of `pixels` with `pruners` on the packed path, every keep decision
    /// made on the device (see the module docs): with fixed-count pruners no host sync at all (the
    /// call can be captured into a CUDA graph), otherwise one read of `B` lengths per step. Same
    /// tokens kept and same logits as [`DeiT::forward_pruned`] on [`crate::ExecutionPath::Ragged`]
    /// (the same rules, ties included). An error, before any work, for a pruner without a
    /// [`pruners::TokenPruner::keep_rule`] or whose scores the device path cannot form (a custom
    /// score after attention that needs value norms).
    pub fn forward_pruned_on_device(
        &self,
        pixels: &Tensor,
        pruners: &[BlockPruner],
    ) -> Result<DevicePrunedForward, ModelError> {
        crate::cpu_pool::in_cpu_pool(pixels.device(), || {
            let order = self.device_order(pruners)?;
            match self.fixed_counts(&order) {
                Some(counts) => self.forward_fixed_on_device(pixels, &order, &counts),
                None => {
                    let (logits, batches) =
                        self.forward_ragged_on_device(pixels, &order, Lengths::ReadBack)?;
                    let kept_tokens = batches
                        .iter()
                        .map(|b| b.lengths())
                        .collect::<Result<_, _>>()?;
                    Ok(DevicePrunedForward {
                        logits,
                        kept_tokens,
                    })
                }
            }
        })
    }

    /// [`DeiT::forward_pruned_on_device`] with **no host sync for any pruner**, so that the call
    /// can be captured into a CUDA graph ([`candle_fastpath::CapturedForward`]) and replayed for
    /// any input: fixed counts run as there; counts from the scores (adaptive modes, ATS) run
    /// each step as a [`candle_ragged::select_by_rule_bounded`] (see the module docs for the
    /// capacity it keeps). Same kept tokens and logits as [`DeiT::forward_pruned_on_device`]
    /// (the same kernels on the same rows; matmuls over more rows may round differently on CUDA).
    /// The kept lengths are read only when asked for ([`CapturablePrunedForward::kept_tokens`]).
    pub fn forward_pruned_capturable(
        &self,
        pixels: &Tensor,
        pruners: &[BlockPruner],
    ) -> Result<CapturablePrunedForward, ModelError> {
        crate::cpu_pool::in_cpu_pool(pixels.device(), || {
            let order = self.device_order(pruners)?;
            match self.fixed_counts(&order) {
                Some(counts) => {
                    let out = self.forward_fixed_on_device(pixels, &order, &counts)?;
                    Ok(CapturablePrunedForward {
                        logits: out.logits,
                        kept: KeptLengths::Host(out.kept_tokens),
                    })
                }
                None => {
                    let (logits, batches) =
                        self.forward_ragged_on_device(pixels, &order, Lengths::OnDevice)?;
                    Ok(CapturablePrunedForward {
                        logits,
                        kept: KeptLengths::Device(batches),
                    })
                }
            }
        })
    }

    /// The pruners in block order, after checking that the device path can run each of them.
    fn device_order<'a>(
        &self,
        pruners: &'a [BlockPruner],
    ) -> Result<Vec<&'a BlockPruner>, ModelError> {
        self.check_pruner_blocks(pruners)?;
        let mut order: Vec<&BlockPruner> = pruners.iter().collect();
        order.sort_by_key(|(block, _)| *block);
        for (_, pruner) in &order {
            if pruner.keep_rule().is_none() {
                return Err(ModelError::InvalidPruning(format!(
                    "{}: no keep rule to apply on the device (it decides in its own plan); use \
                     forward_pruned",
                    pruner.kind()
                )));
            }
            if pruner.site() == PruneSite::AfterAttention
                && pruner.score_recipe() == ScoreRecipe::Custom
                && pruner.needs().values
            {
                return Err(ModelError::InvalidPruning(format!(
                    "{}: value norms are not provided on the device path",
                    pruner.kind()
                )));
            }
        }
        Ok(order)
    }

    /// Every step's count when every pruner has a fixed one (the lengths then stay equal).
    fn fixed_counts(&self, order: &[&BlockPruner]) -> Option<Vec<FixedCount>> {
        let num_prefix = self.config.num_prefix_tokens();
        let mut len = self.config.seq_len();
        let mut counts = Vec::with_capacity(order.len());
        for (_, pruner) in order {
            let count = pruner.fixed_count(len - num_prefix)?;
            counts.push(count);
            len = num_prefix + count.keep + count.fused.is_some() as usize;
        }
        Some(counts)
    }

    /// Fixed counts: one `select_top_k_by` per step, no host sync.
    fn forward_fixed_on_device(
        &self,
        pixels: &Tensor,
        order: &[&BlockPruner],
        counts: &[FixedCount],
    ) -> Result<DevicePrunedForward, ModelError> {
        let num_prefix = self.config.num_prefix_tokens();
        let (x, qkv0) = self.embed_for(pixels, order)?;
        let (b, n, c) = x.dims3()?;
        let dev = x.device().clone();
        let mut len = n;
        let mut x = x.reshape((b * n, c))?;
        let mut batch = self.uniform_batches.get(b, n, &dev)?;
        let mut kept_tokens = Vec::with_capacity(counts.len());
        let mut steps = order.iter().zip(counts).peekable();
        // The next block's qkv, computed by the block before it (or with the embedding) when no
        // pruning step lies between them (Block::forward_chained).
        let mut next_qkv = qkv0;
        // The L2 norms of x's rows, computed by the block before a Threshold-L2 step on the way
        // (Block::forward_chained_with_norms), which the step then ranks as given scores.
        let mut row_norms: Option<Tensor> = None;
        let last = self.blocks.len().saturating_sub(1);
        let prefix_only = crate::deit::last_block_prefix_only(b);
        for (i, block) in self.blocks.iter().enumerate() {
            let inputs = AttentionInputs::Ragged { batch: &batch };
            let Some(((_, pruner), count)) = steps.next_if(|((blk, _), _)| *blk == i) else {
                if prefix_only && i == last {
                    // The head reads the prefix rows only (Block::forward_prefix).
                    let prefix = block.forward_prefix(&x, next_qkv.take(), &batch, num_prefix)?;
                    return Ok(DevicePrunedForward {
                        logits: self.logits_from_prefix(&prefix)?,
                        kept_tokens,
                    });
                }
                let next = self.chainable_next_fixed(i, peek_step(steps.peek()), b);
                let want_norms = next_step_ranks_norms(steps.peek(), i);
                (x, next_qkv, row_norms) = block.forward_chained_with_norms(
                    &x,
                    next_qkv.take(),
                    next,
                    &inputs,
                    want_norms,
                )?;
                continue;
            };
            let site = pruner.site();
            let patches = len - num_prefix;
            let keep = count.keep.clamp(1, patches);
            let fusion = fusion_of(count.fused);
            let (heads, scale) = (block.attn.heads, block.attn.scale);
            let lengths = vec![len; b];
            // Scores the selection kernel computes itself are not materialised: the whole step
            // is one launch. The block before may have computed this block's qkv
            // (chainable_next_fixed): after the attention it serves the attention, before the
            // block the step gathers its kept rows with the tokens.
            let (chained, qkv_to_gather) = match site {
                PruneSite::AfterAttention => (next_qkv.take(), None),
                PruneSite::BeforeBlock => (None, next_qkv.take()),
            };
            let recipe = pruner.score_recipe();
            // One image, class-attention scores after the attention: the attention kernel
            // computes them beside the attention where it can (lever 88).
            let cls_recipe = matches!(
                recipe,
                ScoreRecipe::ClsAttentionMean | ScoreRecipe::Significance
            );
            let (tokens, qkv, kernel_probs) =
                if site == PruneSite::AfterAttention && b == 1 && cls_recipe {
                    let (t, q, p) =
                        block.attention_residual_with_cls_probs(&x, chained, &inputs)?;
                    (t, Some(q), p)
                } else {
                    let (t, q) = block.tokens_at(site, &x, chained, &inputs)?;
                    (t, q, None)
                };
            let given;
            let computed = computed_scores(recipe, site, qkv.as_ref(), heads, scale as f32);
            let scores = match (computed, row_norms.take()) {
                // The block before computed them: the bits the selection kernel would.
                (Some(TokenScores::RowL2Norm), Some(norms)) => {
                    given = norms.reshape((b, len))?;
                    TokenScores::Given(&given)
                }
                (Some(s), _) => s,
                (None, _) => {
                    given = match pruner.packed_scores(&tokens, &batch, num_prefix)? {
                        // Equal lengths: the packed `[B·len]` scores are the `[B, len]` ones.
                        Some(packed) => packed.reshape((b, len))?,
                        None => {
                            let image = tokens.reshape((b, len, c))?;
                            let attn;
                            let mut input =
                                PruneInput::new(&image, num_prefix).with_lengths(&lengths);
                            if let Some(qkv) = &qkv {
                                let qkv = qkv.reshape((b, len, 3 * c))?;
                                let q_cls = qkv.narrow(1, 0, 1)?.squeeze(1)?.narrow(1, 0, c)?;
                                let k = qkv.narrow(2, c, c)?;
                                attn = cls_attention(&q_cls, &k, heads, scale, None)?;
                                input = input.with_cls_attn(&attn);
                            }
                            pruner.scores(&input)?.to_dtype(DType::F32)?
                        }
                    };
                    TokenScores::Given(&given)
                }
            };
            // After the attention, one image: the selection at the head of the MLP half's
            // kernel where that applies (Block::select_then_mlp_chained, lever 87).
            if site == PruneSite::AfterAttention && b == 1 {
                let out_len = num_prefix + keep + (fusion.is_some() && keep < patches) as usize;
                let after = self.uniform_batches.get(b, out_len, &dev)?;
                let next = self.chainable_next_fixed(i, peek_step(steps.peek()), b);
                let inputs = AttentionInputs::Ragged { batch: &after };
                let layout = match recipe {
                    ScoreRecipe::Significance => StepScoreLayout::HeadProbsTimesValueNorm,
                    _ => StepScoreLayout::HeadProbs,
                };
                let kernel_scores = kernel_probs
                    .map(|p| StepScores::from_parts(p, layout, heads))
                    .transpose()?;
                if let Some((x2, qkv2)) = block.select_then_mlp_chained(
                    &tokens,
                    scores,
                    kernel_scores,
                    num_prefix,
                    keep,
                    fusion,
                    next,
                    &inputs,
                )? {
                    len = out_len;
                    x = x2;
                    kept_tokens.push(vec![len; b]);
                    batch = after;
                    next_qkv = Some(qkv2);
                    continue;
                }
            }
            // Before the block, one image, no fused row: the selection at the head of the
            // block's kernel where that applies (Block::select_then_block_chained, lever 90).
            if let (PruneSite::BeforeBlock, 1, None, Some(qkv)) = (site, b, fusion, &qkv_to_gather)
            {
                let out_len = num_prefix + keep;
                let after = self.uniform_batches.get(b, out_len, &dev)?;
                let next = self.chainable_next_fixed(i, peek_step(steps.peek()), b);
                let want_norms = next_step_ranks_norms(steps.peek(), i);
                if let Some((x2, qkv2, norms)) = block.select_then_block_chained(
                    &tokens,
                    qkv,
                    scores,
                    num_prefix,
                    keep,
                    next,
                    &AttentionInputs::Ragged { batch: &after },
                    want_norms,
                )? {
                    len = out_len;
                    x = x2;
                    kept_tokens.push(vec![len; b]);
                    batch = after;
                    next_qkv = qkv2;
                    row_norms = norms;
                    continue;
                }
            }
            let (next, kept_qkv, next_len) = match qkv_to_gather {
                Some(qkv) if fusion.is_none() => {
                    let (next, kept_qkv, next_len) =
                        select_top_k_gathering(&tokens, &qkv, b, scores, num_prefix, keep)?;
                    (next, Some(kept_qkv), next_len)
                }
                _ => {
                    let (next, next_len) =
                        select_top_k_by(&tokens, b, scores, num_prefix, keep, fusion)?;
                    (next, None, next_len)
                }
            };
            len = next_len;
            x = next;
            kept_tokens.push(vec![len; b]);
            batch = self.uniform_batches.get(b, len, &dev)?;
            let inputs = AttentionInputs::Ragged { batch: &batch };
            let next = self.chainable_next_fixed(i, peek_step(steps.peek()), b);
            (x, next_qkv) = block.rest_after_chained(site, &x, kept_qkv, next, &inputs)?;
        }
        Ok(DevicePrunedForward {
            logits: self.logits_from_blocks(&x.reshape((b, len, c))?)?,
            kept_tokens,
        })
    }

    /// Counts from the scores: one `select_by_rule` per step (one read of the new lengths), or
    /// with `Lengths::OnDevice` one `select_by_rule_bounded` (none). Returns the logits and the
    /// batch after each step.
    fn forward_ragged_on_device(
        &self,
        pixels: &Tensor,
        order: &[&BlockPruner],
        lengths_mode: Lengths,
    ) -> Result<(Tensor, Vec<RaggedBatch>), ModelError> {
        let (x, qkv0) = self.embed_for(pixels, order)?;
        let (x, batch) = self.packed(x)?;
        self.ragged_blocks(x, batch, Resume::Block(0), order, lengths_mode, qkv0)
    }

    /// The embedded tokens `[B, N, C]`, with block 0's qkv of them when the embedding computes it
    /// ([`DeiT::embed_into_first_block`]) and no step of `order` sits at block 0 (whose step
    /// would compute its own).
    fn embed_for(
        &self,
        pixels: &Tensor,
        order: &[&BlockPruner],
    ) -> Result<(Tensor, Option<Tensor>), ModelError> {
        if order.first().is_some_and(|(blk, _)| *blk == 0) {
            return Ok((self.embed(pixels)?, None));
        }
        Ok(self.embed_into_first_block(pixels)?)
    }

    /// Embedded tokens `[B, N, C]` packed, `[B·N, C]`, and their batch (every image N tokens).
    fn packed(&self, x: Tensor) -> Result<(Tensor, RaggedBatch), ModelError> {
        let (b, n, c) = x.dims3()?;
        let x = x.reshape((b * n, c))?;
        let batch = self.uniform_batches.get(b, n, x.device())?;
        Ok((x, batch))
    }

    /// Blocks from `resume` on over packed tokens, each pruning step of `order` past it a
    /// selection by rule, then the head: the logits and each step's batch.
    fn ragged_blocks(
        &self,
        mut x: Tensor,
        mut batch: RaggedBatch,
        resume: Resume,
        order: &[&BlockPruner],
        lengths_mode: Lengths,
        first_qkv: Option<Tensor>,
    ) -> Result<(Tensor, Vec<RaggedBatch>), ModelError> {
        let num_prefix = self.config.num_prefix_tokens();
        let first = match resume {
            Resume::Block(i) => i,
            Resume::AfterSelection { block, site } => {
                let inputs = AttentionInputs::Ragged { batch: &batch };
                x = self.blocks[block].rest_after(site, &x, &inputs)?;
                block + 1
            }
        };
        let mut batches = Vec::with_capacity(order.len());
        let mut steps = order.iter().filter(|(blk, _)| *blk >= first).peekable();
        // The next block's qkv, computed by the block before it when no pruning step lies
        // between them (Block::forward_chained); `first_qkv`: the first block's, from the
        // embedding.
        let mut next_qkv = first_qkv;
        let last = self.blocks.len().saturating_sub(1);
        let prefix_only = crate::deit::last_block_prefix_only(batch.batch_size());
        for (i, block) in self.blocks.iter().enumerate().skip(first) {
            let inputs = AttentionInputs::Ragged { batch: &batch };
            let Some((_, pruner)) = steps.next_if(|(blk, _)| *blk == i) else {
                if prefix_only && i == last {
                    // The head reads the prefix rows only (Block::forward_prefix).
                    let prefix = block.forward_prefix(&x, next_qkv.take(), &batch, num_prefix)?;
                    return Ok((self.logits_from_prefix(&prefix)?, batches));
                }
                let next = self.chainable_next(i, steps.peek().map(|(blk, p)| (*blk, p.site())));
                (x, next_qkv) = block.forward_chained(&x, next_qkv.take(), next, &inputs)?;
                continue;
            };
            let site = pruner.site();
            (x, batch) = self.select_step(
                i,
                pruner.as_ref(),
                &x,
                next_qkv.take(),
                &batch,
                num_prefix,
                lengths_mode,
            )?;
            batches.push(batch.clone());
            let inputs = AttentionInputs::Ragged { batch: &batch };
            let next = self.chainable_next(i, steps.peek().map(|(blk, p)| (*blk, p.site())));
            (x, next_qkv) = block.rest_after_chained(site, &x, None, next, &inputs)?;
        }
        // One kernel, no host offsets: the class (and distillation) token of every image.
        let prefix = leading_rows(&x, &batch, num_prefix)?;
        let logits = self.logits_from_prefix(&prefix)?;
        Ok((logits, batches))
    }

    /// Block `block`'s pruning step by rule on packed tokens `x`: the block up to the step's site,
    /// the scores, the selection. The selected tokens and their batch (the rest of the block is
    /// the caller's). `qkv`: the block's qkv projection of `x` when the block before computed it
    /// (a step after the attention only; [`DeiT::chainable_next`]).
    #[allow(clippy::too_many_arguments)]
    fn select_step(
        &self,
        block: usize,
        pruner: &dyn TokenPruner,
        x: &Tensor,
        qkv: Option<Tensor>,
        batch: &RaggedBatch,
        num_prefix: usize,
        lengths_mode: Lengths,
    ) -> Result<(Tensor, RaggedBatch), ModelError> {
        let block = &self.blocks[block];
        let inputs = AttentionInputs::Ragged { batch };
        let site = pruner.site();
        let (heads, scale) = (block.attn.heads, block.attn.scale as f32);
        let (tokens, qkv) = block.tokens_at(site, x, qkv, &inputs)?;
        let given;
        let computed = computed_scores(pruner.score_recipe(), site, qkv.as_ref(), heads, scale);
        let packed = match computed {
            Some(_) => None,
            None => pruner.packed_scores(&tokens, batch, num_prefix)?,
        };
        let scores = match (computed, packed) {
            (Some(s), _) => s,
            // `[total]` packed scores (DynamicViT's predictor) to `[B, max_len]`.
            (None, Some(packed)) => {
                given = unpack(&packed.unsqueeze(1)?, batch, batch.max_len())?.squeeze(2)?;
                TokenScores::Given(&given)
            }
            (None, None) if site == PruneSite::BeforeBlock => {
                if !batch.lengths_on_host() {
                    return Err(ModelError::InvalidPruning(format!(
                        "{}: custom scores need each image's length on the host, which a \
                         capturable forward does not read after an earlier step",
                        pruner.kind()
                    )));
                }
                // The pruner's own scores over the image-shaped tokens (zeros past each
                // image's length), `[B, max_len]`.
                let image = unpack(&tokens, batch, batch.max_len())?;
                let lengths = batch.lengths()?;
                let input = PruneInput::new(&image, num_prefix).with_lengths(&lengths);
                given = pruner.scores(&input)?.to_dtype(DType::F32)?;
                TokenScores::Given(&given)
            }
            (None, None) => {
                return Err(ModelError::InvalidPruning(format!(
                    "{}: custom scores after attention need the host path (forward_pruned) \
                     when counts vary",
                    pruner.kind()
                )))
            }
        };
        let rule = pruner.keep_rule().ok_or_else(|| {
            ModelError::InvalidPruning(format!("{}: no keep rule", pruner.kind()))
        })?;
        let select = match lengths_mode {
            Lengths::ReadBack => select_by_rule,
            Lengths::OnDevice => select_by_rule_bounded,
        };
        let fusion = fusion_of(pruner.fusion());
        Ok(select(&tokens, batch, scores, num_prefix, rule, fusion)?)
    }

    /// The capturable forward ([`DeiT::forward_pruned_capturable`]'s bounded selections, no host
    /// sync) from the pixels up to the first pruning step's selection: the selected tokens at
    /// the step's capacity, for [`DeiT::forward_from_step`] to continue. Splitting the forward
    /// there lets a caller read the step's total ([`PrunedTokens::fit`], one u32) and run the
    /// rest over that many rows (rounded up) instead of the capacity: a threshold rule's capacity
    /// is every token. An error for a schedule without a pruning step, and as
    /// [`DeiT::forward_pruned_capturable`] for pruners the device path cannot run.
    pub fn forward_to_first_step(
        &self,
        pixels: &Tensor,
        pruners: &[BlockPruner],
    ) -> Result<PrunedTokens, ModelError> {
        let order = self.device_order(pruners)?;
        let Some((block, pruner)) = order.first().copied() else {
            return Err(ModelError::InvalidPruning(
                "forward_to_first_step: the schedule has no pruning step".into(),
            ));
        };
        let (x, batch) = self.packed(self.embed(pixels)?)?;
        self.blocks_then_select(x, &batch, 0, *block, pruner.as_ref())
    }

    /// Blocks `from..block` on packed tokens `x` (over `batch`), then `block`'s pruning step's
    /// selection (bounded, no host sync).
    fn blocks_then_select(
        &self,
        mut x: Tensor,
        batch: &RaggedBatch,
        from: usize,
        block: usize,
        pruner: &dyn TokenPruner,
    ) -> Result<PrunedTokens, ModelError> {
        let inputs = AttentionInputs::Ragged { batch };
        for b in &self.blocks[from..block] {
            x = b.forward_with(&x, &inputs)?;
        }
        let num_prefix = self.config.num_prefix_tokens();
        let (tokens, batch) = self.select_step(
            block,
            pruner,
            &x,
            None,
            batch,
            num_prefix,
            Lengths::OnDevice,
        )?;
        Ok(PrunedTokens {
            tokens,
            batch,
            block,
            site: pruner.site(),
        })
    }

    /// Continues from a pruning step's selected tokens ([`DeiT::forward_to_first_step`] or
    /// [`DeiT::forward_to_next_step`], fitted or not): the rest of the step's block, the later
    /// blocks and steps (bounded selections, no host sync), the head. `[B, num_classes]` logits,
    /// the same as [`DeiT::forward_pruned_capturable`]'s (matmuls over fewer rows may round
    /// differently on CUDA). An error when `pruners` has no step at the tokens' block.
    pub fn forward_from_step(
        &self,
        step: &PrunedTokens,
        pruners: &[BlockPruner],
    ) -> Result<Tensor, ModelError> {
        let order = self.device_order(pruners)?;
        self.step_position(step, &order, "forward_from_step")?;
        let resume = Resume::AfterSelection {
            block: step.block,
            site: step.site,
        };
        let (logits, _) = self.ragged_blocks(
            step.tokens.clone(),
            step.batch.clone(),
            resume,
            &order,
            Lengths::OnDevice,
            None,
        )?;
        Ok(logits)
    }

    /// Continues from a pruning step's selected tokens up to and including the next step's
    /// selection (bounded, no host sync): the rest of the step's block, the blocks before the
    /// next step, its selection. An error when `pruners` has no step at the tokens' block or none
    /// after it.
    pub fn forward_to_next_step(
        &self,
        step: &PrunedTokens,
        pruners: &[BlockPruner],
    ) -> Result<PrunedTokens, ModelError> {
        let order = self.device_order(pruners)?;
        let at = self.step_position(step, &order, "forward_to_next_step")?;
        let Some((next, pruner)) = order.get(at + 1).copied() else {
            return Err(ModelError::InvalidPruning(format!(
                "forward_to_next_step: the schedule has no step after block {}",
                step.block
            )));
        };
        let inputs = AttentionInputs::Ragged { batch: &step.batch };
        let x = self.blocks[step.block].rest_after(step.site, &step.tokens, &inputs)?;
        self.blocks_then_select(x, &step.batch, step.block + 1, *next, pruner.as_ref())
    }

    /// Where in `order` the step that made `step`'s tokens is.
    fn step_position(
        &self,
        step: &PrunedTokens,
        order: &[&BlockPruner],
        op: &str,
    ) -> Result<usize, ModelError> {
        order
            .iter()
            .position(|(blk, _)| *blk == step.block)
            .ok_or_else(|| {
                ModelError::InvalidPruning(format!(
                    "{op}: the tokens come from a step at block {}, which the schedule does not \
                     have",
                    step.block
                ))
            })
    }
}
