//! A pre-norm block's per-token steps on the CPU as one parallel pass over chunks of rows:
//! [`crate::block_after_attention`] (the attention's projection and residual add, norm2, fc1 +
//! GELU, fc2 and its residual add, and the next block's norm1 and qkv), [`crate::block_mlp`] (the
//! same from norm2), [`crate::residual_norm_linear`] (the projection or fc2 with its residual add,
//! the LayerNorm after it and the Linear after that) and [`crate::norm_linear`], where every
//! Linear holds packed panels ([`crate::cpu_packed`]) and the LayerNorm runs as ours
//! ([`crate::cpu_norm`]); `CANDLE_FASTPATH_CPU_ROWS=0` runs the layers one after another instead.
//!
//! Why: run as separate layers, each step is a parallel section of its own (a LayerNorm of fewer
//! than 64 K values runs on the calling thread alone), and at the end of every section each thread
//! waits for the slowest before the pool wakes for the next: on the H200 machine's 16-core host a
//! rayon section costs 8–16 µs beyond its work, beside 20–140 µs of work a step at DeiT-T batch 1
//! (docs/BENCHMARKS.md, the CPU section, stop 66). A row's steps need that row alone, so a chunk
//! of rows runs them all while its values are in cache: a block's six layers from its attention's
//! output to the next block's qkv (four parallel products, two LayerNorms on one thread) are one
//! pass.
//!
//! The same bits as the separate layers: each step is the layer's own code on the chunk's rows
//! (the packed product's tiles, whose values do not depend on how the rows and panels are split
//! into tasks, and the LayerNorm's row function), and f16 / bf16 values are rounded wherever the
//! layers store their outputs.

use std::ops::Range;
use std::sync::OnceLock;

use candle_core::{CpuStorage, DType, Layout, Storage, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

use crate::cpu_pieces::storage_f32;
use crate::error::Result;
use crate::packed_cpu::{Finish, PackedWeight};
use crate::{FusedLinear, LayerNorm};
use candle_ragged::half_cpu::HalfSlice;

/// Below this many multiply-adds the whole pass runs on the calling thread (the packed
/// product's threshold).
const PARALLEL_MIN: usize = 1 << 20;

/// Rows a chunk holds at most: past 24 rows a thread, several chunks a thread, so that a thread
/// that finishes early takes another. Measured on the H200 machine's 16-core host, DeiT-S / B at
/// batch 8 (1,576 rows), the model's block alone: chunks of ≤ 64 rows (two a thread) 0.90× the
/// layers one after another, of ≤ 128 rows 0.90×, of ≤ 24 rows (five a thread) 1.04–1.10×; at
/// batch 32 all three 1.07–1.20× (docs/BENCHMARKS.md, the CPU section, stop 67).
const CHUNK_ROWS: usize = 24;

/// Rows a chunk holds at least where there are that many: one AVX-512 tile.
const MIN_CHUNK_ROWS: usize = 8;

/// Whether [`crate::residual_norm_linear`], [`crate::norm_linear`], [`crate::block_mlp`] and
/// [`crate::block_after_attention`] run on the CPU as one pass over chunks of rows where that
/// pays: yes unless `CANDLE_FASTPATH_CPU_ROWS=0` (read once; the layers one after another, for
/// A/B measurements).
pub fn cpu_row_chunks() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    crate::switches::on_unless_off(&ON, "CANDLE_FASTPATH_CPU_ROWS")
}

/// An error the checks before a pass should have made impossible.
fn internal(msg: &str) -> crate::FastpathError {
    candle_core::Error::Msg(msg.to_string()).into()
}

/// A CPU dtype the steps run in: f32 values are used as they are, f16 / bf16 ones widened to
/// f32 for the arithmetic and rounded where a layer stores its output.
trait Elem: candle_core::WithDType {
    /// The values of a CPU storage of this dtype, if it is one.
    fn values(s: &CpuStorage) -> Option<&[Self]>;
    /// `src` as f32 into `dst` (the same length).
    fn load(src: &[Self], dst: &mut [f32]);
    /// `src` stored into `dst` in this dtype; `src` then holds what was stored, as f32.
    fn store(src: &mut [f32], dst: &mut [Self]);
    /// `v` rounded to this dtype in place (as if stored and read back).
    fn round(v: &mut [f32]);
}

impl Elem for f32 {
    fn values(s: &CpuStorage) -> Option<&[Self]> {
        match s {
            CpuStorage::F32(v) => Some(v),
            _ => None,
        }
    }
    fn load(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src)
    }
    fn store(src: &mut [f32], dst: &mut [Self]) {
        dst.copy_from_slice(src)
    }
    fn round(_: &mut [f32]) {}
}

