//! Bidirectional attention over a packed batch of variable-length sequences.

use crate::attention_amx::PairedKeysValues;
use crate::batch::{RaggedBatch, MAX_SEQ_LEN};
use crate::cpu::Float32;
use crate::error::{RaggedError, Result};
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};
use rayon::prelude::*;

/// Head dimensions the kernels are built for (64 is the one tuned hardest).
pub const SUPPORTED_HEAD_DIMS: &[usize] = &[32, 64, 128];

const OP: &str = "ragged_attention";

/// The op's settings: which rows form which sequence, and the softmax scale.
/// Applied to `(q, k, v)` through [`ragged_attention`], which validates everything first.
pub struct RaggedAttention<'a> {
    pub batch: &'a RaggedBatch,
    pub softmax_scale: f32,
}

/// Bidirectional attention within each sequence of a packed batch:
/// for every sequence `b`, head `h` and query row `i` of `b`,
/// `o[i, h] = Σ_j softmax_j(q[i, h] · k[j, h] · softmax_scale) v[j, h]`, `j` over the rows of `b` only.
///
/// # Arguments
/// * `q`, `k`, `v` - `[total_tokens, heads, head_dim]`, same dtype (f32, f16 or bf16) and device.
///   The last dimension must be contiguous; the token and head strides are free, so strided views of
///   a fused projection `qkv: [total, 3, heads, head_dim]` (`qkv.i((.., 0))` etc.) are read in place.
/// * `batch` - the packed layout; `batch.total_tokens()` must equal `total_tokens`.
/// * `softmax_scale` - usually `1 / sqrt(head_dim)`.
///
/// # Returns
/// `[total_tokens, heads, head_dim]`, contiguous (so `reshape((total, heads * head_dim))` is free), in
/// the input dtype; the arithmetic accumulates in f32 on every device.
///
/// `head_dim` must be one of [`SUPPORTED_HEAD_DIMS`] and every sequence at most [`MAX_SEQ_LEN`]
/// tokens; anything else is a [`RaggedError`] before any kernel is launched.
///
/// On CUDA, f16 / bf16 batches whose sequences are at most 256 tokens with `head_dim` ≤ 64 (ViTs
/// at 224 px) run a kernel that keeps each (sequence, head)'s whole K and V in shared memory;
/// other batches stream K and V in tiles. When a batch is small enough to fill at most about one
/// wave of warps (one image), four or eight warps share each query tile's keys and merge their
/// softmax states. All give the same results up to f32 summation order.
/// `CANDLE_RAGGED_ATTENTION=tiled` in the environment (read once per device) forces the tiled one,
/// `=wgmma1` a Hopper warpgroup-MMA kernel for f16 / bf16, head_dim 64, up to 256 tokens (built
/// with `CUDA_COMPUTE_CAP` >= 90, used on compute capability 9.0 only),
/// `CANDLE_RAGGED_KEY_PARTS=1` keeps one warp per query tile and `=4` at most four; all for A/B
/// measurements.
///
/// On the CPU, each block of up to 64 query rows of each (sequence, head) is a task on rayon's
/// pool, run on f32 register tiles (AVX-512 or AVX2 + FMA where the CPU has them); bf16 heads
/// whose `head_dim` is a multiple of 32 run on Intel AMX tiles where the CPU has AMX-BF16, their
/// probabilities rounded to bf16 before the product with V, as FlashAttention's tensor-core
/// kernels do (`CANDLE_RAGGED_CPU_AMX=0` keeps the f32 tiles).
pub fn ragged_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    batch: &RaggedBatch,
    softmax_scale: f32,
) -> Result<Tensor> {
    validate(q, k, v, batch, softmax_scale)?;
    // The CUDA kernel stages rows with 16-byte copies: a view whose offsets or strides are not
    // multiples of 8 elements (rare: only odd narrowing produces one) is made contiguous first.
    let (q, k, v) = (aligned(q)?, aligned(k)?, aligned(v)?);
    let op = RaggedAttention {
        batch,
        softmax_scale,
    };
    Ok(q.apply_op3_no_bwd(&k, &v, &op)?)
}

fn validate(q: &Tensor, k: &Tensor, v: &Tensor, batch: &RaggedBatch, scale: f32) -> Result<()> {
    let q_dims = match q.dims() {
        &[t, h, d] => (t, h, d),
        _ => {
            return Err(RaggedError::Rank {
                op: OP,
                what: "q",
                expected: 3,
                shape: q.shape().clone(),
            })
        }
    };
    for (what, t) in [("k", k), ("v", v)] {
        if t.rank() != 3 {
            return Err(RaggedError::Rank {
                op: OP,
                what,
                expected: 3,
                shape: t.shape().clone(),
            });
        }
        if t.dims() != q.dims() {
            return Err(RaggedError::ShapeMismatch {
                op: OP,
                what,
                expected: q.shape().clone(),
                found: t.shape().clone(),
            });
        }
        if t.dtype() != q.dtype() {
            return Err(RaggedError::DTypeMismatch {
                op: OP,
                what,
                expected: q.dtype(),
                found: t.dtype(),
            });
        }
        if !t.device().same_device(q.device()) {
            return Err(device_mismatch(what, q, t.device()));
        }
    }
    if !batch.device().same_device(q.device()) {
        return Err(device_mismatch("cu_seqlens", q, batch.device()));
    }
    if !matches!(q.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        return Err(RaggedError::UnsupportedDType {
            op: OP,
            dtype: q.dtype(),
        });
    }
    let (total, _heads, head_dim) = q_dims;
    if !SUPPORTED_HEAD_DIMS.contains(&head_dim) {
        return Err(RaggedError::UnsupportedHeadDim {
            op: OP,
            head_dim,
            supported: SUPPORTED_HEAD_DIMS,
        });
    }
    if total != batch.total_tokens() {
        return Err(RaggedError::TotalMismatch {
            op: OP,
            what: "q",
            expected: batch.total_tokens(),
            found: total,
        });
    }
    if batch.max_len() > MAX_SEQ_LEN {
        return Err(RaggedError::SequenceTooLong {
            op: OP,
            len: batch.max_len(),
            limit: MAX_SEQ_LEN,
        });
    }
    for (what, t) in [("q", q), ("k", k), ("v", v)] {
        if t.stride()[2] != 1 {
            return Err(RaggedError::LastDimNotContiguous {
                op: OP,
                what,
                stride: t.stride().to_vec(),
            });
        }
    }
    if !scale.is_finite() {
        return Err(RaggedError::BadScale { op: OP, scale });
    }
    Ok(())
}

fn device_mismatch(what: &'static str, q: &Tensor, found: &candle_core::Device) -> RaggedError {
    RaggedError::DeviceMismatch {
        op: OP,
        what,
        expected: format!("{:?}", q.device().location()),
        found: format!("{:?}", found.location()),
    }
}

