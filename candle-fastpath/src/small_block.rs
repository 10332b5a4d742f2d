//! [`small_block`]: one pre-norm ViT block (timm's `Block`: `x + proj(attn(LN1(x)))`, then
//! `+ fc2(GELU(fc1(LN2(x))))`) in one CUDA launch, for the token counts of a ViT at batch 1.
//!
//! Run as its ~8 kernels (two LayerNorms, four GEMMs, attention, GELU), a block at batch 1
//! costs ~9–12 µs of host time per kernel through candle's op path when launched one by one.
//! The fused kernel keeps one block per SM for the whole transformer block, separates its
//! phases with grid-wide barriers, folds the LayerNorms into the GEMM tiles that read those
//! rows anyway and the GELU into fc1 (`kernels/small_block.cu` describes the phases): one
//! launch per block. Its GPU time is longer than the separate kernels' (each phase becomes one
//! SM's serial chain: ~50 µs per DeiT-S block under ncu against ~31 µs), so it pays off only
//! where the host is in the loop: [`small_block_applies`] takes it for eager forwards of
//! C ≤ 384 and not inside a CUDA-graph capture (docs/LEVERS.md, lever 40: eager batch-1
//! DeiT-T/S forwards 1.3–3.1× faster, graph replays unchanged).
//!
//! The attention runs per sequence of a packed batch given as `cu_seqlens` (FlashAttention's
//! varlen convention, as candle-ragged's batches hold it), so a packed token-pruned batch runs
//! through it as well as a dense one. There is no CPU kernel: a caller runs the block's own
//! layers there (and wherever [`small_block_applies`] says no); the results agree to the
//! rounding of the storage type (the GELU is rounded once here, twice there).

use candle_core::{DType, Tensor};

use crate::error::{FastpathError, Result};
use crate::{FusedLinear, LayerNorm};

const OP: &str = "small_block";

/// Longest sequence the kernel stages (its keys and values live in shared memory).
pub const SMALL_BLOCK_MAX_LEN: usize = 256;
/// Embedding widths with a compiled kernel (DeiT-T/S/B), each with head_dim 64.
pub const SMALL_BLOCK_DIMS: [usize; 3] = [192, 384, 768];
/// The head dimension the kernel is written for.
pub const SMALL_BLOCK_HEAD_DIM: usize = 64;

/// One block's weights as timm names them: `norm1`, `attn.qkv` (`[3C, C]`, rows q | k | v, each
/// head-major), `attn.proj`, `norm2`, `mlp.fc1` (`[4C, C]`), `mlp.fc2` (`[C, 4C]`), every Linear
/// with its bias.
#[derive(Debug, Clone, Copy)]
pub struct BlockWeights<'a> {
    pub norm1: &'a LayerNorm,
    pub qkv: &'a FusedLinear,
    pub proj: &'a FusedLinear,
    pub norm2: &'a LayerNorm,
    pub fc1: &'a FusedLinear,
    pub fc2: &'a FusedLinear,
    /// Attention heads: `C / 64`.
    pub heads: usize,
    /// The softmax scale (`head_dim^-0.5` in timm).
    pub scale: f32,
}

/// Rows at most this many take the fused block (`CANDLE_FASTPATH_SMALL_BLOCK_ROWS`, default
/// 256: a DeiT at batch 1; `0` turns it off).
pub fn small_block_max_rows() -> usize {
    static ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    crate::switches::read_once(&ROWS, "CANDLE_FASTPATH_SMALL_BLOCK_ROWS", |v| {
        v.and_then(|s| s.parse().ok()).unwrap_or(256)
    })
}

/// Where [`small_block_applies`] says yes (`CANDLE_FASTPATH_SMALL_BLOCK`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SmallBlockMode {
    /// The default: C ≤ 384 (DeiT-T/S) and only while candle's stream is not being captured
    /// into a CUDA graph. Launched one by one, a block's ~8 kernels cost more host time than
    /// the fused kernel costs GPU time; inside a graph the host is out of the loop and the
    /// separate kernels are faster (docs/LEVERS.md, lever 40).
    Eager,
    /// Every width, in graphs too (`=always`; for A/B measurements).
    Always,
    /// Never (`=0`).
    Off,
}

