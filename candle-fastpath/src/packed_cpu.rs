//! [`FusedLinear`](crate::FusedLinear)'s CPU product with its weight packed once, for x86-64
//! CPUs with AVX2 and FMA: `x·Wᵀ` as register tiles over 16-column panels of `Wᵀ` (6 rows ×
//! one panel with AVX2, 8 rows × two panels with AVX-512), and the bias, residual and GELU
//! applied to each task's block of the output while it is in cache.
//!
//! Why: `gemm`, which the layer called before, packs both operands on every call (its packing
//! routine was ~7 % of a DeiT-T f32 batch-1 forward's samples under `perf` on the 2-core build
//! machine, its microkernel 42 %) and writes into a zeroed output (`memset`, 2 %), and a
//! half-precision weight had to be widened to a fresh f32 copy on every call: DeiT-S bf16 took
//! 134 ms a batch-1 forward there against 76 ms in f32. A weight never changes, so its panels
//! are made once, in its own dtype, when the layer is made (the layer then keeps them instead
//! of the weight tensor), and an f16 / bf16 panel is widened a block at a time into a 16 KB
//! buffer that the tiles then reuse across all of a task's rows.
//!
//! How: panel `p` holds columns `16p .. 16p + 16` of `Wᵀ` (rows `16p ..` of W; zeros past the
//! last one) as `k` rows of 16 values. A task is a range of output rows and a range of panels;
//! it interleaves its rows of x a tile at a time for each block of at most [`DEPTH`] terms of K
//! (so a tile's broadcasts read one stream), then runs the tiles down its rows for each panel
//! (or pair of panels), a tile's first K block starting from zero and each later one from what
//! the last one stored. So an output value is the sum of its `k` products in order of K, one
//! rounding a fused multiply-add: the same bits whatever the kernel, the tasks or the thread
//! count. On CPUs with AMX-BF16 a bf16 weight is packed for AMX tiles instead
//! ([`crate::amx_cpu`]): the same tasks, each value the sum of the same exact products added in
//! the hardware's pairs (the same bits whatever the tasks or the thread count, not always the
//! AVX tiles' bits).

use std::ops::Range;
use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Storage, Tensor};
use candle_ragged::half_cpu::HalfSlice;
use half::{bf16, f16};
use rayon::prelude::*;

/// Columns of a panel and of a tile: two AVX vectors.
pub(crate) const COLS: usize = 16;

/// Terms of K in a panel block: 16 KB of f32, which stays in L1 while a task's rows pass over it.
const DEPTH: usize = 256;

/// Rows a task spans at most: 240 rows of x, ≤ 240 KB a K block, stay in L2 while the task's
/// panels pass over them.
const TASK_ROWS: usize = 240;

/// Below this many multiply-adds a product runs on the calling thread alone (waking the pool
/// costs more than it saves).
const PARALLEL_MIN: usize = 1 << 20;

/// The register tiles a CPU runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    /// AVX2 + FMA: 6 rows × one panel (16 columns, two vectors): 12 accumulators, two panel
    /// vectors and a broadcast in AVX's 16 registers.
    Avx2,
    /// AVX-512: 8 rows × two panels (32 columns, two vectors): 16 accumulators of AVX-512's 32
    /// registers; ten loads (two panel vectors, eight broadcasts) a sixteen multiply-adds.
    Avx512,
    /// AMX (bf16 weights packed as [`crate::amx_cpu`] pairs): two 16-row tiles × two panels,
    /// four 16 × 16 accumulator tiles over all of K.
    Amx,
}

impl Kernel {
    /// Rows of a full tile.
    const fn rows(self) -> usize {
        match self {
            Kernel::Avx2 => 6,
            Kernel::Avx512 => 8,
            Kernel::Amx => crate::amx_cpu::ROWS,
        }
    }
}

/// The most rows a tile of any kernel has.
const MAX_ROWS: usize = 8;

/// The kernel [`FusedLinear`](crate::FusedLinear)'s CPU product runs, from the CPU and
/// `CANDLE_FASTPATH_CPU_PACKED` (read once): AVX-512 tiles where the CPU has AVX-512F (and AVX2 +
/// FMA), AVX2 tiles where it has AVX2 + FMA or under `=avx2`, none (one `gemm` call a layer)
/// on other CPUs or under `=0`.
fn kernel() -> Option<Kernel> {
    static KERNEL: OnceLock<Option<Kernel>> = OnceLock::new();
    crate::switches::read_once(&KERNEL, "CANDLE_FASTPATH_CPU_PACKED", |v| match v {
        Some("0") | Some("off") => None,
        _ if !has_fma() => None,
        Some("avx2") => Some(Kernel::Avx2),
        _ if has_avx512() => Some(Kernel::Avx512),
        _ => Some(Kernel::Avx2),
    })
}

