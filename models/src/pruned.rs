//! Token-pruned forward passes: a pruning schedule ([`pruners::PruningSchedule`], built into
//! pruners with [`DeiT::build_pruners`]) run along one of three [`ExecutionPath`]s.
//!
//! - [`ExecutionPath::Dense`]: no pruning; the plain `[B, N, C]` forward ([`DeiT::forward`]).
//! - [`ExecutionPath::Padded`]: after each pruning step the kept tokens of every image are
//!   compacted to the left (ascending original position, then EViT's fused token), the batch is
//!   padded to its longest image, and attention masks the padding keys (`-inf` before an f32
//!   softmax). Padding rows stay finite (they start as zeros; nothing reads them) and are zeroed
//!   again before a pruner sees them.
//! - [`ExecutionPath::Ragged`]: the kept tokens are packed `[total, C]` (`cu_seqlens`); every
//!   per-token op runs on the packed tensor and attention is one
//!   [`candle_ragged::ragged_attention`] launch on strided views of the fused qkv. Tokens are
//!   unpacked to image shape only where a pruner needs them, and the head reads the class (and
//!   distillation) rows straight from the packed tensor.
//!
//! Both pruned paths hand the pruners the same left-aligned `[B, L, C]` layout with zeros past
//! each image's length, so they make the same decisions. Pruners acting
//! [`PruneSite::BeforeBlock`] see the block's input; pruners acting
//! [`PruneSite::AfterAttention`] see the hidden states after attention + residual (the MLP then
//! runs on the kept tokens) together with the class token's attention over the keys of that
//! block, recomputed from its qkv (one row per image and head; no kernel outputs probabilities).
//!
//! **Host syncs.** Nothing here reads a device tensor back, except the pruners: each
//! [`TokenPruner::plan`] copies its `[B, L]` scores to the host to decide (the kept counts must be
//! known there to allocate the next layout). That is the one sync per pruning step. Everything
//! else the host needs (lengths, offsets, gather rows, masks) it already knows and uploads.

use std::fmt;
use std::str::FromStr;

use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::VarBuilder;
use candle_ragged::{unpack, RaggedBatch};
use pruners::{KeepPlan, PruneInput, PruneSite, PruningSchedule, TokenPruner};

use crate::attention::{cls_attention, AttentionInputs, KeyPaddingMask};
use crate::deit::DeiT;
use crate::error::ModelError;

/// A pruner and the block it acts at, as [`PruningSchedule::build`] returns them.
pub type BlockPruner = (usize, Box<dyn TokenPruner>);

/// How a (possibly token-pruned) batch is executed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExecutionPath {
    /// All tokens of all images, no pruning.
    Dense,
    /// Kept tokens left-aligned, padded to the longest image, key-padding mask.
    Padded,
    /// Kept tokens packed (`cu_seqlens`), ragged attention kernel.
    Ragged,
}

impl ExecutionPath {
    pub const ALL: [ExecutionPath; 3] = [Self::Dense, Self::Padded, Self::Ragged];

    pub fn name(self) -> &'static str {
        match self {
            Self::Dense => "dense",
            Self::Padded => "padded",
            Self::Ragged => "ragged",
        }
    }
}

impl fmt::Display for ExecutionPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ExecutionPath {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "dense" => Ok(Self::Dense),
            "padded" | "pad" => Ok(Self::Padded),
            "ragged" | "packed" => Ok(Self::Ragged),
            _ => Err(format!(
                "unknown execution path `{s}`; valid: dense, padded, ragged"
            )),
        }
    }
}

/// What one pruning step decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PruneStage {
    pub block: usize,
    pub site: PruneSite,
    /// Per image: the kept positions in the layout the pruner saw (ascending, prefix included;
    /// the pruner's [`KeepPlan::indices`]).
    pub keep_indices: Vec<Vec<u32>>,
    /// Per image: whether a fused token (EViT) was appended after the kept tokens.
    pub fused: Vec<bool>,
    /// Per image: tokens after the step (kept + fused), i.e. the image's new length.
    pub kept_tokens: Vec<usize>,
    /// Per image: original positions (into the tokens entering block 0, prefix included) of
    /// the kept tokens, ascending. A kept fused token has no original position and is omitted.
    pub original_positions: Vec<Vec<u32>>,
}

/// Logits plus the pruning decisions of a [`DeiT::forward_pruned`] call.
#[derive(Debug, Clone)]
pub struct PrunedForward {
    /// `[B, num_classes]` in the model dtype.
    pub logits: Tensor,
    /// One entry per pruning step, in block order (empty for the dense path).
    pub stages: Vec<PruneStage>,
    /// Tokens per image entering block 0.
    pub initial_tokens: usize,
}