fn aligned(t: &Tensor) -> Result<Tensor> {
    let l = t.layout();
    let ok = l.start_offset().is_multiple_of(8) && l.stride()[..2].iter().all(|s| s % 8 == 0);
    Ok(if ok { t.clone() } else { t.contiguous()? })
}

impl CustomOp3 for RaggedAttention<'_> {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let shape = l1.shape().clone();
        let storage = match (s1, s2, s3) {
            (CpuStorage::F32(q), CpuStorage::F32(k), CpuStorage::F32(v)) => {
                CpuStorage::F32(self.cpu_attention(q, l1, k, l2, v, l3)?)
            }
            (CpuStorage::F16(q), CpuStorage::F16(k), CpuStorage::F16(v)) => {
                CpuStorage::F16(self.cpu_attention(q, l1, k, l2, v, l3)?)
            }
            (CpuStorage::BF16(q), CpuStorage::BF16(k), CpuStorage::BF16(v)) => {
                CpuStorage::BF16(self.cpu_attention(q, l1, k, l2, v, l3)?)
            }
            _ => {
                use candle_core::backend::BackendStorage;
                return Err(RaggedError::UnsupportedDType {
                    op: OP,
                    dtype: s1.dtype(),
                }
                .into());
            }
        };
        Ok((storage, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::attention(self.batch, self.softmax_scale, (s1, l1), (s2, l2), (s3, l3))
    }
}

impl RaggedAttention<'_> {
    /// CPU path: per sequence and head, scores in f32, a max-subtracted softmax, then the
    /// weighted sum of values. First every (sequence, head)'s keys and values are packed once, in
    /// one parallel pass ([`KeysValues`]: K transposed, V gathered; [`PairedKeysValues`] for AMX);
    /// then every block of up to [`UNIT_QUERIES`] query rows of every (sequence, head) is one task
    /// (one image with three heads is still twelve tasks, so two or more cores end together),
    /// which writes its rows of its head straight into the output. A block runs
    /// [`fma::attend_rows`] (x86-64 with AVX2 and FMA: matmul register tiles;
    /// [`fma::attend_rows_512`] with AVX-512, the same bits), [`attend_rows`] (any CPU: loops
    /// over independent lanes that keep the bits of one row and one key at a time), or for bf16
    /// where AMX runs [`crate::attention_amx::attend_rows`]. The f32 tiles and the loops sum each
    /// score over the head dims in order and each output over the keys in order; the exponential
    /// is [`exp_f32`], which vectorises (libm's `expf` is a call per score). Before stop 69 the
    /// sequences, heads and blocks were nested parallel loops and each sequence's heads were
    /// copied into the output on one thread: at batch 1 on the 16-core host the attention of
    /// DeiT-B took 1.5× as long (docs/BENCHMARKS.md, the CPU section).
    fn cpu_attention<T: Float32>(
        &self,
        q: &[T],
        lq: &Layout,
        k: &[T],
        lk: &Layout,
        v: &[T],
        lv: &Layout,
    ) -> candle_core::Result<Vec<T>> {
        let (_total, heads, dim) = lq.shape().dims3().expect("validated rank 3");
        let at = |l: &Layout| {
            let s = l.stride();
            (l.start_offset(), s[0], s[1])
        };
        let (qa, ka, va) = (at(lq), at(lk), at(lv));
        let scale = self.softmax_scale;
        let row_len = heads * dim;
        let kernel = cpu_kernel(dim);
        // bf16 heads on AMX tiles where they run (crate::attention_amx).
        let amx = match (T::as_bf16(q), T::as_bf16(k), T::as_bf16(v)) {
            (Some(q), Some(k), Some(v)) if crate::attention_amx::runs(dim) => Some((q, k, v)),
            _ => None,
        };
        let n = self.batch.total_tokens() * row_len;
        // Written once, by the tasks (no zeroing pass first: at 16 threads a serial memset of
        // the output cost more than the attention's own work at batch 1).
        let mut out: Vec<T> = Vec::with_capacity(n);
        let offsets = self.batch.offsets()?;
        if offsets.first().is_some_and(|&first| first != 0) {
            // RaggedBatch validates this; the writes below rely on it.
            candle_core::bail!("ragged_attention (CPU): cu_seqlens must start at 0")
        }
        let covered = offsets.last().map_or(0, |&e| e as usize * row_len).min(n);
        // Each sequence's first row and length (RaggedBatch validated them monotone).
        let seqs: Vec<(usize, usize)> = offsets
            .windows(2)
            .map(|w| (w[0] as usize, w[1].saturating_sub(w[0]) as usize))
            .collect();
        if seqs
            .iter()
            .any(|&(start, len)| (start + len) * row_len > covered)
        {
            candle_core::bail!("ragged_attention (CPU): cu_seqlens past the packed rows")
        }
        let (rows, rest) = out.spare_capacity_mut()[..n].split_at_mut(covered);
        // Rows past the last sequence (a batch sized for more tokens than it holds) stay zero.
        rest.fill(std::mem::MaybeUninit::new(T::from_f32(0.0)));
        // Where (sequence, head) `i`'s rows of an operand laid out as `(first, row, head
        // strides)` start, and their stride.
        let head_at = |i: usize, (first, row_stride, head_stride): (usize, usize, usize)| {
            let (start, h) = (seqs[i / heads].0, i % heads);
            (first + start * row_stride + h * head_stride, row_stride)
        };
        // First every (sequence, head)'s keys and values, packed once for its query blocks.
        let packed: Vec<HeadKeys> = (0..seqs.len() * heads)
            .into_par_iter()
            .map(|i| {
                let len = seqs[i / heads].1;
                match amx {
                    Some((_, k, v)) => HeadKeys::Amx(PairedKeysValues::pack(
                        HeadRows::of(k, head_at(i, ka)),
                        HeadRows::of(v, head_at(i, va)),
                        len,
                        dim,
                    )),
                    None => HeadKeys::Lanes(KeysValues::pack(
                        HeadRows::of(k, head_at(i, ka)),
                        HeadRows::of(v, head_at(i, va)),
                        len,
                        dim,
                    )),
                }
            })
            .collect();
        // Then every block of query rows of every (sequence, head) as one task, which writes its
        // rows' `dim` values of that head into the output.
        let blocks: Vec<(usize, usize, usize)> = (0..seqs.len() * heads)
            .flat_map(|i| {
                let len = seqs[i / heads].1;
                let rows = query_block_rows(len);
                (0..len)
                    .step_by(rows)
                    .map(move |r0| (i, r0, rows.min(len - r0)))
            })
            .collect();
        let dst = Rows(rows.as_mut_ptr());
        blocks.into_par_iter().for_each(|(i, r0, m)| {
            let (first, stride) = head_at(i, qa);
            let first = first + r0 * stride;
            let mut res = vec![0f32; m * dim];
            match (&packed[i], amx) {
                (HeadKeys::Amx(kv), Some((q, _, _))) => {
                    crate::attention_amx::attend_rows(
                        HeadRows::of(q, (first, stride)),
                        kv,
                        scale,
                        &mut res,
                    );
                }
                (HeadKeys::Lanes(kv), _) => attend_rows_dispatch(
                    HeadRows::of(q, (first, stride)),
                    kv,
                    scale,
                    kernel,
                    &mut res,
                ),
                (HeadKeys::Amx(_), None) => unreachable!("AMX keys are packed only with bf16 rows"),
            }
            let (start, h) = (seqs[i / heads].0, i % heads);
            for (r, res) in res.chunks_exact(dim).enumerate() {
                let at = (start + r0 + r) * row_len + h * dim;
                // SAFETY: row start + r0 + r of this sequence (checked inside `covered` above)
                // and head h's `dim` values of it: written by this task alone (the blocks of a
                // (sequence, head) are disjoint rows, the heads disjoint columns).
                let o = unsafe { std::slice::from_raw_parts_mut(dst.ptr().add(at), dim) };
                for (o, &x) in o.iter_mut().zip(res) {
                    o.write(T::from_f32(x));
                }
            }
        });
        // SAFETY: the sequences' rows (offsets start at 0, checked above, and are consecutive)
        // cover the first `covered` values, every head's `dim` values of every row written by
        // its block's task; `rest` holds the others.
        unsafe { out.set_len(n) };
        Ok(out)
    }
}

