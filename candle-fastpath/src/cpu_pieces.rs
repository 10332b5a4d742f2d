//! What the CPU kernels of this crate (`linear_cpu`, `norm_cpu`, `gelu_cpu`) share: one pass
//! split over rayon's current pool (inside a model's forward, candle's pool,
//! `Device::with_context`, where the matmuls run too), and f16 / bf16 values widened to f32 and
//! narrowed back that way.

use std::borrow::Cow;
use std::mem::MaybeUninit;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Layout, Storage};
use candle_ragged::half_cpu::HalfSlice;

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

/// A new vector of `len` values written by `f(offset, piece)` over the pieces of
/// [`for_pieces`]; each task zero-fills its own piece just before `f` writes it. Why: a
/// `vec![0; len]` is a serial memset by the calling thread before the parallel pass, which at 16
/// threads took longer than the pass itself (a DeiT-S LayerNorm at batch 8: ~300 µs on the
/// 16-core host for work of ~25 µs a thread); a piece's zeros stay in its task's cache.
pub(crate) fn collect_pieces<T: Copy + Default + Send>(
    len: usize,
    unit: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) -> Vec<T> {
    let mut out = Vec::with_capacity(len);
    for_pieces(&mut out.spare_capacity_mut()[..len], unit, |at, piece| {
        piece.fill(MaybeUninit::new(T::default()));
        // SAFETY: every value of `piece` was initialised on the line above; MaybeUninit<T> has
        // T's layout.
        let piece = unsafe { &mut *(piece as *mut [MaybeUninit<T>] as *mut [T]) };
        f(at, piece)
    });
    // SAFETY: the pieces of for_pieces cover the first `len` values, each initialised above.
    unsafe { out.set_len(len) };
    out
}

/// `src` widened to f32, in pieces over rayon's pool.
pub(crate) fn widen<T: HalfSlice>(src: &[T]) -> Vec<f32> {
    collect_pieces(src.len(), 64, |at, d| T::widen(&src[at..at + d.len()], d))
}

/// `src` narrowed from f32, in pieces over rayon's pool.
pub(crate) fn narrow<T: HalfSlice>(src: &[f32]) -> Vec<T> {
    collect_pieces(src.len(), 64, |at, d| T::narrow(&src[at..at + d.len()], d))
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

/// The values of a contiguous CPU tensor's `storage` (held by the caller) as f32: borrowed for
/// f32, widened into a copy for f16 / bf16. `op` and `what` name them in the errors.
pub(crate) fn storage_f32<'g>(
    storage: &'g Storage,
    layout: &Layout,
    op: &str,
    what: &str,
) -> candle_core::Result<Cow<'g, [f32]>> {
    let Storage::Cpu(s) = storage else {
        candle_core::bail!("{op} (CPU): the {what} is not on the CPU")
    };
    f32_values(s, layout, op, what)
}