/// Whether [`FusedLinear`](crate::FusedLinear) runs its CPU product on packed panels: yes on
/// x86-64 CPUs with AVX2 and FMA (AVX-512 tiles where the CPU has AVX-512F) unless
/// `CANDLE_FASTPATH_CPU_PACKED=0` (read once; then, and on other CPUs, one `gemm` call a layer,
/// as before); `=avx2` keeps the AVX2 tiles on an AVX-512 CPU. A bf16 weight takes AMX tiles
/// instead where the CPU has AMX-BF16 (unless `CANDLE_FASTPATH_CPU_AMX=0`).
pub fn cpu_packed() -> bool {
    kernel().is_some()
}

fn has_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        has_fma() && std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// A weight's panels in its own dtype.
enum Panels {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    /// A bf16 weight in [`crate::amx_cpu::pair_panels`]' layout, where AMX runs the product.
    BF16Pairs(Vec<bf16>),
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
            Panels::BF16Pairs(_) => "bf16, AMX pairs",
        };
        write!(f, "PackedWeight([{}, {}], {dtype})", self.out, self.depth)
    }
}

/// `w` (`[n, k]` row-major) as panels: panel `p`, term `i`, column `c` at `(p·k + i)·16 + c`
/// holds `w[16p + c][i]`, zero past row `n`.
fn panels_of<T: Copy + Default + Send + Sync>(w: &[T], n: usize, k: usize) -> Vec<T> {
    panels_placed(w, n, k, k, |i, c| i * COLS + c)
}

/// `w` (`[n, k]` row-major) as panels of `kp ≥ k` terms each: panel `p` holds rows `16p ..` of
/// W, term `i` of column `c` at `p · kp · 16 + place(i, c)`; zeros past row `n` and term `k`.
pub(crate) fn panels_placed<T: Copy + Default + Send + Sync>(
    w: &[T],
    n: usize,
    k: usize,
    kp: usize,
    place: impl Fn(usize, usize) -> usize + Sync,
) -> Vec<T> {
    let mut out = vec![T::default(); n.div_ceil(COLS) * kp * COLS];
    out.par_chunks_mut(kp * COLS)
        .enumerate()
        .for_each(|(p, panel)| {
            for (c, row) in w[p * COLS * k..].chunks_exact(k).take(COLS).enumerate() {
                for (i, &v) in row.iter().enumerate() {
                    panel[place(i, c)] = v;
                }
            }
        });
    out
}