macro_rules! half_elem {
    ($t:ty, $variant:ident) => {
        impl Elem for $t {
            fn values(s: &CpuStorage) -> Option<&[Self]> {
                match s {
                    CpuStorage::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn load(src: &[Self], dst: &mut [f32]) {
                <$t as HalfSlice>::widen(src, dst)
            }
            fn store(src: &mut [f32], dst: &mut [Self]) {
                <$t as HalfSlice>::narrow(src, dst);
                <$t as HalfSlice>::round(src);
            }
            fn round(v: &mut [f32]) {
                // The same bits as the slice conversions the layers store with.
                <$t as HalfSlice>::round(v)
            }
        }
    };
}
half_elem!(f16, F16);
half_elem!(bf16, BF16);

/// A Linear's panels and bias (as f32), as the chunks read them.
struct LinearParts<'a> {
    panels: &'a PackedWeight,
    bias: Option<std::borrow::Cow<'a, [f32]>>,
}

/// A LayerNorm's weight, bias (as f32) and eps.
struct NormParts<'a> {
    weight: std::borrow::Cow<'a, [f32]>,
    bias: std::borrow::Cow<'a, [f32]>,
    eps: f32,
}

/// A tensor's storage held for reading, with its layout.
type Held<'a> = (candle_core::StorageRef<'a>, &'a Layout);

/// The CPU storage and the range of values of a contiguous tensor, or `None`.
fn contiguous_cpu<'g>(held: &'g Held<'_>) -> Option<(&'g CpuStorage, Range<usize>)> {
    let Storage::Cpu(s) = &*held.0 else {
        return None;
    };
    let (a, b) = held.1.contiguous_offsets()?;
    Some((s, a..b))
}

/// Whether the layers can run here: every tensor on the CPU in `dtype` (f32, f16, bf16), every
/// Linear holding panels, the LayerNorms ours, and the switches on.
fn layers_apply(dtype: DType, linears: &[&FusedLinear], norms: &[&LayerNorm]) -> bool {
    cpu_row_chunks()
        && crate::cpu_norm()
        && matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
        && linears.iter().all(|l| {
            l.packed().is_some_and(|p| p.dtype() == dtype)
                && l.bias()
                    .is_none_or(|b| b.dtype() == dtype && b.device().is_cpu())
        })
        && norms
            .iter()
            .all(|n| n.weight().dtype() == dtype && n.weight().device().is_cpu())
}

/// Chunks of this many rows or more are always taken: past ~16 rows a chunk, keeping a row's
/// intermediate values in cache between the steps is worth more than the weights each chunk
/// streams (at batch 32, with 64-row chunks, 1.07–1.20× the layers for DeiT-T / S / B).
const SHORT_CHUNK_ROWS: usize = 16;

/// Shorter chunks are taken where the pass's weights are at most this many bytes a row of a
/// chunk: each chunk streams every weight of the pass through its core for its few rows, which
/// costs more than the sections it saves once the weights are wide.
const WEIGHT_BYTES_PER_SHORT_ROW: usize = 640 << 10;

/// How many rows a chunk takes of `rows`, for steps of `macs_per_row` multiply-adds a row over
/// `linears`: all of them on one thread below [`PARALLEL_MIN`]; otherwise a whole number of
/// chunks a thread (balanced), each of at most [`CHUNK_ROWS`] rows and, where there are enough
/// rows, at least [`MIN_CHUNK_ROWS`]. `None` (the layers one after another, which split each
/// product over its output columns too and so read each weight fewer times) where the chunks
/// would be shorter than [`SHORT_CHUNK_ROWS`] rows and the linears' weights exceed
/// [`WEIGHT_BYTES_PER_SHORT_ROW`] a row of a chunk. Measured on the H200 machine's 16-core host
/// with one image (197 rows, chunks of 13 on 16 threads; f32 weights after the attention, next
/// qkv included, 1.8 / 7.1 / 28 MB for DeiT-T / S / B, i.e. 0.14 / 0.54 / 2.2 MB a chunk row):
/// DeiT-T 1.15–1.74× the layers, DeiT-S 0.95–1.27× (three calls of four above 1.17), DeiT-B
/// 0.85–0.91×; DeiT-S's EViT rows (chunks of 9 rows after the first step, 0.79 MB a row)
/// 0.85–1.10×; at batch 8 (chunks of 20 rows) DeiT-T / S 1.05–1.16×, DeiT-B 0.99–1.10×
/// (docs/BENCHMARKS.md, the CPU section, stop 67). Where every linear runs on AMX tiles,
/// [`amx_chunk_plan`] instead.
fn chunk_rows(rows: usize, macs_per_row: usize, linears: &[&FusedLinear]) -> Option<usize> {
    let threads = rayon::current_num_threads().max(1);
    if linears.iter().all(|l| l.packed().is_some_and(|p| p.amx())) {
        return Some(amx_chunk_plan(rows, macs_per_row, threads));
    }
    let weight_bytes: usize = linears
        .iter()
        .filter_map(|l| l.packed())
        .map(|p| p.out() * p.depth() * p.dtype().size_in_bytes())
        .sum();
    chunk_plan(rows, macs_per_row, weight_bytes, threads)
}