/// One (sequence, head)'s keys and values as its kernel reads them.
enum HeadKeys {
    /// For the f32-lane kernels ([`cpu_kernel`]).
    Lanes(KeysValues),
    /// For the AMX tiles ([`crate::attention_amx`]).
    Amx(PairedKeysValues),
}

/// The output's rows, which the query blocks' tasks write through.
#[derive(Clone, Copy)]
struct Rows<T>(*mut std::mem::MaybeUninit<T>);
// SAFETY: every task writes its own rows' values of its own head (see `cpu_attention`).
unsafe impl<T: Send> Send for Rows<T> {}
unsafe impl<T: Send> Sync for Rows<T> {}

impl<T> Rows<T> {
    /// The pointer (a method, so that closures capture the `Send` wrapper, not its field).
    fn ptr(self) -> *mut std::mem::MaybeUninit<T> {
        self.0
    }
}

/// `len` rows of `dim` values in `data`: row `i` starts at `first + i · stride`.
#[derive(Clone, Copy)]
pub(crate) struct HeadRows<'a, T> {
    pub(crate) data: &'a [T],
    pub(crate) first: usize,
    pub(crate) stride: usize,
}

impl<'a, T> HeadRows<'a, T> {
    /// The rows of `data` from `first` on, `stride` apart.
    pub(crate) fn of(data: &'a [T], (first, stride): (usize, usize)) -> Self {
        Self {
            data,
            first,
            stride,
        }
    }
}

impl<T: Float32> HeadRows<'_, T> {
    fn at(&self, row: usize, d: usize) -> f32 {
        self.data[self.first + row * self.stride + d].to_f32()
    }

    /// The first `n` rows of `dim` values, contiguous, in f32 (f16 / bf16 through
    /// [`crate::half_cpu`]'s slice conversions: an element at a time, f16 was widened in
    /// software, and the f16 attention ran 1.6× slower on the build machine; for bf16 what this
    /// costs is reading the strided rows of a fused qkv, not the conversion).
    fn widened(&self, n: usize, dim: usize) -> Vec<f32> {
        let mut out = vec![0f32; n * dim];
        for (i, row) in out.chunks_exact_mut(dim).enumerate() {
            T::widen(&self.data[self.first + i * self.stride..][..dim], row);
        }
        out
    }
}

/// Query rows a task of the CPU attention takes at most (see [`query_block_rows`]).
const UNIT_QUERIES: usize = 64;

/// Rows of each block of a `len`-row head: nearly equal blocks, none over [`UNIT_QUERIES`]
/// (197 rows: 50, 50, 50, 47).
pub(crate) fn query_block_rows(len: usize) -> usize {
    len.div_ceil(len.div_ceil(UNIT_QUERIES).max(1)).max(1)
}

/// Keys padded to a multiple of this in [`KeysValues`]: whole vectors (and whole FMA tiles).
const KEY_PAD: usize = 16;

/// One (sequence, head)'s keys and values as the CPU kernels read them, in f32: Kᵀ
/// (`[dim, width]`, the keys padded with zero columns to `width`, a multiple of [`KEY_PAD`], so
/// the last block of scores is whole vectors; the padded scores are 0 and never read) and V
/// (`[len, dim]`, contiguous). Built once per head, read by every block of its query rows.
struct KeysValues {
    kt: Vec<f32>,
    vb: Vec<f32>,
    width: usize,
    len: usize,
    dim: usize,
}

impl KeysValues {
    fn pack<T: Float32>(k: HeadRows<'_, T>, v: HeadRows<'_, T>, len: usize, dim: usize) -> Self {
        let width = len.next_multiple_of(KEY_PAD);
        let mut kt = vec![0f32; dim * width];
        // Each key widened as a row (vectorised), then placed down its column of Kᵀ.
        let mut k_row = vec![0f32; dim];
        for j in 0..len {
            T::widen(&k.data[k.first + j * k.stride..][..dim], &mut k_row);
            for (col, &x) in kt.chunks_exact_mut(width).zip(&k_row) {
                col[j] = x;
            }
        }
        Self {
            kt,
            vb: v.widened(len, dim),
            width,
            len,
            dim,
        }
    }
}

/// Which kernel the CPU attention runs a head with (see [`cpu_kernel`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CpuKernel {
    /// [`attend_rows`]' lane loops (any CPU): one rounding a product and a sum.
    Loops,
    /// [`fma::attend_rows`]: AVX2 + FMA register tiles, 6 rows × 16 columns.
    Fma,
    /// [`fma::attend_rows_512`]: AVX-512 register tiles, 8 rows × 32 columns; the same bits as
    /// [`CpuKernel::Fma`] (each output the same ordered chain of fused multiply-adds).
    Avx512,
}

/// The CPU attention's kernel for head dim `dim`: [`CpuKernel::Avx512`] where the CPU has
/// AVX-512F (and AVX2 and FMA), [`CpuKernel::Fma`] where it has AVX2 and FMA, when `dim` is a
/// multiple of 16 (32, 64 and 128 are); else [`CpuKernel::Loops`]. `CANDLE_RAGGED_CPU_FMA=0`
/// selects the loops (for A/B runs and for the bits of a machine without FMA), `=avx2` the AVX2
/// tiles. The CPU and the variable are read once a process.
fn cpu_kernel(dim: usize) -> CpuKernel {
    static KERNEL: std::sync::OnceLock<CpuKernel> = std::sync::OnceLock::new();
    let best = *KERNEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return match std::env::var("CANDLE_RAGGED_CPU_FMA").as_deref() {
                Ok("0") => CpuKernel::Loops,
                Ok("avx2") => CpuKernel::Fma,
                _ if std::arch::is_x86_feature_detected!("avx512f") => CpuKernel::Avx512,
                _ => CpuKernel::Fma,
            };
        }
        CpuKernel::Loops
    });
    if dim.is_multiple_of(KEY_PAD) {
        best
    } else {
        CpuKernel::Loops
    }
}

