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
use crate::input::{cls_attn_sum, value_norms, KeepPlan, PruneInput};
use crate::select::{ceil_count, finish, map_rows, sane};
use crate::{Mode, Needs, PruneSite, PrunerKind, TokenPruner};

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

/// Inverse-transform sampling over one image's patch scores (any non-negative weights;
/// normalised here). Returns positions into `scores` (deduplicated, unordered).
pub fn inverse_transform_sample(scores: &[f32], k: usize) -> Vec<usize> {
    let n = scores.len();
    if n <= 1 {
        return (0..n).collect();
    }
    let w: Vec<f64> = scores
        .iter()
        .map(|&s| {
            let s = sane(s) as f64;
            if s.is_finite() && s > 0.0 {
                s
            } else {
                0.0
            }
        })
        .collect();
    let total: f64 = w.iter().sum();
    let w: Vec<f64> = if total > 0.0 {
        w.iter().map(|x| x / total).collect()
    } else {
        vec![1.0 / n as f64; n]
    };
    // Ascending weight, ties by position: a total order, so the unstable sort of (weight,
    // position) pairs gives the stable sort's order without indexing back into `w`.
    let mut keyed: Vec<(f64, usize)> = w.iter().copied().zip(0..n).collect();
    keyed.sort_unstable_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let order: Vec<usize> = keyed.into_iter().map(|(_, j)| j).collect();
    let mut cdf = Vec::with_capacity(n);
    let mut acc = 0.0;
    for &j in &order {
        acc += w[j];
        cdf.push(acc);
    }
    let (lo, hi) = (cdf[0], cdf[n - 1]);
    if hi - lo <= 0.0 {
        return vec![order[n - 1]];
    }
    let ncdf: Vec<f64> = cdf.iter().map(|c| (c - lo) / (hi - lo)).collect();
    let y0 = ncdf
        .iter()
        .copied()
        .filter(|&c| c > 0.0)
        .fold(f64::INFINITY, f64::min);
    let y0 = if y0.is_finite() { y0 } else { 1.0 };
    let k = k.max(1);
    let mut picked = vec![false; n];
    for i in 0..k {
        let y = if k == 1 {
            1.0
        } else {
            y0 + i as f64 * (1.0 - y0) / (k - 1) as f64
        };
        picked[nearest_first(&ncdf, y)] = true;
    }
    picked
        .iter()
        .enumerate()
        .filter(|(_, &p)| p)
        .map(|(s, _)| order[s])
        .collect()
}

/// The position in ascending `sorted` of the value nearest to `y`, the lowest position on ties
/// (equal distances, repeated values): the first point at or above `y` against the first
/// occurrence of the last value below it. O(log n), where scanning was O(n) per sample point.
fn nearest_first(sorted: &[f64], y: f64) -> usize {
    let above = sorted.partition_point(|&c| c < y);
    if above == 0 {
        return 0;
    }
    let below_value = sorted[above - 1];
    let below = sorted.partition_point(|&c| c < below_value);
    if above == sorted.len() || (y - below_value).abs() <= (y - sorted[above]).abs() {
        below
    } else {
        above
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

    fn plan(&self, input: &PruneInput) -> Result<KeepPlan> {
        let g = input.validate()?;
        let scores = self.scores(input)?.to_vec2::<f32>()?;
        let p = g.num_prefix;
        // Per image, in parallel for large batches (see map_rows).
        let indices = map_rows(&scores, |b, row| {
            let len = g.lengths[b];
            let n_patch = len - p;
            let k = match self.config.mode {
                AtsMode::Fixed { keep_ratio } => ceil_count(keep_ratio, n_patch),
                AtsMode::Adaptive { max_samples } => max_samples,
            };
            let picked = inverse_transform_sample(&row[p..len], k);
            finish(p, picked.into_iter().map(|j| j + p).collect())
        });
        Ok(KeepPlan {
            indices,
            fused: None,
            num_prefix: p,
        })
    }
}

#[cfg(test)]
mod tests {
    /// The binary search picks exactly what a scan for the first minimum distance picks,
    /// including repeated CDF values (zero-weight tokens) and points exactly between two values.
    #[test]
    fn nearest_first_equals_a_scan() {
        let scan = |sorted: &[f64], y: f64| {
            let mut best = (0, f64::INFINITY);
            for (s, &c) in sorted.iter().enumerate() {
                let d = (y - c).abs();
                if d < best.1 {
                    best = (s, d);
                }
            }
            best.0
        };
        let mut state = 12345u64;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) as f64 / (1u64 << 31) as f64
        };
        for n in [1usize, 2, 3, 7, 64, 196] {
            for _ in 0..200 {
                // Coarse values so that repeats and exact midpoints occur.
                let mut v: Vec<f64> = (0..n).map(|_| (next() * 8.0).floor() / 8.0).collect();
                v.sort_by(f64::total_cmp);
                for y in [0.0, 1.0, 0.5, 0.0625, 0.1875, next(), next(), -1.0, 2.0] {
                    assert_eq!(super::nearest_first(&v, y), scan(&v, y), "{v:?} y={y}");
                }
            }
        }
    }
}
