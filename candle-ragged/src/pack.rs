//! Moving tokens between the image-shaped layout `[batch, tokens, channels]` and the packed
//! layout `[total, channels]` described by a [`RaggedBatch`].

use crate::batch::RaggedBatch;
use crate::error::{RaggedError, Result};
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};

/// Gathers the kept tokens of every image into one packed tensor.
///
/// * `x` - `[batch, tokens, channels]`, any strides (a non-contiguous last dim is copied first).
/// * `batch` - which tokens each image keeps: the leading `lengths[b]` tokens for a batch built with
///   [`RaggedBatch::from_lengths`], or the listed positions for [`RaggedBatch::from_keep_indices`] /
///   [`RaggedBatch::from_keep_mask`], in increasing position order.
///
/// Returns `[batch.total_tokens(), channels]`, contiguous, same dtype (f32, f16, bf16 or u32).
pub fn pack(x: &Tensor, batch: &RaggedBatch) -> Result<Tensor> {
    const OP: &str = "pack";
    let (b, n, _c) = match x.dims() {
        &[b, n, c] => (b, n, c),
        _ => {
            return Err(RaggedError::Rank {
                op: OP,
                what: "x",
                expected: 3,
                shape: x.shape().clone(),
            })
        }
    };
    check_common(OP, x, batch)?;
    if b != batch.batch_size() {
        return Err(RaggedError::BatchMismatch {
            op: OP,
            expected: batch.batch_size(),
            found: b,
        });
    }
    fits(OP, batch, n)?;
    let x = if x.stride()[2] == 1 {
        x.clone()
    } else {
        x.contiguous()?
    };
    Ok(x.apply_op1_no_bwd(&Pack { batch })?)
}

/// Scatters a packed tensor back to image shape: the inverse of [`pack`].
///
/// * `packed` - `[batch.total_tokens(), channels]`.
/// * `tokens` - tokens per image of the result; at least [`RaggedBatch::min_tokens_per_image`].
///
/// Returns `[batch.batch_size(), tokens, channels]`, contiguous: each packed row goes back to the
/// position it was gathered from (leading positions for a batch built from lengths, so a padded,
/// left-aligned batch), and every position not kept is zero.
pub fn unpack(packed: &Tensor, batch: &RaggedBatch, tokens: usize) -> Result<Tensor> {
    const OP: &str = "unpack";
    check_packed(OP, packed, batch)?;
    fits(OP, batch, tokens)?;
    Ok(unit_column_stride(packed)?.apply_op1_no_bwd(&Unpack { batch, tokens })?)
}

/// `packed` is `[batch.total_tokens(), channels]` of a dtype the ops move, on the batch's device.
fn check_packed(op: &'static str, packed: &Tensor, batch: &RaggedBatch) -> Result<()> {
    let total = match packed.dims() {
        &[t, _c] => t,
        _ => {
            return Err(RaggedError::Rank {
                op,
                what: "packed",
                expected: 2,
                shape: packed.shape().clone(),
            })
        }
    };
    check_common(op, packed, batch)?;
    if total != batch.total_tokens() {
        return Err(RaggedError::TotalMismatch {
            op,
            what: "packed",
            expected: batch.total_tokens(),
            found: total,
        });
    }
    Ok(())
}

/// `packed` itself when its rows are unit-stride (any row stride), else a contiguous copy.
pub(crate) fn unit_column_stride(packed: &Tensor) -> Result<Tensor> {
    Ok(if packed.stride()[1] == 1 {
        packed.clone()
    } else {
        packed.contiguous()?
    })
}

fn check_common(op: &'static str, x: &Tensor, batch: &RaggedBatch) -> Result<()> {
    if !matches!(
        x.dtype(),
        DType::F32 | DType::F16 | DType::BF16 | DType::U32
    ) {
        return Err(RaggedError::UnsupportedDType {
            op,
            dtype: x.dtype(),
        });
    }
    if !batch.device().same_device(x.device()) {
        return Err(RaggedError::DeviceMismatch {
            op,
            what: "cu_seqlens",
            expected: format!("{:?}", x.device().location()),
            found: format!("{:?}", batch.device().location()),
        });
    }
    Ok(())
}

fn fits(op: &'static str, batch: &RaggedBatch, tokens: usize) -> Result<()> {
    if batch.positions().is_some() {
        if batch.min_tokens_per_image() > tokens {
            return Err(RaggedError::PositionOutOfRange {
                op,
                position: batch.min_tokens_per_image() - 1,
                tokens,
            });
        }
    } else if batch.max_len() > tokens {
        return Err(RaggedError::SequenceDoesNotFit {
            op,
            len: batch.max_len(),
            tokens,
        });
    }
    Ok(())
}

/// Host copy of the source position of every packed row.
fn host_positions(batch: &RaggedBatch) -> candle_core::Result<Vec<u32>> {
    match batch.positions() {
        Some(p) => p.to_device(&candle_core::Device::Cpu)?.to_vec1::<u32>(),
        None => Ok(leading_positions(&batch.offsets()?)),
    }
}

/// Each packed row's place in its sequence: `0..len_b` for every sequence `b`.
fn leading_positions(offsets: &[u32]) -> Vec<u32> {
    offsets.windows(2).flat_map(|w| 0..w[1] - w[0]).collect()
}