/// `out.len() / dim` query rows (from `q`'s first) against the keys and values of `kv`, by
/// `kernel` (the caller checked the CPU, [`cpu_kernel`]): [`fma::attend_rows`],
/// [`fma::attend_rows_512`] or [`attend_rows_wide`].
fn attend_rows_dispatch<T: Float32>(
    q: HeadRows<'_, T>,
    kv: &KeysValues,
    scale: f32,
    kernel: CpuKernel,
    out: &mut [f32],
) {
    match kernel {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: cpu_kernel() saw AVX2 and FMA on this CPU.
        CpuKernel::Fma => unsafe { fma::attend_rows(q, kv, scale, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: cpu_kernel() saw AVX-512F, AVX2 and FMA on this CPU.
        CpuKernel::Avx512 => unsafe { fma::attend_rows_512(q, kv, scale, out) },
        CpuKernel::Loops => attend_rows_wide(q, kv, scale, out),
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("the tile kernels are x86-64 only"),
    }
}

/// [`attend_rows`] compiled for AVX when the CPU has it (8 lanes instead of SSE2's 4; no FMA, so
/// every product and sum rounds exactly as in the baseline build).
fn attend_rows_wide<T: Float32>(q: HeadRows<'_, T>, kv: &KeysValues, scale: f32, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        #[target_feature(enable = "avx")]
        unsafe fn avx<T: Float32>(
            q: HeadRows<'_, T>,
            kv: &KeysValues,
            scale: f32,
            out: &mut [f32],
        ) {
            attend_rows(q, kv, scale, out)
        }
        // SAFETY: the CPU reports AVX.
        return unsafe { avx(q, kv, scale, out) };
    }
    attend_rows(q, kv, scale, out)
}

/// `out.len() / dim` query rows (from `q`'s first) against the keys and values of `kv`, scores
/// scaled by `scale`, into `out` (`[rows, dim]`). Loops over independent lanes (keys for the
/// scores, head dims for the output), query rows two at a time: every sum in the order, and with
/// the roundings, of one row and one key at a time.
#[inline(always)]
fn attend_rows<T: Float32>(q: HeadRows<'_, T>, kv: &KeysValues, scale: f32, out: &mut [f32]) {
    let KeysValues {
        kt,
        vb,
        width,
        len,
        dim,
    } = kv;
    let (width, len, dim) = (*width, *len, *dim);
    // Query rows two at a time: each row of Kᵀ and of V is loaded once for both (the sums of
    // each row are exactly those of one row at a time).
    let mut scores = vec![0f32; 2 * width];
    let mut qrows = vec![0f32; 2 * dim];
    for (pair, out) in out.chunks_mut(2 * dim).enumerate() {
        let n = out.len() / dim;
        for (r, qrow) in qrows.chunks_exact_mut(dim).take(n).enumerate() {
            for (d, qd) in qrow.iter_mut().enumerate() {
                *qd = q.at(2 * pair + r, d);
            }
        }
        if n == 2 {
            let (qa, qb) = qrows.split_at(dim);
            let (sa, sb) = scores.split_at_mut(width);
            // Scores: the head dims' rows of Kᵀ weighted by the query.
            weighted_row_sums::<2, PAIR_BLOCK>([qa, qb], kt, [&mut *sa, &mut *sb]);
            let (sa, sb) = (&mut sa[..len], &mut sb[..len]);
            let denoms = [softmax_numerators(sa, scale), softmax_numerators(sb, scale)];
            // Output: the keys' rows of V weighted by the probabilities.
            let (oa, ob) = out.split_at_mut(dim);
            weighted_row_sums::<2, PAIR_BLOCK>([sa, sb], vb, [&mut *oa, &mut *ob]);
            for (o, denom) in [oa, ob].into_iter().zip(denoms) {
                o.iter_mut().for_each(|a| *a /= denom);
            }
        } else {
            let s = &mut scores[..width];
            weighted_row_sums::<1, BLOCK>([&qrows[..dim]], kt, [&mut *s]);
            let denom = softmax_numerators(&mut s[..len], scale);
            weighted_row_sums::<1, BLOCK>([&s[..len]], vb, [&mut *out]);
            out.iter_mut().for_each(|a| *a /= denom);
        }
    }
}

/// The CPU attention with fused multiply-adds (x86-64 with AVX2 and FMA): both products as
/// register tiles of 6 rows × 16 columns, the classic matmul microkernel shape (12 accumulators,
/// 2 loaded vectors and a broadcast in AVX's 16 registers: each loaded vector feeds 6 FMAs).
/// Each tile walks one 16-column panel of the right operand (Kᵀ: 64 head dims × 16 keys, 4 KB; V:
/// the keys × 16 head dims, 12.6 KB at 197 keys) while it is in L1, panel after panel. Every
/// output still sums its terms in order (head dims for a score, keys for an output value) with
/// one rounding a term, so a row's bits depend on neither the tile nor the block it falls in;
/// they differ from [`attend_rows`]' (a product and a sum rounded apart there).
#[cfg(target_arch = "x86_64")]
mod fma {
    use super::{Float32, HeadRows, KeysValues};
    use std::arch::x86_64::*;

    /// Columns of a tile: two AVX vectors.
    const COLS: usize = 16;

    /// Rows of a full tile.
    const ROWS: usize = 6;

    /// [`super::attend_rows`] with FMA (head dims a multiple of [`COLS`]).
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn attend_rows<T: Float32>(
        q: HeadRows<'_, T>,
        kv: &KeysValues,
        scale: f32,
        out: &mut [f32],
    ) {
        // SAFETY: this function's contract.
        unsafe { attend_rows_with::<T, false>(q, kv, scale, out) }
    }

    /// [`attend_rows`] on AVX-512 tiles ([`product_512`]), the softmax's exponentials 16 at a
    /// time: the same bits (each value the same chain of roundings).
    ///
    /// # Safety
    /// The CPU must have AVX-512F, AVX2 and FMA.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn attend_rows_512<T: Float32>(
        q: HeadRows<'_, T>,
        kv: &KeysValues,
        scale: f32,
        out: &mut [f32],
    ) {
        // SAFETY: this function's contract.
        unsafe { attend_rows_with::<T, true>(q, kv, scale, out) }
    }

    /// The body of [`attend_rows`] (`WIDE` false) and [`attend_rows_512`] (true), inlined into
    /// each so that its loops compile with the caller's features (plain loops, no closures: a
    /// closure would not inherit them).
    ///
    /// # Safety
    /// AVX2 and FMA, and AVX-512F when `WIDE`.
    #[inline(always)]
    unsafe fn attend_rows_with<T: Float32, const WIDE: bool>(
        q: HeadRows<'_, T>,
        kv: &KeysValues,
        scale: f32,
        out: &mut [f32],
    ) {
        let (width, len, dim) = (kv.width, kv.len, kv.dim);
        assert!(dim % COLS == 0 && width % COLS == 0);
        let m = out.len() / dim;
        if m == 0 {
            return;
        }
        // Q's rows in place when they are f32, widened otherwise.
        let widened: Vec<f32>;
        let (qx, q_rs) = match T::as_f32(q.data) {
            Some(x) => (&x[q.first..q.first + (m - 1) * q.stride + dim], q.stride),
            None => {
                widened = q.widened(m, dim);
                (&widened[..], dim)
            }
        };
        let mut scores = vec![0f32; m * width];
        // SAFETY (every product call): the CPU has the features (this function's contract);
        // the products check the slices against the sizes.
        unsafe {
            let (q, kt) = ((qx, q_rs, m, dim), (&kv.kt[..], width, width));
            if WIDE {
                product_512(q, kt, &mut scores)
            } else {
                product(q, kt, &mut scores)
            }
        };
        let mut denoms = Vec::with_capacity(m);
        for s in scores.chunks_exact_mut(width) {
            denoms.push(softmax_numerators_lanes(&mut s[..len], scale));
        }
        unsafe {
            let (p, v) = ((&scores[..], width, m, len), (&kv.vb[..], dim, dim));
            if WIDE {
                product_512(p, v, out)
            } else {
                product(p, v, out)
            }
        };
        for (o, denom) in out.chunks_exact_mut(dim).zip(denoms) {
            for x in o {
                *x /= denom;
            }
        }
    }

    /// [`super::softmax_numerators`] with the sum in 8 lanes (key `j` into lane `j % 8`, the
    /// lanes then added in order): the serial sum over the keys, a chain of dependent adds, held
    /// most of this kernel's time outside the two products. The order is fixed by the row's
    /// length alone.
    #[inline(always)]
    fn softmax_numerators_lanes(scores: &mut [f32], scale: f32) -> f32 {
        const LANES: usize = 8;
        let max = super::scale_to_max(scores, scale);
        // The exponentials over the whole row first (as wide as the CPU's vectors), then their
        // sum in the lanes: the same values and the same sum as one pass.
        for s in scores.iter_mut() {
            *s = super::exp_f32(*s - max);
        }
        let mut sums = [0f32; LANES];
        let mut chunks = scores.chunks_exact(LANES);
        for c in &mut chunks {
            for (sum, s) in sums.iter_mut().zip(c) {
                *sum += *s;
            }
        }
        let mut denom = sums.iter().sum::<f32>();
        for s in chunks.remainder() {
            denom += *s;
        }
        denom
    }

    /// The row stride of `c` in [`product`] and [`product_512`], after checking the bounds every
    /// tile of theirs stays within (the tiles' reads and writes are unchecked): `m` rows of `k`
    /// terms in `a`, `k` rows of `n` columns in `b`, `m` rows of `n` in `c`.
    fn checked_c_stride(
        (a, a_rs, m, k): (&[f32], usize, usize, usize),
        (b, b_rs, n): (&[f32], usize, usize),
        c: &[f32],
    ) -> usize {
        let c_rs = c.len() / m.max(1);
        assert!(n.is_multiple_of(COLS) && n <= b_rs && n <= c_rs && k <= a_rs);
        assert!(m == 0 || (a.len() >= (m - 1) * a_rs + k && c.len() >= (m - 1) * c_rs + n));
        assert!(k == 0 || b.len() >= (k - 1) * b_rs + n);
        c_rs
    }

    /// `c[r][col] = Σ_i a[r][i] · b[i][col]`, the terms summed in order of `i`, for `m` rows
    /// (`k` terms each, a's rows `a_rs` apart) and the first `n` columns (a multiple of
    /// [`COLS`]) of b's `k` rows (`b_rs` apart); c is `[m, c.len() / m]` row-major.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn product(
        (a, a_rs, m, k): (&[f32], usize, usize, usize),
        (b, b_rs, n): (&[f32], usize, usize),
        c: &mut [f32],
    ) {
        let c_rs = checked_c_stride((a, a_rs, m, k), (b, b_rs, n), c);
        let (a, b, c) = (a.as_ptr(), b.as_ptr(), c.as_mut_ptr());
        for c0 in (0..n).step_by(COLS) {
            let mut r0 = 0;
            // SAFETY: rows r0.. of a and c, columns c0..c0 + COLS of b and c, within the asserts.
            unsafe {
                let b = b.add(c0);
                while r0 + ROWS <= m {
                    tile::<ROWS>(
                        a.add(r0 * a_rs),
                        a_rs,
                        k,
                        b,
                        b_rs,
                        c.add(r0 * c_rs + c0),
                        c_rs,
                    );
                    r0 += ROWS;
                }
                let (a, c) = (a.add(r0 * a_rs), c.add(r0 * c_rs + c0));
                match m - r0 {
                    1 => tile::<1>(a, a_rs, k, b, b_rs, c, c_rs),
                    2 => tile::<2>(a, a_rs, k, b, b_rs, c, c_rs),
                    3 => tile::<3>(a, a_rs, k, b, b_rs, c, c_rs),
                    4 => tile::<4>(a, a_rs, k, b, b_rs, c, c_rs),
                    5 => tile::<5>(a, a_rs, k, b, b_rs, c, c_rs),
                    _ => {}
                }
            }
        }
    }

    /// One `R × 16` tile of [`product`]: `R` rows of `a` (`a_rs` apart, `k` terms), `k` rows of
    /// 16 values of `b` (`b_rs` apart), written to `R` rows of `c` (`c_rs` apart). The
    /// accumulators are indexed by constants once the loops over `R` unroll, so they stay in
    /// registers.
    ///
    /// # Safety
    /// AVX2 and FMA; the pointers valid for those rows.
    #[inline(always)]
    unsafe fn tile<const R: usize>(
        a: *const f32,
        a_rs: usize,
        k: usize,
        b: *const f32,
        b_rs: usize,
        c: *mut f32,
        c_rs: usize,
    ) {
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); 2]; R];
            for i in 0..k {
                let b0 = _mm256_loadu_ps(b.add(i * b_rs));
                let b1 = _mm256_loadu_ps(b.add(i * b_rs + 8));
                for (r, acc) in acc.iter_mut().enumerate() {
                    let w = _mm256_broadcast_ss(&*a.add(r * a_rs + i));
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

    /// Columns of an AVX-512 tile: two 16-lane vectors.
    const COLS_512: usize = 32;

    /// Rows of a full AVX-512 tile (16 accumulators, two loaded vectors and a broadcast in the
    /// 32 registers).
    const ROWS_512: usize = 8;

    /// [`product`] on AVX-512 register tiles: `ROWS_512 × COLS_512`, then a 16-column tile for
    /// the last 16 columns where `n` is an odd multiple of 16. Each output the same ordered
    /// chain of fused multiply-adds as in [`product`], so the same bits.
    ///
    /// # Safety
    /// The CPU must have AVX-512F.
    #[target_feature(enable = "avx512f")]
    unsafe fn product_512(
        (a, a_rs, m, k): (&[f32], usize, usize, usize),
        (b, b_rs, n): (&[f32], usize, usize),
        c: &mut [f32],
    ) {
        let c_rs = checked_c_stride((a, a_rs, m, k), (b, b_rs, n), c);
        let (a, b, c) = (a.as_ptr(), b.as_ptr(), c.as_mut_ptr());
        let mut c0 = 0;
        // SAFETY (both): columns c0.. of b and c, every row of a and c, within the asserts.
        while c0 + COLS_512 <= n {
            unsafe { rows_512::<2>(a, a_rs, m, k, b.add(c0), b_rs, c.add(c0), c_rs) };
            c0 += COLS_512;
        }
        if c0 < n {
            unsafe { rows_512::<1>(a, a_rs, m, k, b.add(c0), b_rs, c.add(c0), c_rs) };
        }
    }

    /// The `m` rows of one `16 · V`-column strip of [`product_512`]: tiles of [`ROWS_512`]
    /// rows, then one of the rows left.
    ///
    /// # Safety
    /// AVX-512F; the pointers valid for those rows and columns.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn rows_512<const V: usize>(
        a: *const f32,
        a_rs: usize,
        m: usize,
        k: usize,
        b: *const f32,
        b_rs: usize,
        c: *mut f32,
        c_rs: usize,
    ) {
        let mut r0 = 0;
        // SAFETY: rows r0.. of a and c, within the caller's bounds.
        unsafe {
            while r0 + ROWS_512 <= m {
                tile_512::<ROWS_512, V>(a.add(r0 * a_rs), a_rs, k, b, b_rs, c.add(r0 * c_rs), c_rs);
                r0 += ROWS_512;
            }
            let (a, c) = (a.add(r0 * a_rs), c.add(r0 * c_rs));
            match m - r0 {
                1 => tile_512::<1, V>(a, a_rs, k, b, b_rs, c, c_rs),
                2 => tile_512::<2, V>(a, a_rs, k, b, b_rs, c, c_rs),
                3 => tile_512::<3, V>(a, a_rs, k, b, b_rs, c, c_rs),
                4 => tile_512::<4, V>(a, a_rs, k, b, b_rs, c, c_rs),
                5 => tile_512::<5, V>(a, a_rs, k, b, b_rs, c, c_rs),
                6 => tile_512::<6, V>(a, a_rs, k, b, b_rs, c, c_rs),
                7 => tile_512::<7, V>(a, a_rs, k, b, b_rs, c, c_rs),
                _ => {}
            }
        }
    }

    /// One `R × 16·V` tile of [`product_512`] (as [`tile`], 16-lane vectors).
    ///
    /// # Safety
    /// AVX-512F; the pointers valid for those rows.
    #[inline(always)]
    unsafe fn tile_512<const R: usize, const V: usize>(
        a: *const f32,
        a_rs: usize,
        k: usize,
        b: *const f32,
        b_rs: usize,
        c: *mut f32,
        c_rs: usize,
    ) {
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); V]; R];
            let mut bv = [_mm512_setzero_ps(); V];
            for i in 0..k {
                for (j, bv) in bv.iter_mut().enumerate() {
                    *bv = _mm512_loadu_ps(b.add(i * b_rs + 16 * j));
                }
                for (r, acc) in acc.iter_mut().enumerate() {
                    let w = _mm512_set1_ps(*a.add(r * a_rs + i));
                    for (acc, &bv) in acc.iter_mut().zip(&bv) {
                        *acc = _mm512_fmadd_ps(w, bv, *acc);
                    }
                }
            }
            for (r, acc) in acc.iter().enumerate() {
                for (j, &acc) in acc.iter().enumerate() {
                    _mm512_storeu_ps(c.add(r * c_rs + 16 * j), acc);
                }
            }
        }
    }
}