/// W (`[n, k]` row-major) again from [`panels_placed`]' panels of `kp` terms.
pub(crate) fn rows_placed<T: Copy + Default>(
    panels: &[T],
    n: usize,
    k: usize,
    kp: usize,
    place: impl Fn(usize, usize) -> usize,
) -> Vec<T> {
    let mut w = vec![T::default(); n * k];
    for (j, row) in w.chunks_exact_mut(k).enumerate() {
        let (p, c) = (j / COLS, j % COLS);
        for (i, v) in row.iter_mut().enumerate() {
            *v = panels[p * kp * COLS + place(i, c)];
        }
    }
    w
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
    /// Whether there is nothing to apply (no bias, no residual, no GELU).
    pub(crate) fn is_none(&self) -> bool {
        self.bias.is_none() && self.residual.is_none() && !self.gelu
    }

    /// Applies itself to a task's block of the output: rows `rows` × the columns of panels
    /// `panels` of `dst` (`out` values a row).
    ///
    /// # Safety
    /// `dst` holds those rows, all of the block's values written, and no other thread touches
    /// the block.
    pub(crate) unsafe fn apply_block(
        &self,
        dst: Output,
        rows: Range<usize>,
        panels: Range<usize>,
        out: usize,
    ) {
        if self.is_none() {
            return;
        }
        let cols = panels.start * COLS..(panels.end * COLS).min(out);
        for r in rows {
            // SAFETY: the block's columns of row r (the caller's).
            let seg = unsafe {
                std::slice::from_raw_parts_mut(dst.0.add(r * out + cols.start), cols.len())
            };
            self.apply(seg, r, cols.clone(), out);
        }
    }

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
pub(crate) struct Output(pub(crate) *mut f32);
// SAFETY: the tasks write disjoint parts of the buffer (see `PackedWeight::product`).
unsafe impl Send for Output {}
unsafe impl Sync for Output {}

/// One task of a product: output rows `rows` × the columns of panels `panels` of `x·Wᵀ` into
/// `dst` (`out` values a row), then `finish`; `x`'s rows are `x_rs` apart.
pub(crate) struct Task<'a> {
    pub x: &'a [f32],
    pub x_rs: usize,
    pub rows: Range<usize>,
    pub panels: Range<usize>,
    pub dst: Output,
    pub finish: Finish<'a>,
}

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
            CpuStorage::BF16(w) if crate::amx_cpu::available() => {
                Panels::BF16Pairs(crate::amx_cpu::pair_panels(&w[a..b], out, depth))
            }
            CpuStorage::BF16(w) => Panels::BF16(panels_of(&w[a..b], out, depth)),
            other => candle_core::bail!(
                "fused_linear (CPU): a {:?} weight, not f32, f16 or bf16",
                other.dtype()
            ),
        };
        Ok(Self { out, depth, panels })
    }

    /// Whether the product runs on AMX tiles (a bf16 weight packed as pairs).
    pub(crate) fn amx(&self) -> bool {
        matches!(self.panels, Panels::BF16Pairs(_))
    }

    /// Rows of W (`out`).
    pub(crate) fn out(&self) -> usize {
        self.out
    }

    /// Columns of W (`in`, the product's K).
    pub(crate) fn depth(&self) -> usize {
        self.depth
    }

    /// The dtype the weight was packed from (its panels').
    pub(crate) fn dtype(&self) -> candle_core::DType {
        match self.panels {
            Panels::F32(_) => candle_core::DType::F32,
            Panels::F16(_) => candle_core::DType::F16,
            Panels::BF16(_) | Panels::BF16Pairs(_) => candle_core::DType::BF16,
        }
    }

    /// W again, `[out, in]` in its dtype, on the CPU.
    pub(crate) fn unpack(&self) -> Tensor {
        fn rows_of<T: Copy + Default>(panels: &[T], n: usize, k: usize) -> Vec<T> {
            rows_placed(panels, n, k, k, |i, c| i * COLS + c)
        }
        let (n, k, dev) = (self.out, self.depth, &candle_core::Device::Cpu);
        let w = match &self.panels {
            Panels::F32(v) => Tensor::from_vec(rows_of(v, n, k), (n, k), dev),
            Panels::F16(v) => Tensor::from_vec(rows_of(v, n, k), (n, k), dev),
            Panels::BF16(v) => Tensor::from_vec(rows_of(v, n, k), (n, k), dev),
            Panels::BF16Pairs(v) => Tensor::from_vec(crate::amx_cpu::unpair(v, n, k), (n, k), dev),
        };
        w.expect("fused_linear (CPU): n × k values make an [n, k] tensor")
    }

    /// `finish(x·Wᵀ)` for `x` `[rows, in]` (f32, rows `x_rs` apart, each contiguous):
    /// `[rows, out]` row-major, on the tiles [`cpu_packed`] chose.
    ///
    /// # Panics
    /// If `x` is too short for those rows, the bias is not `[out]` or the residual not
    /// `[rows, out]`, or the CPU has no tiles ([`cpu_packed`] is false).
    pub(crate) fn product(
        &self,
        x: &[f32],
        x_rs: usize,
        rows: usize,
        finish: Finish<'_>,
    ) -> Vec<f32> {
        self.product_with(self.kernel(), x, x_rs, rows, finish)
    }

    /// `finish(x·Wᵀ)` for `rows` rows of `x` (f32, contiguous, `depth` terms a row) into `out`
    /// (`[rows, out]` row-major), every panel, on the calling thread: one task of
    /// [`Self::product`] covering the whole output, so the same bits. For callers that split
    /// the rows over the pool themselves (`block_cpu`).
    ///
    /// # Panics
    /// If `x` or `out` is too short for `rows` rows, the bias is not `[out]` or the residual not
    /// `[rows, out]`, or the CPU has no tiles ([`cpu_packed`] is false).
    pub(crate) fn product_serial(
        &self,
        x: &[f32],
        rows: usize,
        finish: Finish<'_>,
        out: &mut [f32],
    ) {
        let kernel = self.kernel();
        let (n, k) = (self.out, self.depth);
        self.assert_operands(kernel, x, k, rows, finish);
        assert!(out.len() >= rows * n);
        let (panels, dst) = (0..n.div_ceil(COLS), Output(out.as_mut_ptr()));
        let task = Task {
            x,
            x_rs: k,
            rows: 0..rows,
            panels,
            dst,
            finish,
        };
        // SAFETY: the CPU has the kernel's features and x, out, the bias and the residual hold
        // every value the task reads or writes (asserted above; x's rows are `k` apart, so
        // `rows · k` values); `out` is borrowed mutably, so
        // no other thread touches it.
        unsafe { self.run_task(kernel, task) }
    }

    /// What the tiles, which read and write through raw pointers, need to hold: the CPU has
    /// `kernel`'s features, `x` holds `rows` rows of `depth` terms `x_rs` apart, the bias is
    /// `[out]` and the residual `[rows, out]`.
    fn assert_operands(
        &self,
        kernel: Kernel,
        x: &[f32],
        x_rs: usize,
        rows: usize,
        finish: Finish<'_>,
    ) {
        let (n, k) = (self.out, self.depth);
        let supported = match kernel {
            Kernel::Avx2 => has_fma(),
            Kernel::Avx512 => has_avx512(),
            Kernel::Amx => crate::amx_cpu::available() && self.amx(),
        };
        assert!(
            supported,
            "fused_linear (CPU): {kernel:?} tiles on a CPU without them"
        );
        assert!(rows > 0 && k > 0 && x_rs >= k && x.len() >= (rows - 1) * x_rs + k);
        assert!(finish.bias.is_none_or(|b| b.len() == n));
        assert!(finish.residual.is_none_or(|r| r.len() == rows * n));
    }

    /// The tiles this weight's product runs on: AMX for pair panels, else the CPU's
    /// ([`cpu_packed`]).
    ///
    /// # Panics
    /// If the CPU has no tiles ([`cpu_packed`] is false).
    fn kernel(&self) -> Kernel {
        match self.panels {
            Panels::BF16Pairs(_) => Kernel::Amx,
            _ => kernel().expect("fused_linear (CPU): packed product without AVX2 + FMA"),
        }
    }

    /// `task` on `kernel`'s tiles ([`Self::task`] for the AVX ones, [`crate::amx_cpu::task`] for
    /// AMX).
    ///
    /// # Safety
    /// What [`Self::assert_operands`] checks for `kernel` and the task's operands, and
    /// [`Self::task`]'s.
    unsafe fn run_task(&self, kernel: Kernel, task: Task<'_>) {
        // SAFETY: the caller's.
        unsafe {
            match kernel {
                Kernel::Avx2 => self.task_avx2(task),
                Kernel::Avx512 => self.task_avx512(task),
                Kernel::Amx => {
                    let Panels::BF16Pairs(w) = &self.panels else {
                        unreachable!("assert_operands checks that AMX tasks have pair panels")
                    };
                    crate::amx_cpu::task(w, self.out, self.depth, task)
                }
            }
        }
    }

    /// [`Self::product`] on `kernel`'s tiles.
    fn product_with(
        &self,
        kernel: Kernel,
        x: &[f32],
        x_rs: usize,
        rows: usize,
        finish: Finish<'_>,
    ) -> Vec<f32> {
        let (n, k) = (self.out, self.depth);
        self.assert_operands(kernel, x, x_rs, rows, finish);
        let len = rows * n;
        let mut out = Vec::<f32>::with_capacity(len);
        let dst = Output(out.as_mut_ptr());

        let panel_count = n.div_ceil(COLS);
        let tile_rows = kernel.rows();
        let tiles = rows.div_ceil(tile_rows);
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
            .max(tiles.div_ceil(TASK_ROWS / tile_rows));
        let rows_per_task = tiles.div_ceil(row_tasks) * tile_rows;
        let panel_tasks = wanted
            .div_ceil(row_tasks)
            .min(panel_count.div_ceil(8))
            .max(1);
        // An even count of panels a task, so that AVX-512's two-panel tiles pair them alike
        // whatever the split.
        let panels_per_task = panel_count.div_ceil(panel_tasks).next_multiple_of(2);
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
            let task = Task {
                x,
                x_rs,
                rows: rows.clone(),
                panels: panels.clone(),
                dst,
                finish,
            };
            // SAFETY: the CPU has the kernel's features (asserted above); x holds every row
            // the task reads, and the tasks' output blocks (their rows × their panels'
            // columns) are disjoint parts of `out`, which has room for `len` values.
            unsafe { self.run_task(kernel, task) }
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

    /// [`Self::task`] on AVX2 tiles.
    ///
    /// # Safety
    /// AVX2 and FMA, and [`Self::task`]'s.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn task_avx2(&self, task: Task<'_>) {
        // SAFETY: the caller's.
        unsafe { self.task::<Avx2Tiles>(task) }
    }

    /// [`Self::task`] on AVX-512 tiles.
    ///
    /// # Safety
    /// AVX-512F, AVX2 and FMA, and [`Self::task`]'s.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn task_avx512(&self, task: Task<'_>) {
        // SAFETY: the caller's.
        unsafe { self.task::<Avx512Tiles>(task) }
    }

    #[cfg(not(target_arch = "x86_64"))]
    unsafe fn task_avx2(&self, _: Task<'_>) {
        unreachable!("product asserts the kernel's features first")
    }

    #[cfg(not(target_arch = "x86_64"))]
    unsafe fn task_avx512(&self, _: Task<'_>) {
        unreachable!("product asserts the kernel's features first")
    }

    /// This panel's block of K terms `k0 .. k0 + terms` as f32: in place for an f32 weight,
    /// widened into `buf` otherwise.
    #[inline(always)]
    fn block<'b>(&'b self, p: usize, k0: usize, terms: usize, buf: &'b mut [f32]) -> &'b [f32] {
        let k = self.depth;
        let block = (p * k + k0) * COLS..(p * k + k0 + terms) * COLS;
        match &self.panels {
            Panels::F32(v) => &v[block],
            Panels::F16(v) => {
                HalfSlice::widen(&v[block], &mut buf[..terms * COLS]);
                &buf[..terms * COLS]
            }
            Panels::BF16(v) => {
                HalfSlice::widen(&v[block], &mut buf[..terms * COLS]);
                &buf[..terms * COLS]
            }
            Panels::BF16Pairs(_) => unreachable!("pair panels run on AMX tiles only"),
        }
    }

    /// One task (output rows `rows` × the columns of panels `panels`, then its finish) on `T`'s
    /// tiles.
    ///
    /// # Safety
    /// The CPU has `T`'s features; `x` holds rows `rows` (`x_rs` apart, `depth` terms each);
    /// `dst` has room for `[rows.end, out]` values and no other thread touches this task's
    /// block.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn task<T: Tiles>(&self, task: Task<'_>) {
        let Task {
            x,
            x_rs,
            rows,
            panels,
            dst,
            finish,
        } = task;
        let (n, k, tr) = (self.out, self.depth, T::ROWS);
        // The task's rows of x for one K block, a tile's rows interleaved term by term, so that
        // a tile's broadcasts a term come from one stream (a last tile of m < T::ROWS rows
        // leaves the other places as they were: it reads only its m).
        // Kept per thread: a fresh buffer of this size (≤ 240 KB) is a fresh mapping, whose
        // page faults cost as much as the packing.
        thread_local!(static INTERLEAVED: std::cell::RefCell<Vec<f32>> = const {
            std::cell::RefCell::new(Vec::new())
        });
        // Half-precision blocks (a tile's one or two panels) widened here, then read by every
        // row tile of the task; kept per thread too (a stack array zeroed 32 KB a task), and
        // none for f32 panels, which the tiles read in place.
        thread_local!(static WIDENED: std::cell::RefCell<Vec<f32>> = const {
            std::cell::RefCell::new(Vec::new())
        });
        let tile_count = rows.len().div_ceil(tr);
        let size = tile_count * tr * DEPTH.min(k);
        // Taken out and put back rather than borrowed in a closure: a closure is compiled
        // without this function's caller's target features, so its intrinsics would be calls.
        let mut interleaved = INTERLEAVED.take();
        if interleaved.len() < size {
            interleaved.resize(size, 0.0);
        }
        let mut widened = WIDENED.take();
        let half = !matches!(self.panels, Panels::F32(_));
        if half && widened.len() < 2 * DEPTH * COLS {
            widened.resize(2 * DEPTH * COLS, 0.0);
        }
        let widened_half = widened.len() / 2;
        for k0 in (0..k).step_by(DEPTH) {
            let terms = (k - k0).min(DEPTH);
            for (t, tile) in interleaved[..tile_count * tr * terms]
                .chunks_exact_mut(tr * terms)
                .enumerate()
            {
                for (r, row) in (rows.start + t * tr..rows.end).take(tr).enumerate() {
                    let src = &x[row * x_rs + k0..row * x_rs + k0 + terms];
                    for (i, &v) in src.iter().enumerate() {
                        tile[i * tr + r] = v;
                    }
                }
            }
            let first = k0 == 0;
            let mut p = panels.start;
            while p < panels.end {
                let col = p * COLS;
                // Two panels a tile where the kernel takes two and both are whole.
                let pair = T::PAIRS && p + 1 < panels.end && col + 2 * COLS <= n;
                let width = (n - col).min(COLS);
                let (w0, w1) = widened.split_at_mut(widened_half);
                let b0 = self.block(p, k0, terms, w0).as_ptr();
                let b1 = if pair {
                    self.block(p + 1, k0, terms, w1).as_ptr()
                } else {
                    b0
                };
                for (t, r) in rows.clone().step_by(tr).enumerate() {
                    let m = (rows.end - r).min(tr);
                    // SAFETY: tile t of the interleaved rows (`terms` terms of T::ROWS
                    // values); `terms` rows of 16 values at b0 (and b1); rows r .. r + m,
                    // columns col .. col + width (+ 16 for a pair) of dst (this task's
                    // block); the CPU has T's features (the caller's).
                    unsafe {
                        let a = interleaved.as_ptr().add(t * tr * terms);
                        let c = dst.0.add(r * n + col);
                        if pair || width == COLS {
                            T::tile(m, a, terms, [b0, b1], pair, c, n, first);
                        } else {
                            // The last panel's valid columns, through a full-width buffer.
                            let mut buf = [0f32; MAX_ROWS * COLS];
                            if !first {
                                for i in 0..m {
                                    std::ptr::copy_nonoverlapping(
                                        c.add(i * n),
                                        buf.as_mut_ptr().add(i * COLS),
                                        width,
                                    );
                                }
                            }
                            T::tile(m, a, terms, [b0, b0], false, buf.as_mut_ptr(), COLS, first);
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
                p += if pair { 2 } else { 1 };
            }
        }
        INTERLEAVED.set(interleaved);
        WIDENED.set(widened);
        // SAFETY: this task's block, every value written above (the caller's dst).
        unsafe { finish.apply_block(dst, rows, panels, n) }
    }
}

/// A kernel's register tiles, for [`PackedWeight::task`]. `a` is a tile's rows of x
/// interleaved (row `r`'s term `i` at `i·ROWS + r`), `k` terms; a panel block is `k` rows of 16
/// values back to back; `c`'s rows are `c_rs` apart. A tile starts from zero when `first`,
/// from `c`'s values otherwise, and adds its `k` products in order, one fused multiply-add
/// each.
#[cfg(target_arch = "x86_64")]
trait Tiles {
    /// Rows of a full tile.
    const ROWS: usize;
    /// Whether a full tile spans two panels.
    const PAIRS: bool;
    /// `m` (1 ..= ROWS) rows × the 16 columns of panel block `b[0]`, and those of `b[1]` after
    /// them when `pair` (only where `PAIRS`).
    ///
    /// # Safety
    /// The CPU has the kernel's features; the pointers valid for those rows and columns.
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile(
        m: usize,
        a: *const f32,
        k: usize,
        b: [*const f32; 2],
        pair: bool,
        c: *mut f32,
        c_rs: usize,
        first: bool,
    );
}

/// AVX2 + FMA: 6 × 16 tiles.
#[cfg(target_arch = "x86_64")]
struct Avx2Tiles;

#[cfg(target_arch = "x86_64")]
impl Tiles for Avx2Tiles {
    const ROWS: usize = Kernel::Avx2.rows();
    const PAIRS: bool = false;

    #[inline(always)]
    unsafe fn tile(
        m: usize,
        a: *const f32,
        k: usize,
        b: [*const f32; 2],
        pair: bool,
        c: *mut f32,
        c_rs: usize,
        first: bool,
    ) {
        debug_assert!(!pair, "AVX2 tiles span one panel");
        let b = b[0];
        // SAFETY: the caller's.
        unsafe {
            match m {
                6 => tile_avx2::<6>(a, k, b, c, c_rs, first),
                5 => tile_avx2::<5>(a, k, b, c, c_rs, first),
                4 => tile_avx2::<4>(a, k, b, c, c_rs, first),
                3 => tile_avx2::<3>(a, k, b, c, c_rs, first),
                2 => tile_avx2::<2>(a, k, b, c, c_rs, first),
                1 => tile_avx2::<1>(a, k, b, c, c_rs, first),
                _ => unreachable!("an AVX2 tile has 1 to 6 rows"),
            }
        }
    }
}

/// AVX-512: 8 × 32 tiles (8 × 16 for an unpaired panel).
#[cfg(target_arch = "x86_64")]
struct Avx512Tiles;

#[cfg(target_arch = "x86_64")]
impl Tiles for Avx512Tiles {
    const ROWS: usize = Kernel::Avx512.rows();
    const PAIRS: bool = true;

    #[inline(always)]
    unsafe fn tile(
        m: usize,
        a: *const f32,
        k: usize,
        b: [*const f32; 2],
        pair: bool,
        c: *mut f32,
        c_rs: usize,
        first: bool,
    ) {
        // SAFETY: the caller's.
        unsafe {
            if pair {
                avx512_rows::<2>(m, a, k, b, c, c_rs, first)
            } else {
                avx512_rows::<1>(m, a, k, b, c, c_rs, first)
            }
        }
    }
}

/// [`tile_avx512`] for `m` (1 ..= 8) rows of `P` panels.
///
/// # Safety
/// As [`tile_avx512`].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn avx512_rows<const P: usize>(
    m: usize,
    a: *const f32,
    k: usize,
    b: [*const f32; 2],
    c: *mut f32,
    c_rs: usize,
    first: bool,
) {
    // SAFETY: the caller's.
    unsafe {
        match m {
            8 => tile_avx512::<8, P>(a, k, b, c, c_rs, first),
            7 => tile_avx512::<7, P>(a, k, b, c, c_rs, first),
            6 => tile_avx512::<6, P>(a, k, b, c, c_rs, first),
            5 => tile_avx512::<5, P>(a, k, b, c, c_rs, first),
            4 => tile_avx512::<4, P>(a, k, b, c, c_rs, first),
            3 => tile_avx512::<3, P>(a, k, b, c, c_rs, first),
            2 => tile_avx512::<2, P>(a, k, b, c, c_rs, first),
            1 => tile_avx512::<1, P>(a, k, b, c, c_rs, first),
            _ => unreachable!("an AVX-512 tile has 1 to 8 rows"),
        }
    }
}