/// Rows a chunk takes at most where every product of the pass runs on AMX tiles.
const AMX_CHUNK_ROWS: usize = 32;

/// [`chunk_rows`] where every linear runs on AMX tiles ([`crate::amx_cpu`]): chunks of whole
/// 16-row tiles (a partial tile computes its padding rows all the same), one a thread where the
/// rows allow, of at most [`AMX_CHUNK_ROWS`] rows, and no weight gate: the tiles multiply so
/// fast that a short chunk is not what costs. Measured on the H200 machine's 16-core host (AMX,
/// bf16; one binary, two rounds, against the plan above, which cuts 20-row chunks at batch 8
/// and declines DeiT-B at batch 1): DeiT-T / S at batch 8 1.05–1.11×, DeiT-B 1.10–1.28× at
/// batch 1 and 8, batch 1 of DeiT-T / S 0.87–1.07× (the spread); chunks of at most 16 rows
/// 0.89–1.30×, of at most 64 rows 0.89–1.16× (docs/BENCHMARKS.md, the CPU section, stop 68).
fn amx_chunk_plan(rows: usize, macs_per_row: usize, threads: usize) -> usize {
    if threads <= 1 || rows.saturating_mul(macs_per_row) < PARALLEL_MIN {
        return rows;
    }
    let tiles = rows.div_ceil(candle_ragged::amx::TILE_ROWS);
    let chunk_tiles = tiles
        .div_ceil(threads)
        .clamp(1, AMX_CHUNK_ROWS / candle_ragged::amx::TILE_ROWS);
    (chunk_tiles * candle_ragged::amx::TILE_ROWS).min(rows)
}

/// [`chunk_rows`] for weights of `weight_bytes` bytes on `threads` threads.
fn chunk_plan(
    rows: usize,
    macs_per_row: usize,
    weight_bytes: usize,
    threads: usize,
) -> Option<usize> {
    if threads <= 1 || rows.saturating_mul(macs_per_row) < PARALLEL_MIN {
        return Some(rows);
    }
    let per_thread = rows.div_ceil(threads * CHUNK_ROWS);
    let chunks = (threads * per_thread).min(rows.div_ceil(MIN_CHUNK_ROWS));
    let chunk = rows.div_ceil(chunks.max(1));
    (chunk >= SHORT_CHUNK_ROWS || weight_bytes <= WEIGHT_BYTES_PER_SHORT_ROW * chunk)
        .then_some(chunk)
}

/// A base pointer the chunks write their own rows through.
#[derive(Clone, Copy)]
struct Out<T>(*mut T);
// SAFETY: every chunk writes a disjoint range of rows (see `run_chunks`).
unsafe impl<T: Send> Send for Out<T> {}
unsafe impl<T: Send> Sync for Out<T> {}

impl<T> Out<T> {
    /// Rows `rows` (`width` values each) of the buffer.
    ///
    /// # Safety
    /// The buffer holds those rows, and no other live slice covers them.
    #[allow(clippy::mut_from_ref)]
    unsafe fn rows(&self, rows: &Range<usize>, width: usize) -> &mut [T] {
        // SAFETY: the caller's.
        unsafe {
            std::slice::from_raw_parts_mut(self.0.add(rows.start * width), rows.len() * width)
        }
    }
}

/// `work(rows, scratch)` over chunks of `rows` rows (`chunk` each, the last shorter), in parallel
/// on rayon's current pool when there is more than one; `scratch` a per-thread f32 buffer of at
/// least `scratch_per_row · chunk` values.
fn run_chunks(
    rows: usize,
    chunk: usize,
    scratch_per_row: usize,
    work: impl Fn(Range<usize>, &mut [f32]) + Sync,
) {
    // Kept per thread: a fresh buffer of a chunk's size can be a fresh mapping, whose page faults
    // cost more than the chunk's copies.
    thread_local!(static SCRATCH: std::cell::RefCell<Vec<f32>> = const {
        std::cell::RefCell::new(Vec::new())
    });
    let one = |c: usize| {
        let range = c * chunk..((c + 1) * chunk).min(rows);
        let mut scratch = SCRATCH.take();
        if scratch.len() < scratch_per_row * chunk {
            scratch.resize(scratch_per_row * chunk, 0.0);
        }
        work(range, &mut scratch);
        SCRATCH.set(scratch);
    };
    let chunks = rows.div_ceil(chunk);
    if chunks == 1 {
        one(0);
    } else {
        (0..chunks).into_par_iter().for_each(one);
    }
}