/// Scales a query's raw scores, replaces each by `exp(score − max)` and returns their sum (over
/// the keys in order): the softmax but for the division.
#[inline(always)]
fn softmax_numerators(scores: &mut [f32], scale: f32) -> f32 {
    let max = scale_to_max(scores, scale);
    // The exponentials are independent lanes; their sum keeps the keys' order.
    scores.iter_mut().for_each(|s| *s = exp_f32(*s - max));
    scores.iter().fold(0f32, |d, &s| d + s)
}

/// Scales a query's raw scores in place and returns their maximum: the softmax's first step.
#[inline(always)]
pub(crate) fn scale_to_max(scores: &mut [f32], scale: f32) -> f32 {
    scores.iter_mut().for_each(|s| *s *= scale);
    max_of(scores)
}

/// The largest value of `x` (NaNs skipped, as `f32::max` skips them; −∞ for an empty slice),
/// over 8 lanes: a maximum is exact, so lanes give the serial fold's result.
#[inline(always)]
fn max_of(x: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for chunk in &mut chunks {
        for (m, &v) in lanes.iter_mut().zip(chunk) {
            *m = if v > *m { v } else { *m };
        }
    }
    let tail = chunks.remainder().iter();
    lanes
        .iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v))
}

/// `e^x` in f32, written so that a loop over it vectorises (no call, no branch): Cephes' `expf`
/// (range reduction by `ln 2` in two parts, a degree-5 polynomial); within 1 ulp of the exact
/// value over every 997th f32 from −87.3 to 88.3 (the test). Arguments below −87.34 give about
/// 1.2e−38 (the smallest normal f32) where `f32::exp` goes subnormal or 0: in a softmax such a
/// term is lost in its sum either way. Arguments above 88.38 give about 2.4e38 where `f32::exp`
/// overflows to ∞ (a softmax never passes one: its arguments are at most 0). NaN gives NaN. No
/// fused multiply-adds, so every build (SSE2, AVX) rounds the same.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    // ln 2 = LN2_HI + LN2_LO, LN2_HI with few mantissa bits so `n · LN2_HI` is exact.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = if x < -87.336_54 { -87.336_54 } else { x };
    let x = if x > 88.376_26 { 88.376_26 } else { x };
    let n = (x * LOG2_E + 0.5).floor();
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * (r * r) + r + 1.0;
    // 2^n built in the exponent field: n is within [-126, 127] after the clamps. n as an
    // integer from the low mantissa bits of n + 1.5·2^23 (exact for an integer that small), not
    // `n as i32`: Rust's saturating float-to-int cast is one scalar conversion and two fix-ups
    // a lane, which kept this loop from vectorising (8.8 ns an exponential in the AVX-512
    // build on the H200 machine's host, ~0.3 after). The same bits; a NaN still gives NaN.
    const MAGIC: f32 = 12_582_912.0;
    let n_int = (n + MAGIC).to_bits().wrapping_sub(0x4B40_0000);
    y * f32::from_bits(n_int.wrapping_add(127) << 23)
}

