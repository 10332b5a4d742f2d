//! Host-side, deterministic selection helpers shared by the pruners.
//!
//! All orderings break ties by the lower token index, and NaN scores rank below every number,
//! so two execution paths that see bit-identical scores make identical decisions.

use std::cmp::Ordering;

/// Maps NaN to -inf so that it never wins a ranking nor passes a threshold.
#[inline]
pub(crate) fn sane(x: f32) -> f32 {
    if x.is_nan() {
        f32::NEG_INFINITY
    } else {
        x
    }
}

/// Descending by score, ties → lower index first.
#[inline]
pub(crate) fn cmp_desc(a: (usize, f32), b: (usize, f32)) -> Ordering {
    sane(b.1).total_cmp(&sane(a.1)).then(a.0.cmp(&b.0))
}

/// Positions `from..to` of `row` ordered by descending score (ties: lower position first).
pub(crate) fn rank_desc(row: &[f32], from: usize, to: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (from..to).collect();
    idx.sort_by(|&a, &b| cmp_desc((a, row[a]), (b, row[b])));
    idx
}

/// `ceil(ratio · n)` clamped to `[1, n]`, evaluated in f64 like Python's `math.ceil(r * n)`.
pub(crate) fn ceil_count(ratio: f64, n: usize) -> usize {
    ((ratio * n as f64).ceil() as usize).clamp(1, n.max(1))
}

/// Prefix positions followed by the chosen patch positions, ascending.
pub(crate) fn finish(num_prefix: usize, mut patches: Vec<usize>) -> Vec<u32> {
    patches.sort_unstable();
    patches.dedup();
    (0..num_prefix)
        .chain(patches)
        .map(|i| i as u32)
        .collect::<Vec<u32>>()
}

/// Top-`k` positions in `from..to` by descending score.
pub(crate) fn top_k(row: &[f32], from: usize, to: usize, k: usize) -> Vec<usize> {
    let mut r = rank_desc(row, from, to);
    r.truncate(k.max(1));
    r
}

/// Positions in `from..to` whose score passes `keep`; if none passes, the single best one.
pub(crate) fn keep_where(
    row: &[f32],
    from: usize,
    to: usize,
    keep: impl Fn(f32) -> bool,
) -> Vec<usize> {
    let kept: Vec<usize> = (from..to).filter(|&j| keep(row[j])).collect();
    if kept.is_empty() {
        top_k(row, from, to, 1)
    } else {
        kept
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ties_break_to_lower_index() {
        let row = [9.0, 1.0, 2.0, 2.0, f32::NAN, 2.0];
        assert_eq!(rank_desc(&row, 1, 6), vec![2, 3, 5, 1, 4]);
        assert_eq!(top_k(&row, 1, 6, 2), vec![2, 3]);
    }

    #[test]
    fn ceil_count_clamps() {
        assert_eq!(ceil_count(0.7, 196), 138);
        assert_eq!(ceil_count(0.0, 10), 1);
        assert_eq!(ceil_count(1.5, 10), 10);
        assert_eq!(ceil_count(0.5, 1), 1);
    }

    #[test]
    fn keep_where_falls_back_to_best() {
        let row = [0.0, 1.0, 3.0, 2.0];
        assert_eq!(keep_where(&row, 1, 4, |x| x > 10.0), vec![2]);
        assert_eq!(keep_where(&row, 1, 4, |x| x >= 2.0), vec![2, 3]);
    }

    #[test]
    fn finish_prepends_prefix_sorted() {
        assert_eq!(finish(2, vec![7, 3, 5]), vec![0, 1, 3, 5, 7]);
    }
}