impl PrunedForward {
    /// Per stage, per image: tokens kept (prefix and fused token included).
    pub fn kept_tokens(&self) -> Vec<Vec<usize>> {
        self.stages.iter().map(|s| s.kept_tokens.clone()).collect()
    }

    /// Mean over images of the tokens left after the last pruning step (the initial count when
    /// nothing pruned).
    pub fn mean_final_tokens(&self) -> f64 {
        match self.stages.last() {
            None => self.initial_tokens as f64,
            Some(s) => {
                s.kept_tokens.iter().sum::<usize>() as f64 / s.kept_tokens.len().max(1) as f64
            }
        }
    }
}

/// The token layout of a pruned batch.
enum Tokens {
    /// `x: [B, L, C]`, image `b` owning its leading `mask.lengths()[b]` rows.
    Padded { x: Tensor, mask: KeyPaddingMask },
    /// `x: [total, C]` packed as `batch` says (sequence `b` = image `b`'s tokens, left-aligned).
    Ragged { x: Tensor, batch: RaggedBatch },
}

impl Tokens {
    fn x(&self) -> &Tensor {
        match self {
            Self::Padded { x, .. } | Self::Ragged { x, .. } => x,
        }
    }

    fn set_x(&mut self, new: Tensor) {
        match self {
            Self::Padded { x, .. } | Self::Ragged { x, .. } => *x = new,
        }
    }

    fn inputs(&self) -> AttentionInputs<'_> {
        match self {
            // Nothing padded (before the first step, or equal counts): plain attention.
            Self::Padded { mask, .. } if mask.is_full() => AttentionInputs::Dense,
            Self::Padded { mask, .. } => AttentionInputs::Padded { mask },
            Self::Ragged { batch, .. } => AttentionInputs::Ragged { batch },
        }
    }

    fn lengths(&self) -> candle_core::Result<Vec<usize>> {
        match self {
            Self::Padded { mask, .. } => Ok(mask.lengths().to_vec()),
            Self::Ragged { batch, .. } => Ok(batch.lengths()?),
        }
    }

    fn max_len(&self) -> usize {
        match self {
            Self::Padded { mask, .. } => mask.max_len(),
            Self::Ragged { batch, .. } => batch.max_len(),
        }
    }

    fn device(&self) -> &Device {
        self.x().device()
    }

    /// `t` (same layout as `x`, any last dim) as `[B, L, C']` with zeros past every image's
    /// length: the pruners' input. Ragged: one unpack.
    fn image_shaped(&self, t: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Self::Padded { mask, .. } if mask.is_full() => Ok(t.clone()),
            Self::Padded { mask, .. } => t.broadcast_mul(&mask.row_mask(t.dtype())?),
            Self::Ragged { batch, .. } => Ok(unpack(t, batch, batch.max_len())?),
        }
    }

    /// The leading `p` tokens of every image, `[B, p, C]`.
    fn prefix(&self, p: usize) -> candle_core::Result<Tensor> {
        match self {
            Self::Padded { x, .. } => x.narrow(1, 0, p),
            Self::Ragged { x, batch } => packed_prefix(x, batch, p),
        }
    }

    /// The class token's attention over the keys `[B, H, L]` (f32) and, when `values`, the value
    /// norms `[B, L]` (f32), from a block's fused qkv (same layout as `x`).
    fn cls_probe(
        &self,
        qkv: &Tensor,
        heads: usize,
        scale: f64,
        values: bool,
    ) -> candle_core::Result<(Tensor, Option<Tensor>)> {
        let c = qkv.dim(D::Minus1)? / 3;
        let (q_cls, kv, mask) = match self {
            Self::Padded { mask, .. } => {
                let q_cls = qkv.narrow(1, 0, 1)?.squeeze(1)?.narrow(1, 0, c)?;
                let kv = qkv.narrow(2, c, 2 * c)?;
                (q_cls, kv, (!mask.is_full()).then(|| mask.clone()))
            }
            Self::Ragged { batch, .. } => {
                let rows = packed_rows(batch, 0..1)?;
                let q_cls = qkv.index_select(&rows, 0)?.narrow(1, 0, c)?;
                let width = if values { 2 * c } else { c };
                let kv = unpack(&qkv.narrow(1, c, width)?, batch, batch.max_len())?;
                let lengths = batch.lengths()?;
                let full = lengths.iter().all(|&l| l == batch.max_len());
                let mask = if full {
                    None
                } else {
                    Some(KeyPaddingMask::new(
                        &lengths,
                        batch.max_len(),
                        batch.device(),
                    )?)
                };
                (q_cls, kv, mask)
            }
        };
        let k = kv.narrow(2, 0, c)?;
        let attn = cls_attention(&q_cls, &k, heads, scale, mask.as_ref())?;
        let norms = if values {
            let v = kv.narrow(2, c, c)?.to_dtype(DType::F32)?;
            Some(v.sqr()?.sum(D::Minus1)?.sqrt()?)
        } else {
            None
        };
        Ok((attn, norms))
    }

    /// The layout after `plan`. `image` is the pruner's `[B, L, C]` input (for the padded
    /// gather); the ragged path gathers straight from the packed tensor (same values).
    fn apply(&self, plan: &KeepPlan, image: &Tensor) -> candle_core::Result<Self> {
        let dev = self.device();
        match self {
            Self::Padded { .. } => {
                let (x, lengths) = plan
                    .gather_padded(image)
                    .map_err(candle_core::Error::wrap)?;
                let max_len = x.dim(1)?;
                let mask = KeyPaddingMask::new(&lengths, max_len, dev)?;
                Ok(Self::Padded { x, mask })
            }
            Self::Ragged { x, batch } => {
                let total = batch.total_tokens() as u32;
                let mut rows = Vec::new();
                let offsets = batch.offsets()?;
                for (b, (idx, &off)) in plan.indices.iter().zip(offsets.iter()).enumerate() {
                    rows.extend(idx.iter().map(|&j| off + j));
                    if plan.has_fused(b) {
                        rows.push(total + b as u32);
                    }
                }
                let src = match &plan.fused {
                    Some(f) if f.present.iter().any(|&p| p) => {
                        Tensor::cat(&[x.clone(), f.tokens.to_dtype(x.dtype())?], 0)?
                    }
                    _ => x.clone(),
                };
                let n = rows.len();
                let rows = Tensor::from_vec(rows, n, dev)?;
                let x = src.index_select(&rows, 0)?;
                let batch = RaggedBatch::from_lengths(&plan.kept_counts(), dev)?;
                Ok(Self::Ragged { x, batch })
            }
        }
    }
}