/// `out[q][c] = Σ_r coeff[q][r] · rows[r][c]` for every column `c` of each of the `Q` outputs,
/// `rows` holding `coeff[q].len()` rows of `out[q].len()` values: each column summed over the
/// rows in order (the summation order of one row at a time), `W` columns of every output at a
/// time held in registers across the whole sum (one store a block instead of one a row), each
/// row's block loaded once for all `Q` outputs.
#[inline(always)]
fn weighted_row_sums<const Q: usize, const W: usize>(
    coeff: [&[f32]; Q],
    rows: &[f32],
    mut out: [&mut [f32]; Q],
) {
    let width = out[0].len();
    let mut c0 = block_sums::<Q, W>(coeff, rows, &mut out, 0);
    c0 = block_sums::<Q, LANES>(coeff, rows, &mut out, c0);
    if c0 < width {
        for (coeff, out) in coeff.iter().zip(out.iter_mut()) {
            let tail = &mut out[c0..];
            tail.iter_mut().for_each(|a| *a = 0.0);
            for (&w, row) in coeff.iter().zip(rows.chunks_exact(width)) {
                for (a, &x) in tail.iter_mut().zip(&row[c0..]) {
                    *a += w * x;
                }
            }
        }
    }
}

/// [`weighted_row_sums`]'s columns from `c0` on, `W` at a time in registers, while `W` whole
/// columns are left; returns the first column not done. Two outputs are written out as two named
/// accumulator arrays: in the loop over `Q` the compiler kept them in memory (4.5× slower than
/// one row at a time, stop 62's first try).
#[inline(always)]
fn block_sums<const Q: usize, const W: usize>(
    coeff: [&[f32]; Q],
    rows: &[f32],
    out: &mut [&mut [f32]; Q],
    mut c0: usize,
) -> usize {
    let width = out[0].len();
    while c0 + W <= width {
        let mut a = [[0f32; W]; Q];
        if Q == 2 {
            let (mut a0, mut a1) = ([0f32; W], [0f32; W]);
            for ((&w0, &w1), row) in coeff[0].iter().zip(coeff[1]).zip(rows.chunks_exact(width)) {
                let x = &row[c0..c0 + W];
                for ((a0, a1), &x) in a0.iter_mut().zip(a1.iter_mut()).zip(x) {
                    *a0 += w0 * x;
                    *a1 += w1 * x;
                }
            }
            a[0] = a0;
            a[1] = a1;
        } else {
            for q in 0..Q {
                for (&w, row) in coeff[q].iter().zip(rows.chunks_exact(width)) {
                    for (a, &x) in a[q].iter_mut().zip(&row[c0..c0 + W]) {
                        *a += w * x;
                    }
                }
            }
        }
        for (out, a) in out.iter_mut().zip(&a) {
            out[c0..c0 + W].copy_from_slice(a);
        }
        c0 += W;
    }
    c0
}

