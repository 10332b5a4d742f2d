//! Token-pruning strategies for DeiT-style vision transformers, as candle modules.
//!
//! The crate sees tokens and attention, never the model: a model calls a [`TokenPruner`] at the
//! site it reports ([`TokenPruner::site`]) with a [`PruneInput`] (the batch's tokens, per-image
//! valid lengths, and the class-token attention / values when [`TokenPruner::needs`] says so)
//! and gets a [`KeepPlan`]: per image the ascending original positions to keep (prefix tokens
//! always included, at least one patch token), and for EViT a fused token to append.
//!
//! Guarantees shared by all pruners:
//! - Scores are computed with tensor ops on the input's device, in f32 whatever the token
//!   dtype; the decision (a [`KeepRule`]: top-k, threshold, mass share, inverse-transform
//!   sampling) runs on the host over `[B, N]` scores in [`TokenPruner::plan`], or on the device
//!   through [`candle_ragged::select_by_rule`], which applies the same rule.
//! - Ties break to the lower token index; NaN scores rank last. Padding (rows past an image's
//!   length) never enters a decision, so an image's plan does not depend on its batch
//!   neighbours (given bit-identical per-token scores).
//! - Kept positions are ascending, so dense, padded and packed execution see the same sequence.
//!
//! Pruners: [`ThresholdL2`], [`DynamicVit`], [`Evit`], [`Ats`]; schedules: [`PruningSchedule`].

pub mod ats;
pub mod dynamicvit;
pub mod error;
pub mod evit;
pub mod input;
pub mod schedule;
mod select;
pub mod threshold;

use candle_core::Tensor;
pub use candle_ragged::{KeepCount, KeepRule};

pub use ats::{Ats, AtsConfig, AtsMode};
pub use candle_ragged::keep::inverse_transform_sample;
pub use dynamicvit::{DynamicVit, DynamicVitConfig, DynamicVitMode, PredictorLG, WeightsSource};
pub use error::{PruneError, Result};
pub use evit::{Evit, EvitConfig, EvitFusion, EvitMode};
pub use input::{FusedTokens, Geometry, KeepPlan, PruneInput, ValueInput};
pub use schedule::{
    default_blocks, PrunerConfig, PrunerSpec, PruningSchedule, ScheduledPruner, DEFAULT_KEEP_RATIO,
};
pub use threshold::{ThresholdL2, ThresholdL2Config, ThresholdL2Mode};

/// The four pruning methods.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PrunerKind {
    ThresholdL2,
    DynamicVit,
    Evit,
    Ats,
}

impl PrunerKind {
    pub const ALL: [PrunerKind; 4] = [
        PrunerKind::ThresholdL2,
        PrunerKind::DynamicVit,
        PrunerKind::Evit,
        PrunerKind::Ats,
    ];
    /// Canonical CLI name.
    pub fn name(self) -> &'static str {
        match self {
            PrunerKind::ThresholdL2 => "threshold-l2",
            PrunerKind::DynamicVit => "dynamicvit",
            PrunerKind::Evit => "evit",
            PrunerKind::Ats => "ats",
        }
    }
}

impl std::fmt::Display for PrunerKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Fixed ratio (every image keeps the same share) or adaptive (a threshold; counts differ).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Mode {
    #[default]
    Fixed,
    Adaptive,
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Mode::Fixed => "fixed",
            Mode::Adaptive => "adaptive",
        })
    }
}

/// Where in a block a pruner acts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PruneSite {
    /// On the block's input, before its attention (DynamicViT, Threshold-L2): the block then
    /// runs entirely on the kept tokens.
    BeforeBlock,
    /// Inside the block after attention + residual, before the MLP, using this block's
    /// class-token attention computed over the un-pruned tokens (EViT, ATS): pass the
    /// post-residual hidden states as tokens; the MLP runs on the kept (+ fused) tokens.
    AfterAttention,
}

/// Extra inputs a pruner needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Needs {
    /// `PruneInput::cls_attn` of this block.
    pub cls_attn: bool,
    /// `PruneInput::values` of this block.
    pub values: bool,
}

/// What a pruner's [`TokenPruner::scores`] are, when they follow a recipe simple enough for a
/// model to compute inside its own selection kernel (one launch per pruning step instead of the
/// handful of small tensor ops `scores` takes): the model must then decide exactly as the
/// pruner's [`TokenPruner::keep_rule`] over `scores` does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScoreRecipe {
    /// The L2 norm of each token (in f32).
    TokenL2Norm,
    /// The class token's attention of this block, softmax per head in f32, averaged over heads.
    ClsAttentionMean,
    /// ATS's significance: the class token's attention summed over heads, times the L2 norm of
    /// the token's value vector (all heads concatenated), in f32.
    Significance,
    /// Anything else (learned predictors): use [`TokenPruner::scores`].
    Custom,
}

