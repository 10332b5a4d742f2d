//! Threshold-L2: keep the patch tokens with the largest L2 norms.
//!
//! Acts before a block (on the block's input tokens). Scores are `‖x_j‖₂` in f32.

use candle_core::{DType, Tensor, D};

use crate::error::{PruneError, Result};
use crate::input::PruneInput;
use crate::{KeepCount, KeepRule, Mode, Needs, PruneSite, PrunerKind, TokenPruner};

/// How Threshold-L2 decides.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ThresholdL2Mode {
    /// Keep the top `k = ceil(keep_ratio · n_patch)` norms of each image (fixed ratio).
    TopK { keep_ratio: f64 },
    /// Keep patch tokens with `‖x‖ ≥ threshold` (adaptive).
    Absolute { threshold: f32 },
    /// Keep patch tokens with `‖x‖ ≥ factor · mean patch-token norm of that image` (adaptive).
    Relative { factor: f32 },
}

/// Configuration of [`ThresholdL2`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ThresholdL2Config {
    pub mode: ThresholdL2Mode,
}

impl ThresholdL2Config {
    /// Fixed-ratio mode.
    pub fn fixed(keep_ratio: f64) -> Self {
        Self {
            mode: ThresholdL2Mode::TopK { keep_ratio },
        }
    }
    /// Adaptive mode, threshold relative to the image's mean patch norm.
    pub fn relative(factor: f32) -> Self {
        Self {
            mode: ThresholdL2Mode::Relative { factor },
        }
    }
    /// Adaptive mode, absolute threshold.
    pub fn absolute(threshold: f32) -> Self {
        Self {
            mode: ThresholdL2Mode::Absolute { threshold },
        }
    }
    fn validate(&self) -> Result<()> {
        let ok = match self.mode {
            ThresholdL2Mode::TopK { keep_ratio } => keep_ratio > 0.0 && keep_ratio <= 1.0,
            ThresholdL2Mode::Absolute { threshold } => threshold.is_finite(),
            ThresholdL2Mode::Relative { factor } => factor.is_finite() && factor >= 0.0,
        };
        if ok {
            Ok(())
        } else {
            Err(PruneError::InvalidConfig(format!(
                "threshold-l2: {:?} (keep_ratio must be in (0, 1], thresholds finite)",
                self.mode
            )))
        }
    }
}

/// Threshold-L2 pruner (no weights).
#[derive(Debug, Clone)]
pub struct ThresholdL2 {
    config: ThresholdL2Config,
}

impl ThresholdL2 {
    pub fn new(config: ThresholdL2Config) -> Result<Self> {
        config.validate()?;
        Ok(Self { config })
    }
    pub fn config(&self) -> &ThresholdL2Config {
        &self.config
    }
}

impl TokenPruner for ThresholdL2 {
    fn kind(&self) -> PrunerKind {
        PrunerKind::ThresholdL2
    }
    fn mode(&self) -> Mode {
        match self.config.mode {
            ThresholdL2Mode::TopK { .. } => Mode::Fixed,
            _ => Mode::Adaptive,
        }
    }
    fn site(&self) -> PruneSite {
        PruneSite::BeforeBlock
    }
    fn needs(&self) -> Needs {
        Needs::default()
    }

    /// `[B, N]` f32 token norms.
    fn scores(&self, input: &PruneInput) -> Result<Tensor> {
        input.validate()?;
        let t = input.tokens.to_dtype(DType::F32)?;
        Ok(t.sqr()?.sum(D::Minus1)?.sqrt()?)
    }

    fn score_recipe(&self) -> crate::ScoreRecipe {
        crate::ScoreRecipe::TokenL2Norm
    }

    fn keep_rule(&self) -> Option<KeepRule> {
        Some(match self.config.mode {
            ThresholdL2Mode::TopK { keep_ratio } => KeepRule::Top(KeepCount::CeilRatio(keep_ratio)),
            ThresholdL2Mode::Absolute { threshold } => KeepRule::AtLeast(threshold),
            ThresholdL2Mode::Relative { factor } => KeepRule::AtLeastMeanTimes(factor),
        })
    }
}
