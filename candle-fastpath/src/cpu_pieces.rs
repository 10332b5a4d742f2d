//! One pass of a CPU kernel split over rayon's current pool: the CPU kernels of this crate
//! (`linear_cpu`, `norm_cpu`, `gelu_cpu`) run their passes this way. Inside a model's forward
//! the current pool is candle's (`Device::with_context`), where the matmuls run too.

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