/// A new `[rows, width]` buffer whose rows the chunks write, and the pointer they write through.
fn output<T: Elem>(rows: usize, width: usize) -> (Vec<T>, Out<T>) {
    let mut v = Vec::with_capacity(rows * width);
    let p = Out(v.as_mut_ptr());
    (v, p)
}

/// A tensor of `dims` from a buffer every value of which the chunks wrote.
///
/// # Safety
/// Every one of the buffer's `len` first values was written.
unsafe fn finished<T: Elem>(mut v: Vec<T>, len: usize, dims: &[usize]) -> Result<Tensor> {
    // SAFETY: the caller's.
    unsafe { v.set_len(len) };
    Ok(Tensor::from_vec(v, dims, &candle_core::Device::Cpu)?)
}

/// [`crate::residual_norm_linear`] on the CPU as one pass over chunks of rows, where
/// [`layers_apply`] holds and `o` and `residual` are contiguous CPU tensors of consistent shapes;
/// `None` otherwise (the layers then run one after another and report any bad input).
pub(crate) fn residual_norm_linear(
    o: &Tensor,
    residual: &Tensor,
    front: &FusedLinear,
    norm: &LayerNorm,
    linear: &FusedLinear,
    gelu: bool,
) -> Result<Option<(Tensor, Tensor)>> {
    // CUDA tensors (the GPU's eager path, where host time counts) leave at the first check.
    if !o.device().is_cpu() {
        return Ok(None);
    }
    let (k, c, n) = (front.in_dim(), front.out_dim(), linear.out_dim());
    let dtype = o.dtype();
    let shapes_ok = o.rank() >= 1
        && o.dims()[o.rank() - 1] == k
        && residual.rank() == o.rank()
        && residual.dims()[..o.rank() - 1] == o.dims()[..o.rank() - 1]
        && residual.dims()[o.rank() - 1] == c
        && norm.weight().elem_count() == c
        && linear.in_dim() == c
        && residual.dtype() == dtype
        && o.elem_count() > 0;
    if !shapes_ok || !layers_apply(dtype, &[front, linear], &[norm]) {
        return Ok(None);
    }
    let (o_held, r_held) = (o.storage_and_layout(), residual.storage_and_layout());
    let (Some(os), Some(rs)) = (contiguous_cpu(&o_held), contiguous_cpu(&r_held)) else {
        return Ok(None);
    };
    let rows = o.elem_count() / k;
    let Some(chunk) = chunk_rows(rows, k * c + c * n, &[front, linear]) else {
        return Ok(None);
    };
    let mut y_dims = residual.dims().to_vec();
    y_dims[o.rank() - 1] = n;
    macro_rules! run {
        ($t:ty) => {
            rnl_typed::<$t>(
                os,
                rs,
                (rows, chunk),
                front,
                norm,
                linear,
                gelu,
                residual.dims(),
                &y_dims,
            )
        };
    }
    let both = match dtype {
        DType::F32 => run!(f32),
        DType::F16 => run!(f16),
        _ => run!(bf16),
    }?;
    Ok(Some(both))
}

