//! [`FusedLinear`](crate::FusedLinear)'s CPU product with its weight packed once, for x86-64
//! CPUs with AVX2 and FMA: `x·Wᵀ` as 6 × 16 register tiles over 16-column panels of `Wᵀ`,
//! and the bias, residual and GELU applied to each task's block of the output while it is in
//! cache.
//!
//! Why: `gemm`, which the layer called before, packs both operands on every call (its packing
//! routine was ~7 % of a DeiT-T f32 batch-1 forward's samples under `perf` on the 2-core build
//! machine, its microkernel 42 %) and writes into a zeroed output (`memset`, 2 %), and a
//! half-precision weight had to be widened to a fresh f32 copy on every call: DeiT-S bf16 took
//! 134 ms a batch-1 forward there against 76 ms in f32. A weight never changes, so its panels
//! are made once, in its own dtype (the same bytes again, not an f32 copy), and an f16 / bf16
//! panel is widened a block at a time into a 16 KB buffer that the tiles then reuse across all
//! of a task's rows.
//!
//! How: panel `p` holds columns `16p .. 16p + 16` of `Wᵀ` (rows `16p ..` of W; zeros past the
//! last one) as `k` rows of 16 values. A task is a range of output rows and a range of panels;
//! for each panel and each block of at most [`DEPTH`] terms of K it runs the 6 × 16 tile (12
//! accumulators, two loads of the panel and six broadcasts of x a term) down its rows, a
//! tile's first K block starting from zero and each later one from what the last one stored.
//! So an output value is the sum of its `k` products in order of K, one rounding a fused
//! multiply-add: the same bits whatever the tasks or the thread count.

use std::ops::Range;
use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Storage, Tensor};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;

/// Columns of a panel and of a tile: two AVX vectors.
const COLS: usize = 16;

/// Rows of a full tile: 12 accumulators, two panel vectors and a broadcast in the 16 registers.
const ROWS: usize = 6;

/// Terms of K in a panel block: 16 KB of f32, which stays in L1 while a task's rows pass over it.
const DEPTH: usize = 256;

/// Row tiles a task spans at most: 240 rows of x, ≤ 240 KB a K block, stay in L2 while the
/// task's panels pass over them.
const TASK_TILES: usize = 40;

/// Below this many multiply-adds a product runs on the calling thread alone (waking the pool
/// costs more than it saves).
const PARALLEL_MIN: usize = 1 << 20;

/// Whether [`FusedLinear`](crate::FusedLinear) runs on the CPU through [`PackedWeight`]: yes on
/// x86-64 CPUs with AVX2 and FMA unless `CANDLE_FASTPATH_CPU_PACKED=0` (read once; then, and on
/// other CPUs, one `gemm` call a layer, as before).
pub fn cpu_packed() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    crate::switches::on_unless_off(&ON, "CANDLE_FASTPATH_CPU_PACKED") && has_fma()
}

fn has_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// A weight's panels in its own dtype.
enum Panels {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

/// A `[out, in]` weight as panels of 16 columns of `Wᵀ` (see the module's documentation).
pub(crate) struct PackedWeight {
    out: usize,
    depth: usize,
    panels: Panels,
}

impl std::fmt::Debug for PackedWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let dtype = match self.panels {
            Panels::F32(_) => "f32",
            Panels::F16(_) => "f16",
            Panels::BF16(_) => "bf16",
        };
        write!(f, "PackedWeight([{}, {}], {dtype})", self.out, self.depth)
    }
}

/// `w` (`[n, k]` row-major) as panels: panel `p`, term `i`, column `c` at `(p·k + i)·16 + c`
/// holds `w[16p + c][i]`, zero past row `n`.
fn panels_of<T: Copy + Default + Send + Sync>(w: &[T], n: usize, k: usize) -> Vec<T> {
    let mut out = vec![T::default(); n.div_ceil(COLS) * k * COLS];
    out.par_chunks_mut(k * COLS)
        .enumerate()
        .for_each(|(p, panel)| {
            for (c, row) in w[p * COLS * k..].chunks_exact(k).take(COLS).enumerate() {
                for (i, &v) in row.iter().enumerate() {
                    panel[i * COLS + c] = v;
                }
            }
        });
    out
}

