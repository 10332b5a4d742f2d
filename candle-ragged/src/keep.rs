//! Keep rules: which of a sequence's scored tokens survive a pruning step.
//!
//! A [`KeepRule`] turns one sequence's per-token scores into the set of token positions it keeps.
//! [`KeepRule::keep`] is the host implementation: the pruners decide with it on the host, the CPU
//! path of [`crate::select_by_rule`] calls it, and the CUDA kernel repeats it operation for
//! operation (the same comparisons, f64 sums in the same order, the same rounding), so host and
//! device decisions agree bit for bit given bit-identical scores.
//!
//! Order of scores everywhere: f32's total order with NaN as `-inf` (NaN never wins a ranking nor
//! passes a threshold), ties to the lower position.

use std::cmp::Ordering;

use crate::error::{RaggedError, Result};
use crate::select::DroppedFusion;

/// How many tokens a count-based rule takes out of the `n` a sequence offers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KeepCount {
    /// `k` tokens.
    Exactly(usize),
    /// `ceil(ratio · n)` tokens, evaluated in f64 like Python's `math.ceil(r * n)`.
    CeilRatio(f64),
}

impl KeepCount {
    /// The count for `n` tokens, in `1..=n` (`n` ≥ 1).
    pub fn of(self, n: usize) -> usize {
        match self {
            KeepCount::Exactly(k) => k.clamp(1, n.max(1)),
            KeepCount::CeilRatio(r) => ceil_count(r, n),
        }
    }

    /// Sample points of [`KeepRule::InverseTransform`]: `Exactly(k)` is not limited by `n`.
    fn samples(self, n: usize) -> usize {
        match self {
            KeepCount::Exactly(k) => k.max(1),
            KeepCount::CeilRatio(r) => ceil_count(r, n),
        }
    }

    fn validate(self) -> Result<()> {
        match self {
            KeepCount::Exactly(_) => Ok(()),
            KeepCount::CeilRatio(r) if r.is_finite() && r > 0.0 => Ok(()),
            KeepCount::CeilRatio(r) => Err(rule_error(format!(
                "a keep ratio must be finite and positive, got {r}"
            ))),
        }
    }
}

/// Which scored tokens a sequence keeps. Every rule keeps at least one token of a non-empty
/// sequence: the threshold rules fall back to the best-scoring one when none passes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KeepRule {
    /// The best-scoring `count` tokens (top-k).
    Top(KeepCount),
    /// Tokens scoring `>= t`.
    AtLeast(f32),
    /// Tokens scoring `> t`.
    Above(f32),
    /// Tokens scoring `>= t`, `t = factor · mean score of the sequence` (the mean summed in f64 in
    /// position order, `t` rounded to f32).
    AtLeastMeanTimes(f32),
    /// The smallest best-first set whose mass `max(score, 0)` reaches `share` of the sequence's
    /// total (f64 sums in rank order).
    MassShare(f64),
    /// Inverse-transform sampling (ATS): the scores, clamped to `[0, ∞)` and normalised, sorted
    /// ascending; `samples` evenly spaced points from the smallest non-zero normalised-CDF value to
    /// 1 each pick the token whose normalised CDF is nearest (the lower one on ties); duplicates
    /// collapse, so at most `samples` tokens are kept.
    InverseTransform { samples: KeepCount },
}

impl KeepRule {
    /// Checks the rule's parameters (ratios and shares finite and positive, shares at most 1).
    pub fn validate(&self) -> Result<()> {
        match *self {
            KeepRule::Top(c) | KeepRule::InverseTransform { samples: c } => c.validate(),
            KeepRule::AtLeast(_) | KeepRule::Above(_) | KeepRule::AtLeastMeanTimes(_) => Ok(()),
            KeepRule::MassShare(s) if s.is_finite() && s > 0.0 && s <= 1.0 => Ok(()),
            KeepRule::MassShare(s) => Err(rule_error(format!(
                "a mass share must be in (0, 1], got {s}"
            ))),
        }
    }