/// The mode `CANDLE_FASTPATH_SMALL_BLOCK` selects (read once): unset or `eager`, `always`, `0`.
pub fn small_block_mode() -> SmallBlockMode {
    static MODE: std::sync::OnceLock<SmallBlockMode> = std::sync::OnceLock::new();
    crate::switches::read_once(&MODE, "CANDLE_FASTPATH_SMALL_BLOCK", |v| match v {
        Some("always") => SmallBlockMode::Always,
        Some("0") | Some("off") => SmallBlockMode::Off,
        _ => SmallBlockMode::Eager,
    })
}

/// Whether [`small_block`] should run `x` (`[rows, C]`) with these weights and sequences of at
/// most `max_len` tokens: CUDA (the `cuda` feature), f16 or bf16, C in [`SMALL_BLOCK_DIMS`] with
/// 64-wide heads, `1 ≤ max_len ≤` [`SMALL_BLOCK_MAX_LEN`], `rows ≤` [`small_block_max_rows`],
/// what [`small_block_mode`] allows (by default C ≤ 384 outside CUDA-graph capture), and a GPU
/// whose blocks may opt into the kernel's shared memory.
/// Everything else about the inputs is checked by [`small_block`] itself, with an error.
pub fn small_block_applies(x: &Tensor, max_len: usize, w: &BlockWeights) -> bool {
    let c = w.norm1.weight().elem_count();
    let mode = small_block_mode();
    let shape_ok = cfg!(feature = "cuda")
        && mode != SmallBlockMode::Off
        && x.device().is_cuda()
        && matches!(x.dtype(), DType::F16 | DType::BF16)
        && x.rank() == 2
        && x.dim(1).ok() == Some(c)
        && SMALL_BLOCK_DIMS.contains(&c)
        && w.heads * SMALL_BLOCK_HEAD_DIM == c
        && (1..=SMALL_BLOCK_MAX_LEN).contains(&max_len)
        && (1..=small_block_max_rows()).contains(&x.dim(0).unwrap_or(0));
    shape_ok
        && (mode == SmallBlockMode::Always || (c <= 384 && !crate::is_capturing(x.device())))
        && fits_device(x, c)
}

/// Whether `x`'s GPU lets a block opt into the C-wide kernel's shared memory (~145 KB at C = 384
/// and 768: not on compute capability 8.6 / 8.9 / 12.x).
#[cfg(feature = "cuda")]
fn fits_device(x: &Tensor, c: usize) -> bool {
    let candle_core::Device::Cuda(dev) = x.device() else {
        return false;
    };
    let width = SMALL_BLOCK_DIMS.iter().position(|&d| d == c);
    width.is_some_and(|w| crate::cuda::fixed_kernels_fit(dev).is_ok_and(|fit| fit.small_block[w]))
}

#[cfg(not(feature = "cuda"))]
fn fits_device(_: &Tensor, _: usize) -> bool {
    false
}