/// What is applied to `x·Wᵀ` before it is stored, as f32: `gelu((x·Wᵀ + bias) + residual)`,
/// the CUDA epilogue's order; `residual` is `[rows, out]`.
#[derive(Clone, Copy)]
pub(crate) struct Finish<'a> {
    pub bias: Option<&'a [f32]>,
    pub residual: Option<&'a [f32]>,
    pub gelu: bool,
}

impl Finish<'_> {
    /// Applies itself to `seg`, the columns `cols` of output row `row` (`out` columns a row).
    pub(crate) fn apply(&self, seg: &mut [f32], row: usize, cols: Range<usize>, out: usize) {
        if let Some(b) = self.bias {
            seg.iter_mut()
                .zip(&b[cols.clone()])
                .for_each(|(d, b)| *d += *b);
        }
        if let Some(r) = self.residual {
            let r = &r[row * out + cols.start..row * out + cols.end];
            seg.iter_mut().zip(r).for_each(|(d, r)| *d += *r);
        }
        if self.gelu {
            crate::gelu_cpu::gelu_in_place(seg);
        }
    }
}

/// The output's base pointer, shared by the tasks, each of which writes its own rows × columns.
#[derive(Clone, Copy)]
struct Output(*mut f32);
// SAFETY: the tasks write disjoint parts of the buffer (see `PackedWeight::product`).
unsafe impl Send for Output {}
unsafe impl Sync for Output {}

impl PackedWeight {
    /// Packs `weight` (`[out, in]`, contiguous, on the CPU, f32 / f16 / bf16).
    pub(crate) fn pack(weight: &Tensor) -> candle_core::Result<Self> {
        let (out, depth) = weight.dims2()?;
        let (storage, layout) = weight.storage_and_layout();
        let Storage::Cpu(s) = &*storage else {
            candle_core::bail!("fused_linear (CPU): the weight is not on the CPU")
        };
        let Some((a, b)) = layout.contiguous_offsets() else {
            candle_core::bail!("fused_linear (CPU): the weight is not contiguous")
        };
        let panels = match s {
            CpuStorage::F32(w) => Panels::F32(panels_of(&w[a..b], out, depth)),
            CpuStorage::F16(w) => Panels::F16(panels_of(&w[a..b], out, depth)),
            CpuStorage::BF16(w) => Panels::BF16(panels_of(&w[a..b], out, depth)),
            other => candle_core::bail!(
                "fused_linear (CPU): a {:?} weight, not f32, f16 or bf16",
                other.dtype()
            ),
        };
        Ok(Self { out, depth, panels })
    }