/// [`residual_norm_linear`] in one dtype: `os` / `rs` the storages and value ranges of `o` and
/// the residual.
#[allow(clippy::too_many_arguments)]
fn rnl_typed<T: Elem>(
    (os, o_range): (&CpuStorage, Range<usize>),
    (rs, r_range): (&CpuStorage, Range<usize>),
    (rows, chunk): (usize, usize),
    front: &FusedLinear,
    norm: &LayerNorm,
    linear: &FusedLinear,
    gelu: bool,
    x1_dims: &[usize],
    y_dims: &[usize],
) -> Result<(Tensor, Tensor)> {
    let (k, c, n) = (front.in_dim(), front.out_dim(), linear.out_dim());
    let (Some(o), Some(r)) = (T::values(os), T::values(rs)) else {
        return Err(internal(
            "residual_norm_linear (CPU): o or the residual is not of its dtype",
        ));
    };
    let (o, r) = (&o[o_range], &r[r_range]);
    let (front_h, linear_h, norm_h) = (
        HeldLinear::of(front)?,
        HeldLinear::of(linear)?,
        HeldNorm::of(norm),
    );
    let (front_p, linear_p, norm_p) = (front_h.parts()?, linear_h.parts()?, norm_h.parts()?);
    let (mut x1, x1_out) = output::<T>(rows, c);
    let (mut y, y_out) = output::<T>(rows, n);
    // A chunk's scratch: o's rows, the residual's, x1, its LayerNorm, y.
    run_chunks(rows, chunk, k + 3 * c + n, |range, scratch| {
        let m = range.len();
        let (a, rest) = scratch.split_at_mut(m * k);
        let (res, rest) = rest.split_at_mut(m * c);
        let (x1_rows, rest) = rest.split_at_mut(m * c);
        let (z, rest) = rest.split_at_mut(m * c);
        let y_rows = &mut rest[..m * n];
        T::load(&o[range.start * k..range.end * k], a);
        T::load(&r[range.start * c..range.end * c], res);
        front_p.rows(a, m, Some(res), false, x1_rows);
        // SAFETY: the chunks' row ranges are disjoint and inside the outputs' rows.
        T::store(x1_rows, unsafe { x1_out.rows(&range, c) });
        norm_linear_rows::<T>(&norm_p, &linear_p, gelu, x1_rows, m, z, y_rows);
        // SAFETY: as above.
        T::store(y_rows, unsafe { y_out.rows(&range, n) });
    });
    // SAFETY: the chunks covered every row of both outputs and wrote every value of their rows.
    unsafe {
        let x1 = finished(std::mem::take(&mut x1), rows * c, x1_dims)?;
        let y = finished(std::mem::take(&mut y), rows * n, y_dims)?;
        Ok((x1, y))
    }
}

/// [`crate::block_after_attention`] (with `front` the attention's output `o` and the projection)
/// and [`crate::block_mlp`] (without: `x` is then the residual stream after the attention) on the
/// CPU as one pass over chunks of rows, where [`layers_apply`] holds, the tensors are contiguous
/// CPU tensors of one shape `[.., C]`, and the weights' shapes chain (proj `[C, C]`, fc1
/// `[H, C]`, fc2 `[C, H]`, the next norm1 and qkv over C); `None` otherwise (the caller then runs
/// the steps as [`crate::residual_norm_linear`] and [`crate::norm_linear`] do them).
pub(crate) fn mlp_rows(
    front: Option<(&Tensor, &FusedLinear)>,
    x: &Tensor,
    w: &crate::BlockMlp,
) -> Result<Option<(Tensor, Option<Tensor>)>> {
    if !x.device().is_cpu() {
        return Ok(None);
    }
    let c = w.fc2.out_dim();
    let dtype = x.dtype();
    let chain_ok = w.norm2.weight().elem_count() == c
        && w.fc1.in_dim() == c
        && w.fc2.in_dim() == w.fc1.out_dim()
        && w.next
            .is_none_or(|(n1, qkv)| n1.weight().elem_count() == c && qkv.in_dim() == c)
        && front.is_none_or(|(o, proj)| {
            proj.in_dim() == c && proj.out_dim() == c && o.dims() == x.dims() && o.dtype() == dtype
        });
    let shapes_ok = chain_ok && x.rank() >= 1 && x.dims()[x.rank() - 1] == c && x.elem_count() > 0;
    let mut linears = vec![w.fc1, w.fc2];
    let mut norms = vec![w.norm2];
    if let Some((n1, qkv)) = w.next {
        linears.push(qkv);
        norms.push(n1);
    }
    if let Some((_, proj)) = front {
        linears.push(proj);
    }
    if !shapes_ok || !layers_apply(dtype, &linears, &norms) {
        return Ok(None);
    }
    let o_held = front.map(|(o, _)| o.storage_and_layout());
    let x_held = x.storage_and_layout();
    let Some(xs) = contiguous_cpu(&x_held) else {
        return Ok(None);
    };
    let os = match &o_held {
        Some(held) => match contiguous_cpu(held) {
            Some(os) => Some(os),
            None => return Ok(None),
        },
        None => None,
    };
    let rows = x.elem_count() / c;
    let (h, n) = (w.fc1.out_dim(), w.next.map_or(0, |(_, q)| q.out_dim()));
    let proj_macs = if front.is_some() { c * c } else { 0 };
    let Some(chunk) = chunk_rows(rows, proj_macs + 2 * c * h + c * n, &linears) else {
        return Ok(None);
    };
    let front = match (os, front) {
        (Some(os), Some((_, proj))) => Some((os, proj)),
        _ => None,
    };
    let dims = x.dims();
    let done = match dtype {
        DType::F32 => mlp_typed::<f32>(front, xs, (rows, chunk), w, dims),
        DType::F16 => mlp_typed::<f16>(front, xs, (rows, chunk), w, dims),
        _ => mlp_typed::<bf16>(front, xs, (rows, chunk), w, dims),
    }?;
    Ok(Some(done))
}

