//! ATS, Adaptive Token Sampling (Fayyaz et al., ECCV 2022).
//!
//! Facts from the reference code (`adaptivetokensampling/ATS`,
//! `libs/models/transformers/ats_block.py`) that this module follows:
//! - Significance `S_j = (Σ_h A_h[cls, j]) · ‖V_j‖₂`, where `‖V_j‖` is the norm of the value
//!   vector of token `j` with all heads concatenated (`v.transpose(1,2).reshape(B,T,H·D)`),
//!   restricted to the non-class tokens and normalised to sum 1 (`score_assignment_step`).
//! - Scores are sorted ascending, `cdf = cumsum`, normalised to `[0, 1]` by
//!   `(cdf - min) / (max - min)`.
//! - Sample points on the y-axis (`create_ys`): `K` evenly spaced values from `y0` to 1, where
//!   `y0` is the smallest non-zero normalised-CDF value.
//! - Each point picks the token whose normalised CDF is nearest (`argmin |y - cdf|`, first
//!   index on ties — i.e. the lower-scoring token in sorted order; equal scores are ordered by
//!   lower original position here); duplicates collapse (`get_unique_indices`), so an image
//!   keeps `≤ K` distinct tokens; only those continue (with `DROP_TOKENS: True`).
//! - Site: inside the attention. The reference gathers the attention rows and the block input
//!   (`raw_x`) of the sampled tokens and adds them — the same as gathering the post-residual
//!   hidden states, since attention rows are independent per query. So
//!   [`PruneSite::AfterAttention`], as EViT, needing `cls_attn` and the values.
//! - K in the reference: `n_ref_tokens - 1` sample points, `n_ref_tokens = 197` for DeiT at
//!   224 px (the original token count), in every ATS block (`DeiT_S.yaml`: `ATS_BLOCKS:
//!   [3..11]`, `NUM_TOKENS: 197`). That is [`AtsMode::Adaptive`] with
//!   `max_samples = 196` (the default). The reference then truncates the unique samples to
//!   `n_tokens - 1` (a no-op with its config); this module does not truncate: the budget is the
//!   number of sample points.
//! - [`AtsMode::Fixed`]: `K = ceil(keep_ratio · n_patch)` of the image's current patch count.

use candle_core::Tensor;

use crate::error::{PruneError, Result};
use crate::input::{cls_attn_sum, value_norms, PruneInput};
use crate::{KeepCount, KeepRule, Mode, Needs, PruneSite, PrunerKind, TokenPruner};

/// How ATS sets the number of sample points `K`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AtsMode {
    /// `K = ceil(keep_ratio · n_patch)` sample points (an image keeps at most `K` tokens).
    Fixed { keep_ratio: f64 },
    /// `K = max_samples` sample points, independent of the current count (the reference uses
    /// the original patch count, 196 for DeiT-224).
    Adaptive { max_samples: usize },
}

/// Configuration of [`Ats`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AtsConfig {
    pub mode: AtsMode,
}

impl AtsConfig {
    pub fn fixed(keep_ratio: f64) -> Self {
        Self {
            mode: AtsMode::Fixed { keep_ratio },
        }
    }
    pub fn adaptive(max_samples: usize) -> Self {
        Self {
            mode: AtsMode::Adaptive { max_samples },
        }
    }
    fn validate(&self) -> Result<()> {
        let ok = match self.mode {
            AtsMode::Fixed { keep_ratio } => keep_ratio > 0.0 && keep_ratio <= 1.0,
            AtsMode::Adaptive { max_samples } => max_samples >= 1,
        };
        if ok {
            Ok(())
        } else {
            Err(PruneError::InvalidConfig(format!(
                "ats: {:?} (keep_ratio in (0, 1], max_samples >= 1)",
                self.mode
            )))
        }
    }
}

/// ATS pruner (no weights).
#[derive(Debug, Clone)]
pub struct Ats {
    config: AtsConfig,
}

impl Ats {
    pub fn new(config: AtsConfig) -> Result<Self> {
        config.validate()?;
        Ok(Self { config })
    }
    pub fn config(&self) -> &AtsConfig {
        &self.config
    }
}

impl TokenPruner for Ats {
    fn kind(&self) -> PrunerKind {
        PrunerKind::Ats
    }
    fn mode(&self) -> Mode {
        match self.config.mode {
            AtsMode::Fixed { .. } => Mode::Fixed,
            AtsMode::Adaptive { .. } => Mode::Adaptive,
        }
    }
    fn site(&self) -> PruneSite {
        PruneSite::AfterAttention
    }
    fn needs(&self) -> Needs {
        Needs {
            cls_attn: true,
            values: true,
        }
    }

    /// `[B, N]` f32 un-normalised significance `(Σ_h A_h[cls, j]) · ‖V_j‖`.
    fn scores(&self, input: &PruneInput) -> Result<Tensor> {
        input.validate()?;
        let a = input.cls_attn.ok_or(PruneError::MissingInput {
            pruner: "ats",
            what: "cls_attn (class-token attention of this block)",
        })?;
        let v = input.values.ok_or(PruneError::MissingInput {
            pruner: "ats",
            what: "values or value norms of this block's attention",
        })?;
        Ok(cls_attn_sum(a)?.mul(&value_norms(v)?)?)
    }

    fn score_recipe(&self) -> crate::ScoreRecipe {
        crate::ScoreRecipe::Significance
    }

    fn keep_rule(&self) -> Option<KeepRule> {
        Some(KeepRule::InverseTransform {
            samples: match self.config.mode {
                AtsMode::Fixed { keep_ratio } => KeepCount::CeilRatio(keep_ratio),
                AtsMode::Adaptive { max_samples } => KeepCount::Exactly(max_samples),
            },
        })
    }
}