    /// `finish(x·Wᵀ)` for `x` `[rows, in]` (f32, rows `x_rs` apart, each contiguous):
    /// `[rows, out]` row-major.
    ///
    /// # Panics
    /// If `x` is too short for those rows, the bias is not `[out]` or the residual not
    /// `[rows, out]`, or the CPU lacks AVX2 or FMA ([`cpu_packed`] says whether it has them).
    pub(crate) fn product(
        &self,
        x: &[f32],
        x_rs: usize,
        rows: usize,
        finish: Finish<'_>,
    ) -> Vec<f32> {
        let (n, k) = (self.out, self.depth);
        // The tiles read and write through raw pointers: everything they touch lies here.
        assert!(
            has_fma(),
            "fused_linear (CPU): packed product without AVX2 + FMA"
        );
        assert!(rows > 0 && k > 0 && x_rs >= k && x.len() >= (rows - 1) * x_rs + k);
        assert!(finish.bias.is_none_or(|b| b.len() == n));
        assert!(finish.residual.is_none_or(|r| r.len() == rows * n));
        let len = rows * n;
        let mut out = Vec::<f32>::with_capacity(len);
        let dst = Output(out.as_mut_ptr());

        let panel_count = n.div_ceil(COLS);
        let tiles = rows.div_ceil(ROWS);
        let threads = rayon::current_num_threads().max(1);
        let parallel = threads > 1 && rows * n * k >= PARALLEL_MIN;
        // Three tasks a thread when there is work for them, so that a thread that finishes
        // early takes another; split over rows first (a task interleaves its own rows of x,
        // once a K block, a pass as long as a tile's work on one panel), over panels only
        // where the rows are few, and never into tasks of fewer than 4 tiles or 8 panels.
        let wanted = if parallel { 3 * threads } else { 1 };
        let row_tasks = tiles
            .div_ceil(4)
            .min(wanted)
            .max(tiles.div_ceil(TASK_TILES));
        let rows_per_task = tiles.div_ceil(row_tasks) * ROWS;
        let panel_tasks = wanted
            .div_ceil(row_tasks)
            .min(panel_count.div_ceil(8))
            .max(1);
        let panels_per_task = panel_count.div_ceil(panel_tasks);
        let tasks: Vec<(Range<usize>, Range<usize>)> = (0..rows)
            .step_by(rows_per_task)
            .flat_map(|r| {
                (0..panel_count).step_by(panels_per_task).map(move |p| {
                    (
                        r..(r + rows_per_task).min(rows),
                        p..(p + panels_per_task).min(panel_count),
                    )
                })
            })
            .collect();
        let run = |(rows, panels): &(Range<usize>, Range<usize>)| {
            // SAFETY: AVX2 + FMA (asserted above); x holds every row the task reads, and the
            // tasks' output blocks (their rows × their panels' columns) are disjoint parts of
            // `out`, which has room for `len` values.
            unsafe { self.task(x, x_rs, rows.clone(), panels.clone(), dst, finish) }
        };
        if parallel {
            tasks.par_iter().for_each(run);
        } else {
            tasks.iter().for_each(run);
        }
        // SAFETY: every output value was written: the tasks cover every row and every panel,
        // and each tile stores all of its rows' columns below `out` (its first K block).
        unsafe { out.set_len(len) };
        out
    }

