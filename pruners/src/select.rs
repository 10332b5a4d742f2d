//! Host-side decisions shared by the pruners: a [`KeepRule`] applied to every image's score row.
//!
//! The rules themselves live in [`candle_ragged::keep`], so that the host decision here, the CPU
//! op and the CUDA kernel of [`candle_ragged::select_by_rule`] are one definition: ties break to
//! the lower token index and NaN scores rank below every number, so two execution paths that
//! see bit-identical scores make identical decisions.

use candle_core::Tensor;
use candle_ragged::KeepRule;

use crate::error::Result;
use crate::input::Geometry;

/// Images at or above which [`map_rows`] hands rows to rayon's pool: below it, waking the pool
/// costs more than the selections.
const PARALLEL_MIN_ROWS: usize = 32;

/// `f(b, row)` for every image's score row, in image order; on rayon's pool for large batches
/// (the selections are independent, and at batch 256 they are host time the GPU waits on).
fn map_rows<T: Send>(rows: &[Vec<f32>], f: impl Fn(usize, &Vec<f32>) -> T + Sync + Send) -> Vec<T> {
    use rayon::prelude::*;
    if rows.len() >= PARALLEL_MIN_ROWS {
        rows.par_iter().enumerate().map(|(b, r)| f(b, r)).collect()
    } else {
        rows.iter().enumerate().map(|(b, r)| f(b, r)).collect()
    }
}

/// Per image: the kept positions (prefix first, ascending), and the image's score row.
pub(crate) struct Decisions {
    pub indices: Vec<Vec<u32>>,
    pub rows: Vec<Vec<f32>>,
}

/// Reads the `[B, N]` `scores` back (the one host sync of a pruning step) and applies `rule` to
/// every image's patch positions: per image, the prefix positions followed by the kept patch
/// positions, ascending. Also returns the score rows (EViT weighs its fused token with them).
pub(crate) fn decide(g: &Geometry, scores: &Tensor, rule: KeepRule) -> Result<Decisions> {
    let rows = scores.to_vec2::<f32>()?;
    let p = g.num_prefix;
    let indices = map_rows(&rows, |b, row| {
        let kept = rule.keep(row, p, g.lengths[b]);
        (0..p).chain(kept).map(|i| i as u32).collect::<Vec<u32>>()
    });
    Ok(Decisions { indices, rows })
}