/// One ViT block over the packed tokens `x` (`[rows, C]`, f16 / bf16, CUDA) of the sequences
/// `cu_seqlens` describes (u32 `[B + 1]` on `x`'s device: non-decreasing offsets from 0 with
/// `cu_seqlens[B] ≤ rows`; every length in `0..=max_len`) → `[rows, C]`, contiguous.
///
/// The offsets are read on the device only (nothing waits on the GPU); the host cannot check
/// them, so a wrong `cu_seqlens` gives wrong numbers, not a fault: every access stays inside
/// `rows`. Rows past `cu_seqlens[B]` (a capacity-sized buffer) go through the per-token layers
/// on whatever they hold, as the unfused ragged path does.
pub fn small_block(
    x: &Tensor,
    cu_seqlens: &Tensor,
    max_len: usize,
    w: &BlockWeights,
) -> Result<Tensor> {
    let c = w.norm1.weight().elem_count();
    if x.rank() != 2 {
        return Err(FastpathError::Rank {
            op: OP,
            what: "x",
            expected: "2 ([rows, C])",
            shape: x.shape().clone(),
        });
    }
    let rows = x.dim(0)?;
    if rows == 0 {
        return Err(FastpathError::Empty {
            op: OP,
            what: "x",
            shape: x.shape().clone(),
        });
    }
    if !SMALL_BLOCK_DIMS.contains(&c) || w.heads * SMALL_BLOCK_HEAD_DIM != c {
        return Err(FastpathError::Candle(candle_core::Error::Msg(format!(
            "{OP}: needs C in {SMALL_BLOCK_DIMS:?} split into heads of {SMALL_BLOCK_HEAD_DIM}, \
             got C = {c} with {} heads",
            w.heads
        ))));
    }
    if !(1..=SMALL_BLOCK_MAX_LEN).contains(&max_len) {
        return Err(FastpathError::Candle(candle_core::Error::Msg(format!(
            "{OP}: max_len must be in 1..={SMALL_BLOCK_MAX_LEN}, got {max_len}"
        ))));
    }
    if !matches!(x.dtype(), DType::F16 | DType::BF16) {
        return Err(FastpathError::UnsupportedDType {
            op: OP,
            dtype: x.dtype(),
        });
    }
    let anchor = w.norm1.weight();
    let check = |what, t: &Tensor, dims: &[usize]| {
        crate::linear::check_like(OP, anchor, what, t, &dims.into())
    };
    check("x", x, &[rows, c])?;
    check("norm1.bias", w.norm1.bias(), &[c])?;
    check("norm2.weight", w.norm2.weight(), &[c])?;
    check("norm2.bias", w.norm2.bias(), &[c])?;
    let linear = |what_w, what_b, l: &FusedLinear, out: usize, inp: usize| -> Result<()> {
        check(what_w, l.weight(), &[out, inp])?;
        match l.bias() {
            Some(b) => check(what_b, b, &[out]),
            None => Err(FastpathError::Candle(candle_core::Error::Msg(format!(
                "{OP}: {what_b} is missing (every Linear of the block needs its bias)"
            )))),
        }
    };
    linear("attn.qkv.weight", "attn.qkv.bias", w.qkv, 3 * c, c)?;
    linear("attn.proj.weight", "attn.proj.bias", w.proj, c, c)?;
    linear("mlp.fc1.weight", "mlp.fc1.bias", w.fc1, 4 * c, c)?;
    linear("mlp.fc2.weight", "mlp.fc2.bias", w.fc2, c, 4 * c)?;
    if cu_seqlens.rank() != 1 || cu_seqlens.dim(0)? < 2 {
        return Err(FastpathError::Rank {
            op: OP,
            what: "cu_seqlens",
            expected: "1 ([B + 1], B >= 1)",
            shape: cu_seqlens.shape().clone(),
        });
    }
    if cu_seqlens.dtype() != DType::U32 {
        return Err(FastpathError::Candle(candle_core::Error::Msg(format!(
            "{OP}: cu_seqlens must be u32, got {:?}",
            cu_seqlens.dtype()
        ))));
    }
    FastpathError::check_same_device(OP, "cu_seqlens", cu_seqlens.device(), x.device())?;
    run(x, cu_seqlens, max_len, w)
}

#[cfg(feature = "cuda")]
fn run(x: &Tensor, cu_seqlens: &Tensor, max_len: usize, w: &BlockWeights) -> Result<Tensor> {
    if !x.device().is_cuda() {
        return Err(FastpathError::NotCuda {
            op: OP,
            device: format!("{:?}", x.device().location()),
        });
    }
    let op = crate::cuda::SmallBlockOp {
        weights: *w,
        max_len,
    };
    Ok(x.contiguous()?
        .apply_op2_no_bwd(&cu_seqlens.contiguous()?, &op)?)
}

#[cfg(not(feature = "cuda"))]
fn run(x: &Tensor, _: &Tensor, _: usize, _: &BlockWeights) -> Result<Tensor> {
    Err(FastpathError::NotCuda {
        op: OP,
        device: format!(
            "{:?} (built without the cuda feature)",
            x.device().location()
        ),
    })
}