/// One AVX register of f32.
const LANES: usize = 8;

/// Columns (keys for the scores, head dims for the output) that [`weighted_row_sums`] computes at
/// a time in registers for one query row: eight 8-lane AVX registers, eight independent chains
/// of adds (three cycles each) to keep both of a core's vector adders busy.
const BLOCK: usize = 64;

/// The same for two query rows at once: 2 × 4 accumulator registers, 4 loaded blocks and 2
/// broadcasts fit AVX's 16 registers.
const PAIR_BLOCK: usize = 32;

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows of a fused `[len, 3 · dim + 8]` projection (q, k, v side by side, then padding, so
    /// every row is strided) filled with xorshift values in [-2, 2): the buffer and each of q, k,
    /// v as (offset of row 0, row stride).
    #[allow(clippy::type_complexity)]
    fn strided_qkv(
        len: usize,
        dim: usize,
        seed: u64,
    ) -> (Vec<f32>, ((usize, usize), (usize, usize), (usize, usize))) {
        let mut state = seed;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
        };
        let stride = 3 * dim + 8;
        let x = (0..len * stride + 3 * dim).map(|_| next()).collect();
        (x, ((0, stride), (dim, stride), (2 * dim, stride)))
    }

    /// `m` query rows from row `r0` on of the head in `x`, by `kernel`, with `loops`
    /// (attend_rows or attend_rows_wide) for [`CpuKernel::Loops`].
    #[allow(clippy::too_many_arguments)]
    fn attend_block(
        x: &[f32],
        (q0, qs): (usize, usize),
        k: (usize, usize),
        v: (usize, usize),
        (r0, m): (usize, usize),
        (len, dim): (usize, usize),
        kernel: CpuKernel,
        loops: fn(HeadRows<'_, f32>, &KeysValues, f32, &mut [f32]),
    ) -> Vec<f32> {
        let kv = KeysValues::pack(HeadRows::of(x, k), HeadRows::of(x, v), len, dim);
        let q = HeadRows::of(x, (q0 + r0 * qs, qs));
        let mut out = vec![f32::NAN; m * dim];
        if kernel == CpuKernel::Loops {
            loops(q, &kv, 0.125, &mut out);
        } else {
            attend_rows_dispatch(q, &kv, 0.125, kernel, &mut out);
        }
        out
    }

    fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    /// One query row at a time, one key at a time: the summation order the vectorised loops keep.
    #[allow(clippy::too_many_arguments)]
    fn one_row_at_a_time(
        x: &[f32],
        (q0, qs): (usize, usize),
        (k0, ks): (usize, usize),
        (v0, vs): (usize, usize),
        len: usize,
        dim: usize,
        scale: f32,
    ) -> Vec<f32> {
        let mut res = vec![0f32; len * dim];
        for i in 0..len {
            let mut scores: Vec<f32> = (0..len)
                .map(|j| {
                    let mut s = 0f32;
                    for d in 0..dim {
                        s += x[q0 + i * qs + d] * x[k0 + j * ks + d];
                    }
                    s * scale
                })
                .collect();
            let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
            let mut denom = 0f32;
            for s in scores.iter_mut() {
                *s = exp_f32(*s - max);
                denom += *s;
            }
            for d in 0..dim {
                let mut a = 0f32;
                for (j, &p) in scores.iter().enumerate() {
                    a += p * x[v0 + j * vs + d];
                }
                res[i * dim + d] = a / denom;
            }
        }
        res
    }

    #[test]
    fn vectorised_loops_keep_the_summation_order() {
        // K transposed and the loops turned inside out (over keys, over head dims) for
        // vectorisation; strided rows: the same bits as one row and one key at a time.
        for &(len, dim) in &[
            (1usize, 32usize),
            (2, 64),
            (5, 64),
            (63, 64),
            (197, 64),
            (66, 128),
            // Head dims past the last whole block of 64 (the 8-lane blocks).
            (33, 48),
            (70, 96),
            (40, 8),
            // Not a multiple of 8: the scalar remainder loop.
            (9, 12),
        ] {
            let (x, (q, k, v)) = strided_qkv(len, dim, 0x9e3779b97f4a7c15);
            let got = attend_block(
                &x,
                q,
                k,
                v,
                (0, len),
                (len, dim),
                CpuKernel::Loops,
                attend_rows,
            );
            let want = one_row_at_a_time(&x, q, k, v, len, dim, 0.125);
            assert!(
                same_bits(&got, &want),
                "len {len} dim {dim}: the vectorised loops changed the bits"
            );
        }
    }

    /// Whether this CPU runs the FMA kernel's tests (it has AVX2 and FMA).
    fn has_fma() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    /// Whether this CPU also runs the AVX-512 kernel.
    fn has_avx512() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            has_fma() && std::arch::is_x86_feature_detected!("avx512f")
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    /// The kernels this CPU runs.
    fn kernels() -> Vec<CpuKernel> {
        let mut k = vec![CpuKernel::Loops];
        if has_fma() {
            k.push(CpuKernel::Fma);
        }
        if has_avx512() {
            k.push(CpuKernel::Avx512);
        }
        k
    }

    #[test]
    fn fma_kernels_agree_with_the_loops() {
        // Strided rows, the odd lengths, every supported head dim: the FMA kernel (where the CPU
        // has it) within 1e-5 of one row and one key at a time (relative to the output's size),
        // while its bits differ; the AVX-512 kernel (where the CPU has AVX-512F) bit for bit
        // the FMA kernel's (each value the same chain of fused multiply-adds in either tile
        // shape, the softmax the same steps in wider vectors; partial tiles of rows, a last
        // 16-key strip). The op's integration tests hold whichever kernel the CPU runs to the
        // f64 reference in every dtype.
        if !has_fma() {
            eprintln!("no AVX2 + FMA on this CPU: the FMA kernels are not run here");
            return;
        }
        if !has_avx512() {
            eprintln!("no AVX-512F on this CPU: the AVX-512 kernel is not run here");
        }
        for &(len, dim) in &[
            (1usize, 32usize),
            (2, 64),
            (5, 32),
            (7, 64),
            (9, 128),
            (17, 32),
            (63, 64),
            (64, 64),
            (65, 64),
            (197, 64),
            (66, 128),
            (577, 64),
        ] {
            let (x, (q, k, v)) = strided_qkv(len, dim, 0x6a09e667f3bcc909 ^ len as u64);
            let want = one_row_at_a_time(&x, q, k, v, len, dim, 0.125);
            let got = attend_block(
                &x,
                q,
                k,
                v,
                (0, len),
                (len, dim),
                CpuKernel::Fma,
                attend_rows_wide,
            );
            let worst = got
                .iter()
                .zip(&want)
                .map(|(&g, &w)| (g - w).abs() / w.abs().max(1.0))
                .fold(0f32, f32::max);
            assert!(worst <= 1e-5, "len {len} dim {dim}: off by {worst:e}");
            if has_avx512() {
                let (block, kernel) = ((0, len), CpuKernel::Avx512);
                let wide = attend_block(&x, q, k, v, block, (len, dim), kernel, attend_rows);
                assert!(
                    same_bits(&got, &wide),
                    "len {len} dim {dim}: AVX-512 bits differ"
                );
            }
        }
    }

    #[test]
    fn query_blocks_keep_each_rows_bits() {
        // A row's result must not depend on the work unit (or, in the FMA kernel, the register
        // tile) it falls in: blocks of every size 1..=13 from several first rows against the
        // whole head at once.
        for &(len, dim) in &[(197usize, 64usize), (40, 32), (23, 128)] {
            let (x, (q, k, v)) = strided_qkv(len, dim, 0xbb67ae8584caa73b);
            for kernel in kernels() {
                let block = |r0, m| {
                    attend_block(&x, q, k, v, (r0, m), (len, dim), kernel, attend_rows_wide)
                };
                let whole = block(0, len);
                for m in 1..=13 {
                    for r0 in [0, 1, 5, len - m] {
                        let got = block(r0, m);
                        assert!(
                            same_bits(&got, &whole[r0 * dim..(r0 + m) * dim]),
                            "len {len} dim {dim} {kernel:?}: rows {r0}..{} changed",
                            r0 + m
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn query_blocks_are_nearly_equal() {
        for len in [1usize, 2, 63, 64, 65, 128, 129, 197, 577, 1024] {
            let rows = query_block_rows(len);
            let blocks = len.div_ceil(rows);
            let last = len - (blocks - 1) * rows;
            assert!(rows <= UNIT_QUERIES, "len {len}: blocks of {rows}");
            assert_eq!(
                blocks,
                len.div_ceil(UNIT_QUERIES),
                "len {len}: {blocks} blocks"
            );
            assert!(rows - last < blocks, "len {len}: {rows} then {last}");
        }
    }

    #[test]
    fn exp_f32_is_within_one_ulp_of_f64() {
        // Every 997th f32 bit pattern between -100 and 88.3 (both signs, every exponent, the
        // clamps, values near 0), against the f64 exponential.
        let mut worst = 0f64;
        for bits in (0..u32::MAX).step_by(997) {
            let x = f32::from_bits(bits);
            if !(-100.0..88.3).contains(&x) {
                continue;
            }
            let got = exp_f32(x) as f64;
            let want = (x as f64).exp();
            if x >= -87.3 {
                let ulp = (want as f32).next_up() as f64 - want as f32 as f64;
                worst = worst.max((got - want).abs() / ulp);
            } else {
                // Clamped: about the smallest normal, never more, never negative.
                assert!(got > 0.0 && got <= 1.23e-38, "exp_f32({x}) = {got}");
            }
        }
        assert!(worst <= 1.0, "exp_f32 is {worst} ulp off");
        assert!(exp_f32(f32::NAN).is_nan(), "NaN must stay NaN");
        assert_eq!(exp_f32(0.0), 1.0);
    }

    #[test]
    fn max_of_is_the_serial_maximum() {
        for len in [0usize, 1, 7, 8, 9, 63, 197] {
            let (x, _) = strided_qkv(len, 1, 0x51afd7ed558ccd);
            let x = &x[..len];
            let serial = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            assert_eq!(max_of(x).to_bits(), serial.to_bits(), "len {len}");
        }
        // NaNs are skipped, as f32::max skips them.
        assert_eq!(
            max_of(&[1.0, f32::NAN, 3.0, 2.0, 0.0, 0.0, 0.0, 0.0, f32::NAN]),
            3.0
        );
    }

    #[test]
    fn wide_build_rounds_like_the_baseline() {
        // The AVX build of the per-head loop (when the CPU has AVX) must give the baseline's bits:
        // lanes are independent and no sum is reassociated. Strided rows, odd lengths.
        for &(len, dim) in &[(1usize, 32usize), (63, 64), (197, 64), (65, 128)] {
            let (buf, (q, k, v)) = strided_qkv(len, dim, 0x2545f4914f6cdd1d);
            let block =
                |loops| attend_block(&buf, q, k, v, (0, len), (len, dim), CpuKernel::Loops, loops);
            let (base, wide) = (block(attend_rows), block(attend_rows_wide));
            assert!(
                same_bits(&base, &wide),
                "len {len} dim {dim}: the dispatched build changed the bits"
            );
        }
    }
}
