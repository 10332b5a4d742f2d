//! [`sequence_mean`]: the mean row of each sequence of a packed tensor, the pooled per-image
//! feature a learned pruner reads (DynamicViT's global half), without unpacking to image shape.

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor, WithDType};

use crate::batch::RaggedBatch;
use crate::error::{RaggedError, Result};
use crate::pack::unit_column_stride;

const OP: &str = "sequence_mean";

/// Partial sums per column, in a fixed order that the CPU and the CUDA kernel share (row `r` of
/// a sequence's averaged rows goes to partial `r % MEAN_PARTIALS`; the partials are then added
/// in index order), so that both give bit-identical means.
pub(crate) const MEAN_PARTIALS: usize = 8;

/// Per sequence of `batch`: the mean of its rows of `x` after the first `skip`, summed in f32 and
/// rounded once to `x`'s dtype (as `torch.mean` of a half tensor does).
///
/// * `x` - `[batch.total_tokens(), D]` packed rows, f32 / f16 / bf16; rows may be strided (a
///   column slice of a wider tensor, e.g. `h.narrow(1, C/2, C/2)`), the last dim must not be.
/// * `skip` - leading rows of each sequence left out (its class / distillation tokens); every
///   sequence must have more rows than that.
///
/// Returns `[B, D]` in `x`'s dtype, contiguous.
pub fn sequence_mean(x: &Tensor, batch: &RaggedBatch, skip: usize) -> Result<Tensor> {
    let (rows, d) = x.dims2().map_err(|_| RaggedError::Rank {
        op: OP,
        what: "x",
        expected: 2,
        shape: x.shape().clone(),
    })?;
    if !matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        return Err(RaggedError::UnsupportedDType {
            op: OP,
            dtype: x.dtype(),
        });
    }
    if rows != batch.total_tokens() {
        return Err(RaggedError::TotalMismatch {
            op: OP,
            what: "x",
            expected: batch.total_tokens(),
            found: rows,
        });
    }
    if !batch.device().same_device(x.device()) {
        return Err(RaggedError::DeviceMismatch {
            op: OP,
            what: "cu_seqlens",
            expected: format!("{:?}", x.device().location()),
            found: format!("{:?}", batch.device().location()),
        });
    }
    if let Some((index, len)) = batch.first_sequence_at_most(skip) {
        return Err(RaggedError::Candle(candle_core::Error::Msg(format!(
            "{OP}: sequence {index} has {len} rows, nothing left to average after skipping {skip}"
        ))));
    }
    if d == 0 {
        return Err(RaggedError::Candle(candle_core::Error::Msg(format!(
            "{OP}: x has no columns"
        ))));
    }
    Ok(unit_column_stride(x)?.apply_op1_no_bwd(&SequenceMean { batch, skip })?)
}

/// `[total, D]` -> `[B, D]`; see [`sequence_mean`].
pub struct SequenceMean<'a> {
    pub batch: &'a RaggedBatch,
    pub skip: usize,
}

/// The means of every sequence, in the shared summation order.
fn means<T: WithDType>(
    x: &[T],
    (off, row_stride): (usize, usize),
    d: usize,
    offsets: &[u32],
    skip: usize,
) -> Vec<T> {
    let mut out = Vec::with_capacity((offsets.len() - 1) * d);
    let mut partial = vec![[0f32; MEAN_PARTIALS]; d];
    for w in offsets.windows(2) {
        let (first, end) = (w[0] as usize + skip, w[1] as usize);
        partial.iter_mut().for_each(|p| *p = [0.0; MEAN_PARTIALS]);
        for (i, r) in (first..end).enumerate() {
            let row = &x[off + r * row_stride..off + r * row_stride + d];
            for (p, &v) in partial.iter_mut().zip(row) {
                p[i % MEAN_PARTIALS] += v.to_f64() as f32;
            }
        }
        let count = (end - first) as f32;
        out.extend(
            partial
                .iter()
                .map(|p| T::from_f64((p.iter().fold(0f32, |a, &v| a + v) / count) as f64)),
        );
    }
    out
}

impl CustomOp1 for SequenceMean<'_> {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (_rows, d) = l.shape().dims2()?;
        let lay = (l.start_offset(), l.stride()[0]);
        let offsets = self.batch.offsets()?;
        let o = &offsets[..];
        let out = match s {
            CpuStorage::F32(x) => CpuStorage::F32(means(x, lay, d, o, self.skip)),
            CpuStorage::F16(x) => CpuStorage::F16(means(x, lay, d, o, self.skip)),
            CpuStorage::BF16(x) => CpuStorage::BF16(means(x, lay, d, o, self.skip)),
            _ => candle_core::bail!("{OP}: unsupported dtype"),
        };
        Ok((out, Shape::from((self.batch.batch_size(), d))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::sequence_mean(self.batch, self.skip, s, l)
    }
}
