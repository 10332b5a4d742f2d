//! Small helpers shared by the CPU implementations of the ops.

use half::{bf16, f16};
use rayon::prelude::*;

/// The element types the ops accept, widened to f32 for arithmetic.
pub(crate) trait Float32: Copy + Send + Sync {
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
    /// The slice itself when the type is f32 (read in place, nothing widened).
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
}

impl Float32 for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(x: f32) -> Self {
        x
    }
    fn as_f32(s: &[f32]) -> Option<&[f32]> {
        Some(s)
    }
}

impl Float32 for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}

impl Float32 for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

/// Splits `out` (packed rows of `row_len` elements) into one slice per sequence and runs
/// `f(first_row, rows, slice)` on each, in parallel.
pub(crate) fn for_each_sequence<T, F>(out: &mut [T], offsets: &[u32], row_len: usize, f: F)
where
    T: Send,
    F: Fn(usize, usize, &mut [T]) + Sync,
{
    let mut parts = Vec::with_capacity(offsets.len().saturating_sub(1));
    let mut rest = out;
    for w in offsets.windows(2) {
        let (start, len) = (w[0] as usize, (w[1] - w[0]) as usize);
        let (head, tail) = rest.split_at_mut(len * row_len);
        parts.push((start, len, head));
        rest = tail;
    }
    parts
        .into_par_iter()
        .for_each(|(start, len, slice)| f(start, len, slice));
}
