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
/// O(n log n); [`partition_top_k`] is O(n) where only the top set matters.
pub(crate) fn rank_desc(row: &[f32], from: usize, to: usize) -> Vec<usize> {
    let mut keyed = keyed(row, from, to);
    // The comparator is a total order (position breaks ties), so the unstable sort gives the
    // same order as a stable one.
    keyed.sort_unstable_by(|a, b| cmp_desc((a.1, a.0), (b.1, b.0)));
    keyed.into_iter().map(|(_, j)| j).collect()
}

/// Positions `from..to` of `row` with the top `k` (descending score, ties: lower position first)
/// first, in unspecified order, and the others after them, also unordered. O(n).
pub(crate) fn partition_top_k(row: &[f32], from: usize, to: usize, k: usize) -> Vec<usize> {
    let mut keyed = keyed(row, from, to);
    if k > 0 && k < keyed.len() {
        keyed.select_nth_unstable_by(k - 1, |a, b| cmp_desc((a.1, a.0), (b.1, b.0)));
    }
    keyed.into_iter().map(|(_, j)| j).collect()
}

/// `(score, position)` pairs, so comparisons do not index back into the row.
fn keyed(row: &[f32], from: usize, to: usize) -> Vec<(f32, usize)> {
    (from..to).map(|j| (row[j], j)).collect()
}

/// Images at or above which [`map_rows`] hands rows to rayon's pool: below it, waking the pool
/// costs more than the selections.
const PARALLEL_MIN_ROWS: usize = 32;

/// `f(b, row)` for every image's score row, in image order; on rayon's pool for large batches
/// (the selections are independent, and at batch 256 they are host time the GPU waits on).
pub(crate) fn map_rows<T: Send>(
    rows: &[Vec<f32>],
    f: impl Fn(usize, &Vec<f32>) -> T + Sync + Send,
) -> Vec<T> {
    use rayon::prelude::*;
    if rows.len() >= PARALLEL_MIN_ROWS {
        rows.par_iter().enumerate().map(|(b, r)| f(b, r)).collect()
    } else {
        rows.iter().enumerate().map(|(b, r)| f(b, r)).collect()
    }
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

/// Top-`k` positions in `from..to` by descending score (as a set, unordered: callers sort
/// the kept positions).
pub(crate) fn top_k(row: &[f32], from: usize, to: usize, k: usize) -> Vec<usize> {
    let k = k.max(1);
    let mut r = partition_top_k(row, from, to, k);
    r.truncate(k);
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

    /// The O(n) selection keeps exactly the set the full ranking's first k would, ties and NaN
    /// included.
    #[test]
    fn partition_top_k_equals_ranking_prefix() {
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
                    let split = partition_top_k(&row, 0, n, k.max(1));
                    assert_eq!(split.len(), n);
                }
            }
        }
    }
}