/// [`mlp_rows`] in one dtype; `front`, when given, the storage and value range of the
/// attention's output and the projection.
fn mlp_typed<T: Elem>(
    front: Option<((&CpuStorage, Range<usize>), &FusedLinear)>,
    (xs, x_range): (&CpuStorage, Range<usize>),
    (rows, chunk): (usize, usize),
    w: &crate::BlockMlp,
    dims: &[usize],
) -> Result<(Tensor, Option<Tensor>)> {
    let not_of_dtype = || internal("block_mlp (CPU): an input is not of its dtype");
    let x = &T::values(xs).ok_or_else(not_of_dtype)?[x_range];
    let o = match &front {
        Some(((s, range), _)) => Some(&T::values(s).ok_or_else(not_of_dtype)?[range.clone()]),
        None => None,
    };
    let (fc1_h, fc2_h, norm2_h) = (
        HeldLinear::of(w.fc1)?,
        HeldLinear::of(w.fc2)?,
        HeldNorm::of(w.norm2),
    );
    let next_h = match w.next {
        Some((norm1, qkv)) => Some((HeldNorm::of(norm1), HeldLinear::of(qkv)?)),
        None => None,
    };
    let proj_h = match front {
        Some((_, proj)) => Some(HeldLinear::of(proj)?),
        None => None,
    };
    let (fc1, fc2, norm2) = (fc1_h.parts()?, fc2_h.parts()?, norm2_h.parts()?);
    let next = match &next_h {
        Some((norm1, qkv)) => Some((norm1.parts()?, qkv.parts()?)),
        None => None,
    };
    let proj = match &proj_h {
        Some(p) => Some(p.parts()?),
        None => None,
    };
    let with_next = next.is_some();
    let (c, h) = (fc2.panels.out(), fc1.panels.out());
    let n = next.as_ref().map_or(0, |(_, q)| q.panels.out());
    let (mut y, y_out) = output::<T>(rows, c);
    let (mut q, q_out) = output::<T>(if with_next { rows } else { 0 }, n);
    // A chunk's scratch: o's rows (then the block's output), x's, x1, a LayerNorm's output, the
    // hidden rows, the next qkv.
    run_chunks(rows, chunk, 4 * c + h + n, |range, scratch| {
        let m = range.len();
        let (a, rest) = scratch.split_at_mut(m * c);
        let (res, rest) = rest.split_at_mut(m * c);
        let (x1, rest) = rest.split_at_mut(m * c);
        let (z, rest) = rest.split_at_mut(m * c);
        let (hidden, rest) = rest.split_at_mut(m * h);
        let q_rows = &mut rest[..m * n];
        let rows_c = range.start * c..range.end * c;
        match (o, &proj) {
            (Some(o), Some(proj)) => {
                // x1 = x + proj(o), rounded where the projection's layer stores it.
                T::load(&o[rows_c.clone()], a);
                T::load(&x[rows_c], res);
                proj.rows(a, m, Some(res), false, x1);
                T::round(x1);
            }
            _ => T::load(&x[rows_c], x1),
        }
        // hidden = gelu(fc1(norm2(x1))).
        norm_linear_rows::<T>(&norm2, &fc1, true, x1, m, z, hidden);
        T::round(hidden);
        // y = x1 + fc2(hidden), into o's rows (read already).
        fc2.rows(hidden, m, Some(x1), false, a);
        // SAFETY: the chunks' row ranges are disjoint and inside the outputs' rows.
        T::store(a, unsafe { y_out.rows(&range, c) });
        if let Some((norm1, qkv)) = &next {
            norm_linear_rows::<T>(norm1, qkv, false, a, m, z, q_rows);
            // SAFETY: as above.
            T::store(q_rows, unsafe { q_out.rows(&range, n) });
        }
    });
    let mut q_dims = dims.to_vec();
    q_dims[dims.len() - 1] = n;
    // SAFETY: the chunks covered every row of the outputs and wrote every value of their rows
    // (of q's only with a next block, which is when it is kept).
    unsafe {
        let y = finished(std::mem::take(&mut y), rows * c, dims)?;
        let q = match with_next {
            true => Some(finished(std::mem::take(&mut q), rows * n, &q_dims)?),
            false => None,
        };
        Ok((y, q))
    }
}