    /// For rules that keep the same number of tokens whatever the scores ([`KeepRule::Top`]):
    /// that number out of `n`.
    pub fn fixed_count(&self, n: usize) -> Option<usize> {
        match *self {
            KeepRule::Top(c) => Some(c.of(n)),
            _ => None,
        }
    }

    /// The most tokens this rule can keep out of `n` (`n` ≥ 1), whatever the scores: the count of
    /// [`KeepRule::Top`], the sample points of [`KeepRule::InverseTransform`] (duplicates only
    /// lower it), `n` for the threshold and mass rules.
    pub fn max_kept(&self, n: usize) -> usize {
        match *self {
            KeepRule::Top(c) => c.of(n),
            KeepRule::InverseTransform { samples } => samples.samples(n).min(n),
            KeepRule::AtLeast(_)
            | KeepRule::Above(_)
            | KeepRule::AtLeastMeanTimes(_)
            | KeepRule::MassShare(_) => n,
        }
    }

    /// The kept positions among `from..to` of `row` (ascending; at least one when `from < to`).
    pub fn keep(&self, row: &[f32], from: usize, to: usize) -> Vec<usize> {
        let n = to.saturating_sub(from);
        let mut kept = match *self {
            KeepRule::Top(count) => top_k(row, from, to, count.of(n)),
            KeepRule::AtLeast(t) => keep_where(row, from, to, |x| x >= t),
            KeepRule::Above(t) => keep_where(row, from, to, |x| x > t),
            KeepRule::AtLeastMeanTimes(factor) => {
                let mean = row[from..to].iter().map(|&x| x as f64).sum::<f64>() / n as f64;
                let t = (factor as f64 * mean) as f32;
                keep_where(row, from, to, |x| x >= t)
            }
            KeepRule::MassShare(share) => {
                let ranked = rank_desc(row, from, to);
                let mass = |j: usize| sane(row[j]).max(0.0) as f64;
                let total: f64 = ranked.iter().map(|&j| mass(j)).sum();
                let target = share * total;
                let mut acc = 0.0;
                let mut k = n;
                for (i, &j) in ranked.iter().enumerate() {
                    acc += mass(j);
                    if acc >= target {
                        k = i + 1;
                        break;
                    }
                }
                let mut kept = ranked;
                kept.truncate(k.max(1));
                kept
            }
            KeepRule::InverseTransform { samples } => {
                inverse_transform_sample(&row[from..to], samples.samples(n))
                    .into_iter()
                    .map(|j| j + from)
                    .collect()
            }
        };
        kept.sort_unstable();
        kept
    }
}

/// The weight of each `dropped` position of `row` (ascending) in the row fused from them (EViT's
/// extra token): `max(score, 0)` (NaN: 0) for [`DroppedFusion::WeightedSum`]; for
/// [`DroppedFusion::WeightedMean`] divided by their total, summed in f64 in position order, or
/// `1 / dropped.len()` each when that total is 0. The host pruner, the CPU op and (operation for
/// operation) the CUDA kernel of [`crate::select_by_rule`] all use these weights.
pub fn fusion_weights(row: &[f32], dropped: &[usize], fusion: DroppedFusion) -> Vec<f32> {
    let w: Vec<f64> = dropped
        .iter()
        .map(|&j| sane(row[j]).max(0.0) as f64)
        .collect();
    let total: f64 = w.iter().sum();
    w.iter()
        .map(|&wj| match fusion {
            DroppedFusion::WeightedSum => wj as f32,
            DroppedFusion::WeightedMean if total > 0.0 => (wj / total) as f32,
            DroppedFusion::WeightedMean => (1.0 / dropped.len() as f64) as f32,
        })
        .collect()
}

fn rule_error(m: String) -> RaggedError {
    RaggedError::Candle(candle_core::Error::Msg(format!("keep rule: {m}")))
}

/// Maps NaN to -inf so that it never wins a ranking nor passes a threshold.
#[inline]
pub fn sane(x: f32) -> f32 {
    if x.is_nan() {
        f32::NEG_INFINITY
    } else {
        x
    }
}