/// Row `offsets[b] + i` of a packed tensor for every image `b` and `i` in `rows` (uploaded from
/// the host offsets; no sync).
fn packed_rows(batch: &RaggedBatch, rows: std::ops::Range<u32>) -> candle_core::Result<Tensor> {
    let offsets = batch.offsets()?;
    let offsets = &offsets[..batch.batch_size()];
    let idx: Vec<u32> = offsets
        .iter()
        .flat_map(|&o| rows.clone().map(move |i| o + i))
        .collect();
    Tensor::from_vec(idx, offsets.len() * rows.len(), batch.device())
}

/// The leading `p` rows of every sequence of the packed `x` `[total, C]`, as `[B, p, C]`.
pub(crate) fn packed_prefix(
    x: &Tensor,
    batch: &RaggedBatch,
    p: usize,
) -> candle_core::Result<Tensor> {
    let rows = packed_rows(batch, 0..p as u32)?;
    x.index_select(&rows, 0)?
        .reshape((batch.batch_size(), p, x.dim(1)?))
}

impl DeiT {
    /// Every pruner sits at one of this model's blocks, one pruner per block at most.
    pub(crate) fn check_pruner_blocks(&self, pruners: &[BlockPruner]) -> Result<(), ModelError> {
        let depth = self.blocks.len();
        for (i, (block, _)) in pruners.iter().enumerate() {
            if *block >= depth || pruners[..i].iter().any(|(b, _)| b == block) {
                return Err(ModelError::InvalidPruning(format!(
                    "pruner at block {block}: the model has {depth} blocks and one pruner per block at most"
                )));
            }
        }
        Ok(())
    }

    /// Builds `schedule`'s pruners for this model (its depth, width and device). DynamicViT
    /// predictors load from `weights` when given, else are randomly initialised.
    pub fn build_pruners(
        &self,
        schedule: &PruningSchedule,
        weights: Option<&VarBuilder>,
    ) -> Result<Vec<BlockPruner>, ModelError> {
        Ok(schedule.build(
            self.config.depth,
            self.config.dim,
            weights,
            self.pos_embed.device(),
        )?)
    }

    /// Logits of `pixels` `[B, 3, H, W]` with the `pruners` acting at their blocks, executed
    /// along `path`. [`ExecutionPath::Dense`] takes no pruners (it is [`Module::forward`]);
    /// with no pruners, padded and ragged compute the dense result.
    ///
    /// Host syncs: one per pruning step, inside the pruner's [`TokenPruner::plan`] (its scores
    /// are read back to decide); none elsewhere. On the CPU it runs inside candle's pool (see
    /// `cpu_pool`).
    pub fn forward_pruned(
        &self,
        pixels: &Tensor,
        pruners: &[BlockPruner],
        path: ExecutionPath,
    ) -> Result<PrunedForward, ModelError> {
        crate::cpu_pool::in_cpu_pool(pixels.device(), || {
            self.forward_pruned_as_called(pixels, pruners, path)
        })
    }