/// [`crate::norm_linear`] on the CPU as one pass over chunks of rows, where [`layers_apply`]
/// holds and `x` is a contiguous CPU tensor of the norm's width; `None` otherwise.
pub(crate) fn norm_linear(
    x: &Tensor,
    norm: &LayerNorm,
    linear: &FusedLinear,
    gelu: bool,
) -> Result<Option<Tensor>> {
    if !x.device().is_cpu() {
        return Ok(None);
    }
    let (c, n) = (linear.in_dim(), linear.out_dim());
    let dtype = x.dtype();
    let shapes_ok = x.rank() >= 1
        && x.dims()[x.rank() - 1] == c
        && norm.weight().elem_count() == c
        && x.elem_count() > 0;
    if !shapes_ok || !layers_apply(dtype, &[linear], &[norm]) {
        return Ok(None);
    }
    let x_held = x.storage_and_layout();
    let Some(xs) = contiguous_cpu(&x_held) else {
        return Ok(None);
    };
    let rows = x.elem_count() / c;
    let Some(chunk) = chunk_rows(rows, c * n, &[linear]) else {
        return Ok(None);
    };
    let mut y_dims = x.dims().to_vec();
    y_dims[x.rank() - 1] = n;
    let rc = (rows, chunk);
    let y = match dtype {
        DType::F32 => nl_typed::<f32>(xs, rc, norm, linear, gelu, &y_dims),
        DType::F16 => nl_typed::<f16>(xs, rc, norm, linear, gelu, &y_dims),
        _ => nl_typed::<bf16>(xs, rc, norm, linear, gelu, &y_dims),
    }?;
    Ok(Some(y))
}

/// [`norm_linear`] in one dtype.
fn nl_typed<T: Elem>(
    (xs, x_range): (&CpuStorage, Range<usize>),
    (rows, chunk): (usize, usize),
    norm: &LayerNorm,
    linear: &FusedLinear,
    gelu: bool,
    y_dims: &[usize],
) -> Result<Tensor> {
    let (c, n) = (linear.in_dim(), linear.out_dim());
    let Some(x) = T::values(xs) else {
        return Err(internal("norm_linear (CPU): x is not of its dtype"));
    };
    let x = &x[x_range];
    let (linear_h, norm_h) = (HeldLinear::of(linear)?, HeldNorm::of(norm));
    let (linear_p, norm_p) = (linear_h.parts()?, norm_h.parts()?);
    let (mut y, y_out) = output::<T>(rows, n);
    // A chunk's scratch: x's rows, their LayerNorm, y.
    run_chunks(rows, chunk, 2 * c + n, |range, scratch| {
        let m = range.len();
        let (a, rest) = scratch.split_at_mut(m * c);
        let (z, rest) = rest.split_at_mut(m * c);
        let y_rows = &mut rest[..m * n];
        T::load(&x[range.start * c..range.end * c], a);
        norm_linear_rows::<T>(&norm_p, &linear_p, gelu, a, m, z, y_rows);
        // SAFETY: the chunks' row ranges are disjoint and inside the output's rows.
        T::store(y_rows, unsafe { y_out.rows(&range, n) });
    });
    // SAFETY: the chunks covered every row and wrote every value of their rows.
    unsafe { finished(std::mem::take(&mut y), rows * n, y_dims) }
}

/// A Linear's panels and its bias's storage, held for reading while the chunks run.
struct HeldLinear<'a> {
    panels: &'a PackedWeight,
    bias: Option<Held<'a>>,
}

impl<'a> HeldLinear<'a> {
    /// `linear`'s panels (it must hold them: [`layers_apply`]) and its bias.
    fn of(linear: &'a FusedLinear) -> Result<Self> {
        let panels = linear
            .packed()
            .ok_or_else(|| internal("cpu rows: a Linear without panels"))?;
        Ok(Self {
            panels,
            bias: linear.bias().map(|b| b.storage_and_layout()),
        })
    }

    /// The panels and the bias as f32, as the chunks read them.
    fn parts(&self) -> Result<LinearParts<'_>> {
        let bias = match &self.bias {
            Some((storage, layout)) => Some(storage_f32(storage, layout, "cpu rows", "bias")?),
            None => None,
        };
        Ok(LinearParts {
            panels: self.panels,
            bias,
        })
    }
}

/// A LayerNorm's weight and bias storages, held for reading while the chunks run, and its eps.
struct HeldNorm<'a> {
    weight: Held<'a>,
    bias: Held<'a>,
    eps: f32,
}

impl<'a> HeldNorm<'a> {
    fn of(norm: &'a LayerNorm) -> Self {
        Self {
            weight: norm.weight().storage_and_layout(),
            bias: norm.bias().storage_and_layout(),
            eps: norm.eps() as f32,
        }
    }

