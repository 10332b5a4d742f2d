//! EViT (Liang et al., ICLR 2022): keep the attentive patch tokens, fuse the rest.
//!
//! Facts from the reference code (`youweiliang/evit`, `evit.py`: `Attention.forward`,
//! `Block.forward`) that this module follows:
//! - Site: inside a block, **after** the attention and its residual (`x = x + attn(norm1(x))`)
//!   and **before** the MLP; the gathered / fused tokens are those post-residual hidden states,
//!   and the MLP then runs on the reduced set. The ranking uses this block's attention computed
//!   over the un-pruned tokens. So [`PruneSite::AfterAttention`]: pass the post-residual
//!   hidden states as `tokens` and this block's class-token attention as `cls_attn`.
//! - Ranking: `attn[:, :, 0, 1:]` averaged over heads, i.e. every token after the class token
//!   competes (here: every token after the `num_prefix` prefix). A fused token appended by an
//!   earlier EViT block is an ordinary token for later blocks: it is ranked, and may be kept or
//!   fused again (the reference does the same since it sits in `x[:, 1:]`).
//! - Count: `left_tokens = math.ceil(keep_rate * (N - 1))` of the *current* non-class tokens;
//!   if that equals `N - 1` nothing is pruned and no fused token is made.
//! - Fused token: the reference computes `Σ a_i x_i` over the pruned tokens with `a_i` the
//!   head-averaged attention, **without** dividing by `Σ a_i`. The paper describes it as an
//!   attention-weighted average. Default here is the normalised weighted average
//!   `Σ a_i x_i / Σ a_i` ([`EvitFusion::WeightedMean`]); [`EvitFusion::ReferenceSum`] reproduces
//!   the reference code exactly (use it with checkpoints fine-tuned by the EViT code);
//!   [`EvitFusion::Off`] drops the inattentive tokens (EViT without fusion).
//! - Kept tokens are returned in ascending original order (the reference keeps `topk` order,
//!   i.e. descending attention; attention is permutation-equivariant, so only float rounding
//!   differs).

use candle_core::{DType, Tensor};

use crate::error::{PruneError, Result};
use crate::input::{cls_attn_mean, FusedTokens, KeepPlan, PruneInput};
use crate::select::{decide, Decisions};
use crate::{KeepCount, KeepRule, Mode, Needs, PruneSite, PrunerKind, TokenPruner};
use candle_ragged::keep::fusion_weights;
use candle_ragged::DroppedFusion;

/// How EViT decides how many tokens to keep.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum EvitMode {
    /// Keep `ceil(keep_rate · n_patch)` most-attended patch tokens (fixed ratio, the paper's).
    TopK { keep_rate: f64 },
    /// Keep the smallest most-attended set whose class-attention mass reaches `share` of the
    /// image's total attention mass over its patch tokens (adaptive).
    AttentionMass { share: f64 },
}

/// What happens to the tokens EViT does not keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EvitFusion {
    /// One extra token `Σ a_i x_i / Σ a_i` (the attention-weighted average). Default.
    #[default]
    WeightedMean,
    /// One extra token `Σ a_i x_i` exactly as `youweiliang/evit` computes it.
    ReferenceSum,
    /// No extra token.
    Off,
}

/// Configuration of [`Evit`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvitConfig {
    pub mode: EvitMode,
    pub fusion: EvitFusion,
}

impl EvitConfig {
    /// Fixed keep rate with the default fusion.
    pub fn fixed(keep_rate: f64) -> Self {
        Self {
            mode: EvitMode::TopK { keep_rate },
            fusion: EvitFusion::default(),
        }
    }
    /// Attention-mass share with the default fusion.
    pub fn adaptive(share: f64) -> Self {
        Self {
            mode: EvitMode::AttentionMass { share },
            fusion: EvitFusion::default(),
        }
    }
    fn validate(&self) -> Result<()> {
        let v = match self.mode {
            EvitMode::TopK { keep_rate } => keep_rate,
            EvitMode::AttentionMass { share } => share,
        };
        if v > 0.0 && v <= 1.0 {
            Ok(())
        } else {
            Err(PruneError::InvalidConfig(format!(
                "evit: {:?} must be in (0, 1]",
                self.mode
            )))
        }
    }
}