/// Descending by score, ties → lower index first.
#[inline]
fn cmp_desc(a: (usize, f32), b: (usize, f32)) -> Ordering {
    sane(b.1).total_cmp(&sane(a.1)).then(a.0.cmp(&b.0))
}

/// Positions `from..to` of `row` ordered by descending score (ties: lower position first).
/// O(n log n); [`top_k`] is O(n) where only the top set matters.
pub fn rank_desc(row: &[f32], from: usize, to: usize) -> Vec<usize> {
    let mut keyed = keyed(row, from, to);
    // The comparator is a total order (position breaks ties), so the unstable sort gives the
    // same order as a stable one.
    keyed.sort_unstable_by(|a, b| cmp_desc((a.1, a.0), (b.1, b.0)));
    keyed.into_iter().map(|(_, j)| j).collect()
}

/// `(score, position)` pairs, so comparisons do not index back into the row.
fn keyed(row: &[f32], from: usize, to: usize) -> Vec<(f32, usize)> {
    (from..to).map(|j| (row[j], j)).collect()
}

/// `ceil(ratio · n)` clamped to `[1, n]`, evaluated in f64 like Python's `math.ceil(r * n)`.
pub fn ceil_count(ratio: f64, n: usize) -> usize {
    ((ratio * n as f64).ceil() as usize).clamp(1, n.max(1))
}

/// Top-`k` positions in `from..to` by descending score (as a set, unordered). O(n): a selection,
/// not a sort.
pub fn top_k(row: &[f32], from: usize, to: usize, k: usize) -> Vec<usize> {
    let k = k.max(1);
    let mut keyed = keyed(row, from, to);
    if k < keyed.len() {
        keyed.select_nth_unstable_by(k - 1, |a, b| cmp_desc((a.1, a.0), (b.1, b.0)));
    }
    keyed.truncate(k);
    keyed.into_iter().map(|(_, j)| j).collect()
}

/// Positions in `from..to` whose score passes `keep`; if none passes, the single best one.
fn keep_where(row: &[f32], from: usize, to: usize, keep: impl Fn(f32) -> bool) -> Vec<usize> {
    let kept: Vec<usize> = (from..to).filter(|&j| keep(row[j])).collect();
    if kept.is_empty() {
        top_k(row, from, to, 1)
    } else {
        kept
    }
}