    /// [`Self::forward_pruned`] on the calling thread.
    fn forward_pruned_as_called(
        &self,
        pixels: &Tensor,
        pruners: &[BlockPruner],
        path: ExecutionPath,
    ) -> Result<PrunedForward, ModelError> {
        self.check_pruner_blocks(pruners)?;
        if path == ExecutionPath::Dense {
            if !pruners.is_empty() {
                return Err(ModelError::InvalidPruning(
                    "the dense path does not prune; use the padded or ragged path".into(),
                ));
            }
            return Ok(PrunedForward {
                logits: Module::forward(self, pixels)?,
                stages: Vec::new(),
                initial_tokens: self.config.seq_len(),
            });
        }
        let x = self.embed(pixels)?;
        let (b, n, c) = x.dims3()?;
        let dev = x.device().clone();
        let mut tokens = if path == ExecutionPath::Ragged {
            Tokens::Ragged {
                x: x.reshape((b * n, c))?,
                batch: self
                    .uniform_batches
                    .get(b, n, &dev)
                    .map_err(candle_core::Error::from)?,
            }
        } else {
            Tokens::Padded {
                mask: KeyPaddingMask::new(&vec![n; b], n, &dev)?,
                x,
            }
        };
        let num_prefix = self.config.num_prefix_tokens();
        let mut origins: Vec<Vec<Option<u32>>> = vec![(0..n as u32).map(Some).collect(); b];
        let mut stages = Vec::new();
        for (i, block) in self.blocks.iter().enumerate() {
            let Some((_, pruner)) = pruners.iter().find(|(blk, _)| *blk == i) else {
                let x = block.forward_with(tokens.x(), &tokens.inputs())?;
                tokens.set_x(x);
                continue;
            };
            let lengths = tokens.lengths()?;
            let (plan, image) = match pruner.site() {
                PruneSite::BeforeBlock => {
                    let image = tokens.image_shaped(tokens.x())?;
                    let input = PruneInput::new(&image, num_prefix).with_lengths(&lengths);
                    (pruner.plan(&input)?, image) // host sync: the scores are read back
                }
                PruneSite::AfterAttention => {
                    let (h, qkv) = block.attn_residual_with_qkv(tokens.x(), &tokens.inputs())?;
                    tokens.set_x(h);
                    let needs = pruner.needs();
                    let (attn, norms) =
                        tokens.cls_probe(&qkv, block.attn.heads, block.attn.scale, needs.values)?;
                    let image = tokens.image_shaped(tokens.x())?;
                    let mut input = PruneInput::new(&image, num_prefix).with_lengths(&lengths);
                    if needs.cls_attn {
                        input = input.with_cls_attn(&attn);
                    }
                    if let Some(norms) = &norms {
                        input = input.with_value_norms(norms);
                    }
                    (pruner.plan(&input)?, image) // host sync: the scores are read back
                }
            };
            tokens = tokens.apply(&plan, &image)?;
            stages.push(record_stage(i, pruner.site(), &plan, &mut origins));
            let x = block.rest_after(pruner.site(), tokens.x(), &tokens.inputs())?;
            tokens.set_x(x);
        }
        debug_assert_eq!(Some(tokens.max_len()), tokens.lengths()?.into_iter().max());
        Ok(PrunedForward {
            logits: self.logits_from_prefix(&tokens.prefix(num_prefix)?)?,
            stages,
            initial_tokens: n,
        })
    }
}

/// Records `plan` and maps the kept positions back to original token positions.
fn record_stage(
    block: usize,
    site: PruneSite,
    plan: &KeepPlan,
    origins: &mut [Vec<Option<u32>>],
) -> PruneStage {
    let b = plan.batch_size();
    let fused: Vec<bool> = (0..b).map(|i| plan.has_fused(i)).collect();
    for (i, origin) in origins.iter_mut().enumerate() {
        let mut next: Vec<Option<u32>> = plan.indices[i]
            .iter()
            .map(|&j| origin[j as usize])
            .collect();
        if fused[i] {
            next.push(None);
        }
        *origin = next;
    }
    PruneStage {
        block,
        site,
        keep_indices: plan.indices.clone(),
        fused,
        kept_tokens: plan.kept_counts(),
        original_positions: origins
            .iter()
            .map(|o| o.iter().flatten().copied().collect())
            .collect(),
    }
}