/// [`scatter_rows`] over any dtype the ops move: `[batch, n, channels]` from packed rows placed at
/// `positions` (see [`Unpack`] and [`LeadingRows`]).
fn scatter_cpu(
    op: &'static str,
    batch: &RaggedBatch,
    n: usize,
    positions: &[u32],
    s: &CpuStorage,
    l: &Layout,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let (_t, c) = l.shape().dims2()?;
    let lay = (l.start_offset(), l.stride()[0]);
    let offsets = batch.offsets()?;
    let (o, p) = (&offsets[..], positions);
    let out = match s {
        CpuStorage::F32(x) => CpuStorage::F32(scatter_rows(x, lay, c, n, o, p)),
        CpuStorage::F16(x) => CpuStorage::F16(scatter_rows(x, lay, c, n, o, p)),
        CpuStorage::BF16(x) => CpuStorage::BF16(scatter_rows(x, lay, c, n, o, p)),
        CpuStorage::U32(x) => CpuStorage::U32(scatter_rows(x, lay, c, n, o, p)),
        other => return Err(unsupported(op, other)),
    };
    Ok((out, Shape::from((batch.batch_size(), n, c))))
}

/// `[batch, tokens, channels]` -> `[total, channels]`; see [`pack`].
pub struct Pack<'a> {
    pub batch: &'a RaggedBatch,
}

/// `[total, channels]` -> `[batch, tokens, channels]`; see [`unpack`].
pub struct Unpack<'a> {
    pub batch: &'a RaggedBatch,
    pub tokens: usize,
}

/// Packed row `t` of sequence `b` is row `positions[t]` of image `b`: copy it out of `x`.
/// The packed rows, then zeros up to `rows` (a device-lengths batch's capacity).
fn gather_rows<T: Copy + Default>(
    x: &[T],
    (off, sb, sn): (usize, usize, usize),
    c: usize,
    offsets: &[u32],
    positions: &[u32],
    rows: usize,
) -> Vec<T> {
    let mut out = Vec::with_capacity(rows * c);
    for (b, w) in offsets.windows(2).enumerate() {
        for &pos in &positions[w[0] as usize..w[1] as usize] {
            let src = off + b * sb + pos as usize * sn;
            out.extend_from_slice(&x[src..src + c]);
        }
    }
    out.resize(rows * c, T::default());
    out
}

/// The inverse of [`gather_rows`] into a zeroed `[batch, n, c]`.
fn scatter_rows<T: Copy + Default>(
    x: &[T],
    (off, st): (usize, usize),
    c: usize,
    n: usize,
    offsets: &[u32],
    positions: &[u32],
) -> Vec<T> {
    let mut out = vec![T::default(); (offsets.len() - 1) * n * c];
    for (b, w) in offsets.windows(2).enumerate() {
        // Positions past `n` are left out (only `leading_rows` asks for fewer than a sequence has).
        for t in (w[0] as usize..w[1] as usize).filter(|&t| (positions[t] as usize) < n) {
            let dst = (b * n + positions[t] as usize) * c;
            out[dst..dst + c].copy_from_slice(&x[off + t * st..off + t * st + c]);
        }
    }
    out
}

fn unsupported(op: &'static str, s: &CpuStorage) -> candle_core::Error {
    use candle_core::backend::BackendStorage;
    RaggedError::UnsupportedDType {
        op,
        dtype: s.dtype(),
    }
    .into()
}

impl CustomOp1 for Pack<'_> {
    fn name(&self) -> &'static str {
        "pack"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (_b, _n, c) = l.shape().dims3()?;
        let (off, sb, sn) = (l.start_offset(), l.stride()[0], l.stride()[1]);
        let p = host_positions(self.batch)?;
        let offsets = self.batch.offsets()?;
        let rows = self.batch.total_tokens();
        let (o, lay) = (&offsets[..], (off, sb, sn));
        let out = match s {
            CpuStorage::F32(x) => CpuStorage::F32(gather_rows(x, lay, c, o, &p, rows)),
            CpuStorage::F16(x) => CpuStorage::F16(gather_rows(x, lay, c, o, &p, rows)),
            CpuStorage::BF16(x) => CpuStorage::BF16(gather_rows(x, lay, c, o, &p, rows)),
            CpuStorage::U32(x) => CpuStorage::U32(gather_rows(x, lay, c, o, &p, rows)),
            other => return Err(unsupported("pack", other)),
        };
        Ok((out, Shape::from((rows, c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::pack(self.batch, s, l)
    }
}

impl CustomOp1 for Unpack<'_> {
    fn name(&self) -> &'static str {
        "unpack"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let p = host_positions(self.batch)?;
        scatter_cpu("unpack", self.batch, self.tokens, &p, s, l)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::unpack(self.batch, self.tokens, true, s, l)
    }
}

/// The first `rows` packed rows of every sequence, image-shaped: `out[b, j] = packed[cu[b] + j]`
/// for `j < min(rows, len_b)`, zeros after. One kernel, no host read, so it also serves batches
/// whose lengths live on the device only (the class token of each image after a
/// [`crate::select_by_rule_bounded`] step, for instance).
///
/// * `packed` - `[batch.total_tokens(), channels]`, f32 / f16 / bf16 / u32.
///
/// Returns `[batch.batch_size(), rows, channels]`, contiguous.
pub fn leading_rows(packed: &Tensor, batch: &RaggedBatch, rows: usize) -> Result<Tensor> {
    check_packed("leading_rows", packed, batch)?;
    Ok(unit_column_stride(packed)?.apply_op1_no_bwd(&LeadingRows { batch, rows })?)
}

/// `[total, channels]` -> `[batch, rows, channels]`; see [`leading_rows`].
pub struct LeadingRows<'a> {
    pub batch: &'a RaggedBatch,
    pub rows: usize,
}

impl CustomOp1 for LeadingRows<'_> {
    fn name(&self) -> &'static str {
        "leading-rows"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let p = leading_positions(&self.batch.offsets()?);
        scatter_cpu("leading_rows", self.batch, self.rows, &p, s, l)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::unpack(self.batch, self.rows, false, s, l)
    }
}