/// EViT pruner (no weights).
#[derive(Debug, Clone)]
pub struct Evit {
    config: EvitConfig,
}

impl Evit {
    pub fn new(config: EvitConfig) -> Result<Self> {
        config.validate()?;
        Ok(Self { config })
    }
    pub fn config(&self) -> &EvitConfig {
        &self.config
    }
    fn rule(&self) -> KeepRule {
        match self.config.mode {
            EvitMode::TopK { keep_rate } => KeepRule::Top(KeepCount::CeilRatio(keep_rate)),
            EvitMode::AttentionMass { share } => KeepRule::MassShare(share),
        }
    }
}

impl TokenPruner for Evit {
    fn kind(&self) -> PrunerKind {
        PrunerKind::Evit
    }
    fn mode(&self) -> Mode {
        match self.config.mode {
            EvitMode::TopK { .. } => Mode::Fixed,
            EvitMode::AttentionMass { .. } => Mode::Adaptive,
        }
    }
    fn site(&self) -> PruneSite {
        PruneSite::AfterAttention
    }
    fn needs(&self) -> Needs {
        Needs {
            cls_attn: true,
            values: false,
        }
    }

    /// `[B, N]` f32 class-token attention averaged over heads.
    fn scores(&self, input: &PruneInput) -> Result<Tensor> {
        input.validate()?;
        let a = input.cls_attn.ok_or(PruneError::MissingInput {
            pruner: "evit",
            what: "cls_attn (class-token attention of this block)",
        })?;
        cls_attn_mean(a)
    }

    fn score_recipe(&self) -> crate::ScoreRecipe {
        crate::ScoreRecipe::ClsAttentionMean
    }

    fn keep_rule(&self) -> Option<KeepRule> {
        Some(self.rule())
    }

    fn fusion(&self) -> Option<EvitFusion> {
        (self.config.fusion != EvitFusion::Off).then_some(self.config.fusion)
    }

    fn plan(&self, input: &PruneInput) -> Result<KeepPlan> {
        let g = input.validate()?;
        let Decisions { indices, rows } = decide(&g, &self.scores(input)?, self.rule())?;
        let p = g.num_prefix;
        let fused = match self.fusion() {
            None => None,
            Some(fusion) => {
                // All-zero attention on the dropped tokens: their plain mean.
                let fusion = match fusion {
                    EvitFusion::ReferenceSum => DroppedFusion::WeightedSum,
                    _ => DroppedFusion::WeightedMean,
                };
                // Per image, the dropped patches' weights (the rule candle_ragged's device
                // selection applies too).
                let mut weights = vec![0f32; g.batch * g.tokens];
                let mut present = vec![false; g.batch];
                for (b, (kept, row)) in indices.iter().zip(&rows).enumerate() {
                    let len = g.lengths[b];
                    let mut kept = kept[p..].iter().map(|&j| j as usize).peekable();
                    let dropped: Vec<usize> = (p..len)
                        .filter(|&j| kept.next_if_eq(&j).is_none())
                        .collect();
                    if dropped.is_empty() {
                        continue;
                    }
                    present[b] = true;
                    for (&j, v) in dropped.iter().zip(fusion_weights(row, &dropped, fusion)) {
                        weights[b * g.tokens + j] = v;
                    }
                }
                let dev = input.tokens.device();
                let w = Tensor::from_vec(weights, (g.batch, 1, g.tokens), dev)?;
                // Contiguous: candle's CUDA matmul refuses strided operands (its CPU matmul does not).
                let x = input.tokens.to_dtype(DType::F32)?.contiguous()?;
                let f = w.matmul(&x)?.squeeze(1)?.to_dtype(input.tokens.dtype())?;
                Some(FusedTokens { tokens: f, present })
            }
        };
        Ok(KeepPlan {
            indices,
            fused,
            num_prefix: p,
        })
    }
}