    /// One task: output rows `rows` × the columns of panels `panels`, then its finish.
    ///
    /// # Safety
    /// AVX2 and FMA; `x` holds rows `rows` (`x_rs` apart, `depth` terms each); `dst` has room
    /// for `[rows.end, out]` values and no other thread touches this task's block.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn task(
        &self,
        x: &[f32],
        x_rs: usize,
        rows: Range<usize>,
        panels: Range<usize>,
        dst: Output,
        finish: Finish<'_>,
    ) {
        let (n, k) = (self.out, self.depth);
        // A half-precision block widened here, then read by every row tile of the task.
        let mut widened = [0f32; DEPTH * COLS];
        // The task's rows of x for one K block, a tile's rows interleaved term by term, so that
        // a tile's six broadcasts a term come from one stream (a last tile of m < 6 rows
        // leaves the other places as they were: it reads only its m).
        // Kept per thread: a fresh buffer of this size (≤ 240 KB) is a fresh mapping, whose
        // page faults cost as much as the packing.
        thread_local!(static INTERLEAVED: std::cell::RefCell<Vec<f32>> = const {
            std::cell::RefCell::new(Vec::new())
        });
        let tile_count = rows.len().div_ceil(ROWS);
        let size = tile_count * ROWS * DEPTH.min(k);
        INTERLEAVED.with_borrow_mut(|interleaved| {
            if interleaved.len() < size {
                interleaved.resize(size, 0.0);
            }
            for k0 in (0..k).step_by(DEPTH) {
                let terms = (k - k0).min(DEPTH);
                for (t, tile_rows) in interleaved[..tile_count * ROWS * terms]
                    .chunks_exact_mut(ROWS * terms)
                    .enumerate()
                {
                    for (r, row) in (rows.start + t * ROWS..rows.end).take(ROWS).enumerate() {
                        let src = &x[row * x_rs + k0..row * x_rs + k0 + terms];
                        for (i, &v) in src.iter().enumerate() {
                            tile_rows[i * ROWS + r] = v;
                        }
                    }
                }
                let first = k0 == 0;
                for p in panels.clone() {
                    let col = p * COLS;
                    let width = (n - col).min(COLS);
                    let block = (p * k + k0) * COLS..(p * k + k0 + terms) * COLS;
                    let b: &[f32] = match &self.panels {
                        Panels::F32(v) => &v[block],
                        Panels::F16(v) => {
                            v[block].convert_to_f32_slice(&mut widened[..terms * COLS]);
                            &widened[..terms * COLS]
                        }
                        Panels::BF16(v) => {
                            v[block].convert_to_f32_slice(&mut widened[..terms * COLS]);
                            &widened[..terms * COLS]
                        }
                    };
                    for (t, r) in rows.clone().step_by(ROWS).enumerate() {
                        let m = (rows.end - r).min(ROWS);
                        // SAFETY: tile t of the interleaved rows (`terms` terms of ROWS values);
                        // `terms` rows of 16 values of b; rows r .. r + m, columns col .. col +
                        // width of dst (this task's block).
                        unsafe {
                            let a = interleaved.as_ptr().add(t * ROWS * terms);
                            let c = dst.0.add(r * n + col);
                            if width == COLS {
                                tiles(m, a, terms, b.as_ptr(), c, n, first);
                            } else {
                                // The last panel's valid columns, through a full-width buffer.
                                let mut buf = [0f32; ROWS * COLS];
                                if !first {
                                    for i in 0..m {
                                        std::ptr::copy_nonoverlapping(
                                            c.add(i * n),
                                            buf.as_mut_ptr().add(i * COLS),
                                            width,
                                        );
                                    }
                                }
                                tiles(m, a, terms, b.as_ptr(), buf.as_mut_ptr(), COLS, first);
                                for i in 0..m {
                                    std::ptr::copy_nonoverlapping(
                                        buf.as_ptr().add(i * COLS),
                                        c.add(i * n),
                                        width,
                                    );
                                }
                            }
                        }
                    }
                }
            }
        });
        if finish.bias.is_none() && finish.residual.is_none() && !finish.gelu {
            return;
        }
        let cols = panels.start * COLS..(panels.end * COLS).min(n);
        for r in rows {
            // SAFETY: this task's columns of row r, all written above.
            let seg = unsafe {
                std::slice::from_raw_parts_mut(dst.0.add(r * n + cols.start), cols.len())
            };
            finish.apply(seg, r, cols.clone(), n);
        }
    }

    #[cfg(not(target_arch = "x86_64"))]
    unsafe fn task(
        &self,
        _: &[f32],
        _: usize,
        _: Range<usize>,
        _: Range<usize>,
        _: Output,
        _: Finish<'_>,
    ) {
        unreachable!("product asserts AVX2 + FMA first")
    }
}

/// [`tile`] for `m` (1 ..= 6) rows.
///
/// # Safety
/// As [`tile`].
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn tiles(
    m: usize,
    a: *const f32,
    k: usize,
    b: *const f32,
    c: *mut f32,
    c_rs: usize,
    first: bool,
) {
    // SAFETY: the caller's.
    unsafe {
        match m {
            6 => tile::<6>(a, k, b, c, c_rs, first),
            5 => tile::<5>(a, k, b, c, c_rs, first),
            4 => tile::<4>(a, k, b, c, c_rs, first),
            3 => tile::<3>(a, k, b, c, c_rs, first),
            2 => tile::<2>(a, k, b, c, c_rs, first),
            1 => tile::<1>(a, k, b, c, c_rs, first),
            _ => unreachable!("a tile has 1 to {ROWS} rows"),
        }
    }
}