/// Inverse-transform sampling over one sequence's scores (any weights; clamped to `[0, ∞)` and
/// normalised here) with `k` sample points. Returns positions into `scores` (deduplicated,
/// unordered). See [`KeepRule::InverseTransform`].
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
/// occurrence of the last value below it. O(log n).
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `max_kept` bounds what `keep` returns for any scores (here: random rows with ties, NaN and
    /// zeros, every length up to 200), and is reached by the count rules.
    #[test]
    fn max_kept_bounds_every_decision() {
        let rules = [
            KeepRule::Top(KeepCount::CeilRatio(0.7)),
            KeepRule::Top(KeepCount::Exactly(5)),
            KeepRule::AtLeast(0.5),
            KeepRule::Above(0.5),
            KeepRule::AtLeastMeanTimes(1.0),
            KeepRule::MassShare(0.9),
            KeepRule::InverseTransform {
                samples: KeepCount::CeilRatio(0.7),
            },
            KeepRule::InverseTransform {
                samples: KeepCount::Exactly(40),
            },
        ];
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for n in 1..=200usize {
            let row: Vec<f32> = (0..n)
                .map(|_| match next() % 16 {
                    0 => f32::NAN,
                    1 => 0.0,
                    v => (v % 5) as f32 / 4.0,
                })
                .collect();
            for rule in rules {
                let kept = rule.keep(&row, 0, n).len();
                assert!(
                    (1..=rule.max_kept(n)).contains(&kept),
                    "{rule:?} n={n}: kept {kept}, bound {}",
                    rule.max_kept(n)
                );
                if let KeepRule::Top(_) = rule {
                    assert_eq!(kept, rule.max_kept(n), "{rule:?} n={n}");
                }
            }
        }
    }

    #[test]
    fn ties_break_to_lower_index() {
        let row = [9.0, 1.0, 2.0, 2.0, f32::NAN, 2.0];
        assert_eq!(rank_desc(&row, 1, 6), vec![2, 3, 5, 1, 4]);
        assert_eq!(
            KeepRule::Top(KeepCount::Exactly(2)).keep(&row, 1, 6),
            vec![2, 3]
        );
    }

    #[test]
    fn ceil_count_clamps() {
        assert_eq!(ceil_count(0.7, 196), 138);
        assert_eq!(ceil_count(0.0, 10), 1);
        assert_eq!(ceil_count(1.5, 10), 10);
        assert_eq!(ceil_count(0.5, 1), 1);
        assert_eq!(KeepCount::Exactly(500).of(10), 10);
        assert_eq!(KeepCount::Exactly(0).of(10), 1);
    }

    #[test]
    fn thresholds_fall_back_to_the_best() {
        let row = [0.0, 1.0, 3.0, 2.0];
        assert_eq!(KeepRule::AtLeast(10.0).keep(&row, 1, 4), vec![2]);
        assert_eq!(KeepRule::AtLeast(2.0).keep(&row, 1, 4), vec![2, 3]);
        assert_eq!(KeepRule::Above(2.0).keep(&row, 1, 4), vec![2]);
        assert_eq!(KeepRule::Above(f32::NAN).keep(&row, 1, 4), vec![2]);
        // mean of 1, 3, 2 is 2: factor 1 keeps 3 and 2.
        assert_eq!(KeepRule::AtLeastMeanTimes(1.0).keep(&row, 1, 4), vec![2, 3]);
    }

    #[test]
    fn mass_share_keeps_the_smallest_best_first_set() {
        let row = [0.0, 0.125, 0.5, 0.25, 0.125];
        // Total 1; 0.5 holds half, 0.5 + 0.25 three quarters.
        assert_eq!(KeepRule::MassShare(0.5).keep(&row, 1, 5), vec![2]);
        assert_eq!(KeepRule::MassShare(0.75).keep(&row, 1, 5), vec![2, 3]);
        assert_eq!(KeepRule::MassShare(1.0).keep(&row, 1, 5).len(), 4);
        // No mass at all: every token is needed to reach 0 ≥ 0 at the first one.
        assert_eq!(
            KeepRule::MassShare(0.5).keep(&[0.0, 0.0, 0.0], 0, 3),
            vec![0]
        );
    }

    #[test]
    fn validate_rejects_bad_parameters() {
        assert!(KeepRule::MassShare(0.0).validate().is_err());
        assert!(KeepRule::MassShare(1.5).validate().is_err());
        assert!(KeepRule::Top(KeepCount::CeilRatio(f64::NAN))
            .validate()
            .is_err());
        assert!(KeepRule::InverseTransform {
            samples: KeepCount::CeilRatio(-1.0)
        }
        .validate()
        .is_err());
        assert!(KeepRule::Top(KeepCount::CeilRatio(0.7)).validate().is_ok());
    }

    /// The O(n) selection keeps exactly the set the full ranking's first k would, ties and NaN
    /// included.
    #[test]
    fn top_k_equals_ranking_prefix() {
        let mut state = 7u64;
        let mut next = move || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 40) % 16
        };
        for n in [1usize, 2, 5, 64, 197] {
            for trial in 0..100 {
                let row: Vec<f32> = (0..n)
                    .map(|j| {
                        if (j + trial) % 29 == 0 {
                            f32::NAN
                        } else {
                            next() as f32
                        }
                    })
                    .collect();
                for k in [1, n / 3, n / 2, n.saturating_sub(1), n] {
                    let mut want = rank_desc(&row, 0, n);
                    want.truncate(k.max(1));
                    want.sort_unstable();
                    let mut got = top_k(&row, 0, n, k);
                    got.sort_unstable();
                    assert_eq!(got, want, "n={n} k={k} row={row:?}");
                }
            }
        }
    }

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
                    assert_eq!(nearest_first(&v, y), scan(&v, y), "{v:?} y={y}");
                }
            }
        }
    }
}