/// `c[r][0..16] (+)= Σ_i a[r][i] · b[i][0..16]` for `R` rows, as [`Tiles::tile`] with 6-row
/// interleaving. The accumulators are indexed by constants once the loops over `R` unroll, so
/// they stay in registers.
///
/// # Safety
/// AVX2 and FMA; the pointers valid for those rows.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn tile_avx2<const R: usize>(
    a: *const f32,
    k: usize,
    b: *const f32,
    c: *mut f32,
    c_rs: usize,
    first: bool,
) {
    use std::arch::x86_64::*;
    const ROWS: usize = Kernel::Avx2.rows();
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

/// `R` rows × `P` panels (16 columns each, panel `j`'s block at `b[j]`), as [`Tiles::tile`] with 8-row
/// interleaving: one AVX-512 vector a row and panel.
///
/// # Safety
/// AVX-512F; the pointers valid for those rows.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn tile_avx512<const R: usize, const P: usize>(
    a: *const f32,
    k: usize,
    b: [*const f32; 2],
    c: *mut f32,
    c_rs: usize,
    first: bool,
) {
    use std::arch::x86_64::*;
    const ROWS: usize = Kernel::Avx512.rows();
    // SAFETY: the caller's.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); P]; R];
        if !first {
            for (r, acc) in acc.iter_mut().enumerate() {
                for (j, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm512_loadu_ps(c.add(r * c_rs + j * COLS));
                }
            }
        }
        for i in 0..k {
            let mut bv = [_mm512_setzero_ps(); P];
            for (j, v) in bv.iter_mut().enumerate() {
                *v = _mm512_loadu_ps(b[j].add(i * COLS));
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                let w = _mm512_set1_ps(*a.add(i * ROWS + r));
                for (acc, v) in acc.iter_mut().zip(&bv) {
                    *acc = _mm512_fmadd_ps(w, *v, *acc);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (j, acc) in acc.iter().enumerate() {
                _mm512_storeu_ps(c.add(r * c_rs + j * COLS), *acc);
            }
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

    /// Each value is the ordered FMA chain over K, so its bits depend neither on the kernel nor
    /// on how the rows and panels are split into tasks or K into blocks: checked against that
    /// chain written out for every kernel this CPU has, on shapes with partial tiles, panels
    /// paired and unpaired, a partial last panel and three K blocks, for every thread count
    /// the split depends on.
    #[test]
    fn values_are_the_ordered_fma_chain() {
        let kernels: Vec<Kernel> = [(Kernel::Avx2, has_fma()), (Kernel::Avx512, has_avx512())]
            .into_iter()
            .filter_map(|(k, has)| has.then_some(k))
            .collect();
        let none = Finish {
            bias: None,
            residual: None,
            gelu: false,
        };
        for n in [40, 56] {
            let (rows, k) = (203, 2 * DEPTH + 7);
            let x: Vec<f32> = (0..rows * k)
                .map(|v| ((v * 37 % 101) as f32 - 50.0) / 31.0)
                .collect();
            let w: Vec<f32> = (0..n * k)
                .map(|v| ((v * 53 % 97) as f32 - 48.0) / 29.0)
                .collect();
            let packed = PackedWeight::pack(
                &Tensor::from_slice(&w, (n, k), &candle_core::Device::Cpu).unwrap(),
            )
            .unwrap();
            for &kernel in &kernels {
                for threads in [1, 2, 5] {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .build()
                        .unwrap();
                    let got = pool.install(|| packed.product_with(kernel, &x, k, rows, none));
                    for i in 0..rows {
                        for j in 0..n {
                            let want =
                                (0..k).fold(0f32, |s, t| x[i * k + t].mul_add(w[j * k + t], s));
                            assert_eq!(
                                got[i * n + j].to_bits(),
                                want.to_bits(),
                                "{kernel:?} n={n} threads={threads} [{i}, {j}]"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Where AMX runs the bf16 product (pair panels): every value within the rounding of its
    /// K additions of the exact sum of its bf16 products (each exact in f32), the same bits
    /// for every thread count and from [`PackedWeight::product_serial`], and the finish applied
    /// as on the AVX tiles; shapes with a partial row tile, an unpaired partial last panel and
    /// K not a multiple of the tile step. Elsewhere bf16 packs into ordinary panels (and the
    /// test above covers them). Prints how many values equal the AVX path's ordered FMA chain.
    #[test]
    fn amx_products_are_the_bf16_sums() {
        let dev = &candle_core::Device::Cpu;
        let (rows, k, n) = (45, 2 * DEPTH + 7, 40);
        let bf = |v: f32| bf16::from_f32(v).to_f32();
        let x: Vec<f32> = (0..rows * k)
            .map(|v| bf(((v * 37 % 101) as f32 - 50.0) / 31.0))
            .collect();
        let w: Vec<f32> = (0..n * k)
            .map(|v| bf(((v * 53 % 97) as f32 - 48.0) / 29.0))
            .collect();
        let wt = Tensor::from_slice(&w, (n, k), dev)
            .unwrap()
            .to_dtype(candle_core::DType::BF16)
            .unwrap();
        let packed = PackedWeight::pack(&wt).unwrap();
        let pairs = packed.amx();
        assert_eq!(pairs, crate::amx_cpu::available());
        if !pairs {
            eprintln!("amx_products_are_the_bf16_sums: no AMX here, bf16 packs into AVX panels");
            return;
        }
        let bias: Vec<f32> = (0..n).map(|j| j as f32 / 8.0).collect();
        let none = Finish {
            bias: None,
            residual: None,
            gelu: false,
        };
        let mut same_as_chain = 0;
        let mut outs = Vec::new();
        for threads in [1, 2, 5] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            outs.push(pool.install(|| packed.product(&x, k, rows, none)));
        }
        let mut serial = vec![f32::NAN; rows * n];
        packed.product_serial(&x, rows, none, &mut serial);
        outs.push(serial);
        let got = &outs[0];
        for (i, o) in outs.iter().enumerate() {
            assert!(
                o.iter().zip(got).all(|(a, b)| a.to_bits() == b.to_bits()),
                "AMX run {i} differs from the first"
            );
        }
        for i in 0..rows {
            for j in 0..n {
                let terms = (0..k).map(|t| x[i * k + t] as f64 * w[j * k + t] as f64);
                let exact: f64 = terms.clone().sum();
                let size: f64 = terms.map(f64::abs).sum();
                let bound = 1.01 * k as f64 * f32::EPSILON as f64 / 2.0 * size + 1e-30;
                let g = got[i * n + j];
                assert!(
                    (g as f64 - exact).abs() <= bound,
                    "[{i}, {j}]: {g} against {exact} (bound {bound})"
                );
                let chain = (0..k).fold(0f32, |s, t| x[i * k + t].mul_add(w[j * k + t], s));
                same_as_chain += usize::from(g.to_bits() == chain.to_bits());
            }
        }
        eprintln!(
            "amx_products_are_the_bf16_sums: {same_as_chain} of {} values equal the ordered FMA chain",
            rows * n
        );
        let finish = Finish {
            bias: Some(&bias),
            residual: None,
            gelu: true,
        };
        let finished = packed.product(&x, k, rows, finish);
        for i in 0..rows {
            let mut want = got[i * n..(i + 1) * n].to_vec();
            finish.apply(&mut want, i, 0..n, n);
            let g = &finished[i * n..(i + 1) * n];
            assert!(
                g.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                "row {i}: the finish"
            );
        }
    }
}