/// Decides, for a batch of tokens at one site, which tokens each image keeps.
///
/// Every pruner here is a score ([`TokenPruner::scores`], [`TokenPruner::score_recipe`]) plus a
/// per-image [`KeepRule`] over the patch positions ([`TokenPruner::keep_rule`]), plus EViT's fused
/// token ([`TokenPruner::fusion`]); [`TokenPruner::plan`] applies the rule on the host, and a model
/// may apply the same rule on the device ([`candle_ragged::select_by_rule`]) to the same effect.
pub trait TokenPruner: Send + Sync + std::fmt::Debug {
    fn kind(&self) -> PrunerKind;
    fn mode(&self) -> Mode;
    fn site(&self) -> PruneSite;
    fn needs(&self) -> Needs;
    /// For learned pruners: where the weights came from (`None`: no weights).
    fn weights_source(&self) -> Option<WeightsSource> {
        None
    }
    /// Per-token scores `[B, N]` f32 on the input's device (higher = more important; entries
    /// at prefix and padding positions are unspecified). Validates the input.
    fn scores(&self, input: &PruneInput) -> Result<Tensor>;
    /// The same scores over packed tokens `[total, C]` laid out as `batch` (each sequence
    /// starting with `num_prefix` prefix rows): `[total]` f32, bit-identical to what
    /// [`TokenPruner::scores`] gives at those tokens, for a model's packed path to decide
    /// without forming image-shaped tensors. `None` (the default): the pruner scores only
    /// image-shaped input (or its scores follow a [`ScoreRecipe`] the model computes itself).
    fn packed_scores(
        &self,
        _tokens: &Tensor,
        _batch: &candle_ragged::RaggedBatch,
        _num_prefix: usize,
    ) -> Result<Option<Tensor>> {
        Ok(None)
    }
    /// The recipe [`TokenPruner::scores`] follows ([`ScoreRecipe::Custom`] by default).
    fn score_recipe(&self) -> ScoreRecipe {
        ScoreRecipe::Custom
    }
    /// The rule that picks an image's kept patch positions from its scores (prefix positions
    /// are always kept; at least one patch is). `None` (the default) for a pruner that decides
    /// otherwise: it must then override [`TokenPruner::plan`], and a model can only run it on
    /// the host.
    fn keep_rule(&self) -> Option<KeepRule> {
        None
    }
    /// EViT's extra token from the dropped ones, weighted by [`TokenPruner::scores`], appended
    /// to every image that drops a patch; `None` (the default) for pruners that drop outright.
    fn fusion(&self) -> Option<EvitFusion> {
        None
    }
    /// The keep decision: [`TokenPruner::keep_rule`] over [`TokenPruner::scores`], read back to
    /// the host (one sync); pruners that fuse override it to add the fused tokens. Validates the
    /// input; never panics on bad input.
    fn plan(&self, input: &PruneInput) -> Result<KeepPlan> {
        let g = input.validate()?;
        let rule = self.keep_rule().ok_or_else(|| {
            PruneError::InvalidConfig(format!(
                "{}: a pruner without a keep rule must decide in its own plan",
                self.kind()
            ))
        })?;
        let indices = select::decide(&g, &self.scores(input)?, rule)?.indices;
        Ok(KeepPlan {
            indices,
            fused: None,
            num_prefix: g.num_prefix,
        })
    }
    /// For pruners whose counts do not depend on the scores (a [`KeepRule::Top`] rule: the
    /// fixed-ratio modes of Threshold-L2, DynamicViT and EViT): how many of `patches` patch
    /// tokens every image keeps, and the fused token EViT appends. Known on the host before any
    /// score exists, so a model can keep the whole decision on the device with no host sync.
    /// `None` for pruners that must look at the scores to count: adaptive modes and ATS.
    fn fixed_count(&self, patches: usize) -> Option<FixedCount> {
        let keep = self.keep_rule()?.fixed_count(patches)?;
        let fused = self.fusion().filter(|_| keep < patches);
        Some(FixedCount { keep, fused })
    }
}

/// What a fixed-count pruner keeps of `patches` patch tokens (see [`TokenPruner::fixed_count`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FixedCount {
    /// Patch tokens kept per image, in `1..=patches`.
    pub keep: usize,
    /// EViT's extra token from the dropped ones, weighted by [`TokenPruner::scores`]; `None`
    /// when nothing is dropped or the pruner fuses nothing.
    pub fused: Option<EvitFusion>,
}