/// `c[r][0..16] (+)= Σ_i a[r][i] · b[i][0..16]` for `R` rows: `a` `k` terms of [`ROWS`] values
/// (row `r`'s term `i` at `i·ROWS + r`), `b` `k` rows of 16 values back to back, `c`'s rows `c_rs` apart; starting from zero
/// when `first`, from `c`'s values otherwise. The accumulators are indexed by constants once the
/// loops over `R` unroll, so they stay in registers.
///
/// # Safety
/// AVX2 and FMA; the pointers valid for those rows.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn tile<const R: usize>(
    a: *const f32,
    k: usize,
    b: *const f32,
    c: *mut f32,
    c_rs: usize,
    first: bool,
) {
    use std::arch::x86_64::*;
    // SAFETY: the caller's.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        if !first {
            for (r, acc) in acc.iter_mut().enumerate() {
                acc[0] = _mm256_loadu_ps(c.add(r * c_rs));
                acc[1] = _mm256_loadu_ps(c.add(r * c_rs + 8));
            }
        }
        for i in 0..k {
            let b0 = _mm256_loadu_ps(b.add(i * COLS));
            let b1 = _mm256_loadu_ps(b.add(i * COLS + 8));
            for (r, acc) in acc.iter_mut().enumerate() {
                let w = _mm256_broadcast_ss(&*a.add(i * ROWS + r));
                acc[0] = _mm256_fmadd_ps(w, b0, acc[0]);
                acc[1] = _mm256_fmadd_ps(w, b1, acc[1]);
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            _mm256_storeu_ps(c.add(r * c_rs), acc[0]);
            _mm256_storeu_ps(c.add(r * c_rs + 8), acc[1]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The panels hold `Wᵀ`'s columns in order, zeros past the last row of W.
    #[test]
    fn panels_hold_the_transpose() {
        let (n, k) = (19, 5);
        let w: Vec<f32> = (0..n * k).map(|v| v as f32).collect();
        let p = panels_of(&w, n, k);
        assert_eq!(p.len(), 2 * k * COLS);
        for (idx, &v) in p.iter().enumerate() {
            let (panel, i, c) = (idx / (k * COLS), idx / COLS % k, idx % COLS);
            let row = panel * COLS + c;
            let want = if row < n { w[row * k + i] } else { 0.0 };
            assert_eq!(v, want, "panel {panel} term {i} column {c}");
        }
    }

    /// Each value is the ordered FMA chain over K, so its bits do not depend on how the rows
    /// and panels are split into tasks or on the K blocks: checked against that chain written
    /// out, on shapes with partial tiles, a partial last panel and three K blocks, for every
    /// thread count the split depends on.
    #[test]
    fn values_are_the_ordered_fma_chain() {
        if !has_fma() {
            return;
        }
        let (rows, k, n) = (203, 2 * DEPTH + 7, 40);
        let x: Vec<f32> = (0..rows * k)
            .map(|v| ((v * 37 % 101) as f32 - 50.0) / 31.0)
            .collect();
        let w: Vec<f32> = (0..n * k)
            .map(|v| ((v * 53 % 97) as f32 - 48.0) / 29.0)
            .collect();
        let packed =
            PackedWeight::pack(&Tensor::from_slice(&w, (n, k), &candle_core::Device::Cpu).unwrap())
                .unwrap();
        let none = Finish {
            bias: None,
            residual: None,
            gelu: false,
        };
        for threads in [1, 2, 5] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let got = pool.install(|| packed.product(&x, k, rows, none));
            for i in 0..rows {
                for j in 0..n {
                    let want = (0..k).fold(0f32, |s, t| x[i * k + t].mul_add(w[j * k + t], s));
                    assert_eq!(got[i * n + j].to_bits(), want.to_bits(), "[{i}, {j}]");
                }
            }
        }
    }
}
