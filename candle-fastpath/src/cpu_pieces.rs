//! What the CPU kernels of this crate (`linear_cpu`, `norm_cpu`, `gelu_cpu`) share: one pass
//! split over rayon's current pool (inside a model's forward, candle's pool,
//! `Device::with_context`, where the matmuls run too), and f16 / bf16 values widened to f32 and
//! narrowed back that way.

use std::borrow::Cow;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Layout};
use half::slice::HalfFloatSliceExt;

/// From this many values a pass is split over the pool (candle splits its own elementwise ops
/// from 64 K values too); below, the calling thread runs it alone.
const PARALLEL_MIN: usize = 1 << 16;

/// `f(offset, piece)` over consecutive pieces of `dst` that start at `offset`, one a thread of
/// the pool, each a whole number of `unit` values but the last, from [`PARALLEL_MIN`] values;
/// `f(0, dst)` below.
pub(crate) fn for_pieces<D: Send>(dst: &mut [D], unit: usize, f: impl Fn(usize, &mut [D]) + Sync) {
    if dst.len() < PARALLEL_MIN {
        return f(0, dst);
    }
    let piece = dst
        .len()
        .div_ceil(rayon::current_num_threads().max(1))
        .next_multiple_of(unit.max(1));
    let f = &f;
    rayon::scope(|s| {
        for (i, d) in dst.chunks_mut(piece).enumerate() {
            s.spawn(move |_| f(i * piece, d));
        }
    });
}

/// `src` widened to f32, in pieces over rayon's pool.
pub(crate) fn widen<T: Copy + Sync>(src: &[T]) -> Vec<f32>
where
    [T]: HalfFloatSliceExt,
{
    let mut out = vec![0f32; src.len()];
    for_pieces(&mut out, 64, |at, d| {
        src[at..at + d.len()].convert_to_f32_slice(d)
    });
    out
}

/// `src` narrowed from f32, in pieces over rayon's pool.
pub(crate) fn narrow<T: Copy + Default + Send>(src: &[f32]) -> Vec<T>
where
    [T]: HalfFloatSliceExt,
{
    let mut out = vec![T::default(); src.len()];
    for_pieces(&mut out, 64, |at, d| {
        d.convert_from_f32_slice(&src[at..at + d.len()])
    });
    out
}

/// The values of a contiguous f32 / f16 / bf16 CPU storage as f32: borrowed for f32, widened
/// into a copy for f16 / bf16. `op` and `what` name them in the errors.
pub(crate) fn f32_values<'a>(
    s: &'a CpuStorage,
    l: &Layout,
    op: &str,
    what: &str,
) -> candle_core::Result<Cow<'a, [f32]>> {
    let Some((start, end)) = l.contiguous_offsets() else {
        candle_core::bail!("{op} (CPU): {what} is not contiguous")
    };
    Ok(match s {
        CpuStorage::F32(v) => Cow::Borrowed(&v[start..end]),
        CpuStorage::F16(v) => Cow::Owned(widen(&v[start..end])),
        CpuStorage::BF16(v) => Cow::Owned(widen(&v[start..end])),
        other => candle_core::bail!(
            "{op} (CPU): {what} is {:?}, not f32, f16 or bf16",
            other.dtype()
        ),
    })
}