    /// The weight and bias as f32, as the chunks read them.
    fn parts(&self) -> Result<NormParts<'_>> {
        let ((w, wl), (b, bl)) = (&self.weight, &self.bias);
        Ok(NormParts {
            weight: storage_f32(w, wl, "cpu rows", "norm weight")?,
            bias: storage_f32(b, bl, "cpu rows", "norm bias")?,
            eps: self.eps,
        })
    }
}

impl LinearParts<'_> {
    /// `x·Wᵀ + b`, `+ residual` and the GELU as asked, for `m` rows of `x` into `out` (f32, as
    /// the layer computes them before it stores).
    fn rows(&self, x: &[f32], m: usize, residual: Option<&[f32]>, gelu: bool, out: &mut [f32]) {
        let finish = Finish {
            bias: self.bias.as_deref(),
            residual,
            gelu,
        };
        self.panels.product_serial(x, m, finish, out)
    }
}

/// [`crate::norm_linear`]'s two layers on `m` rows of `x`: their LayerNorm into `z`, rounded to
/// `T` where the LayerNorm stores it, then the Linear (and the GELU) into `out`.
fn norm_linear_rows<T: Elem>(
    norm: &NormParts,
    linear: &LinearParts,
    gelu: bool,
    x: &[f32],
    m: usize,
    z: &mut [f32],
    out: &mut [f32],
) {
    norm.rows(x, z);
    T::round(z);
    linear.rows(z, m, None, gelu, out);
}

impl NormParts<'_> {
    /// The LayerNorm of the rows of `x` into `out` (both f32, whole rows), the layer's own row
    /// function.
    fn rows(&self, x: &[f32], out: &mut [f32]) {
        crate::norm_cpu::norm_rows_dispatch(x, &self.weight, &self.bias, self.eps, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// f32 weights of a DeiT block after its attention and the next qkv (proj, fc1, fc2, qkv:
    /// 12·C² values), and its multiply-adds a row.
    fn tail(c: usize) -> (usize, usize) {
        (12 * c * c * 4, 12 * c * c)
    }

    #[test]
    fn amx_chunks_are_whole_tiles() {
        let s_macs = 384 * (384 + 1536) + 1536 * (384 + 1152);
        assert_eq!(amx_chunk_plan(197, s_macs, 16), 16);
        assert_eq!(amx_chunk_plan(1576, s_macs, 16), 32);
        assert_eq!(amx_chunk_plan(400, s_macs, 16), 32);
        assert_eq!(amx_chunk_plan(139, s_macs, 16), 16);
        assert_eq!(amx_chunk_plan(197, s_macs, 1), 197);
        assert_eq!(amx_chunk_plan(3, s_macs, 16), 3);
        assert_eq!(amx_chunk_plan(1576, s_macs, 64), 32);
    }

    #[test]
    fn chunks_split_rows_evenly_and_skip_short_chunks_of_wide_weights() {
        let (t_bytes, t_macs) = tail(192);
        let (s_bytes, s_macs) = tail(384);
        let (b_bytes, b_macs) = tail(768);
        // One image on 16 threads: a chunk of 13 rows a thread for DeiT-T and DeiT-S; DeiT-B's
        // weights are too wide for chunks that short: the layers.
        assert_eq!(chunk_plan(197, t_macs, t_bytes, 16), Some(13));
        assert_eq!(chunk_plan(197, s_macs, s_bytes, 16), Some(13));
        assert_eq!(chunk_plan(197, b_macs, b_bytes, 16), None);
        // DeiT-S after a pruning step (139 rows: chunks of 9): the layers in f32, chunks in f16.
        assert_eq!(chunk_plan(139, s_macs, s_bytes, 16), None);
        assert_eq!(chunk_plan(139, s_macs, s_bytes / 2, 16), Some(9));
        // Eight images: five chunks a thread of at most 24 rows, whatever the width.
        for (bytes, macs) in [(t_bytes, t_macs), (b_bytes, b_macs)] {
            let chunk = chunk_plan(1576, macs, bytes, 16).unwrap();
            assert_eq!((chunk, 1576usize.div_ceil(chunk)), (20, 79));
        }
        // Two threads, one image: five chunks a thread of 20 rows.
        assert_eq!(chunk_plan(197, b_macs, b_bytes, 2), Some(20));
        // One thread, or too little work: one chunk.
        assert_eq!(chunk_plan(197, b_macs, b_bytes, 1), Some(197));
        assert_eq!(chunk_plan(3, 1000, b_bytes, 16), Some(3));
        // Fewer rows than a thread's minimum: chunks of 8 rows.
        assert_eq!(chunk_plan(40, t_macs, t_bytes, 16), Some(8));
    }
}
