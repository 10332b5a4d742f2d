//! [`RaggedBatch`]: which packed rows belong to which sequence.
//!
//! A batch of `B` sequences with lengths `l_0 .. l_{B-1}` is stored packed as one
//! `[total, ...]` tensor, `total = Σ l_b`, sequence `b` owning rows `cu_seqlens[b] .. cu_seqlens[b+1]`
//! (FlashAttention's varlen convention). The description is validated once, when it is built; the
//! ops that take it then only compare sizes the host already knows, so no call waits on the GPU.

use std::borrow::Cow;

use crate::error::{RaggedError, Result};
use candle_core::{DType, Device, Tensor};

/// Sequences longer than this are refused by [`crate::ragged_attention`] with
/// [`RaggedError::SequenceTooLong`]. The kernels tile over keys, so the bound is about the tested
/// range (ViT-B/16 at 384 px has 577 tokens), not about shared-memory capacity.
pub const MAX_SEQ_LEN: usize = 2048;

/// The layout of a packed batch of variable-length sequences.
///
/// Holds `cu_seqlens` (`[batch + 1]`, u32) on the device the packed tensors live on, a host copy of
/// the same offsets, and, when the batch was built from kept token positions, `positions`
/// (`[total]`, u32, on the device): for each packed row, the position inside its image that the
/// token came from. [`crate::pack`] gathers with it and [`crate::unpack`] scatters back with it.
///
/// A batch made by [`crate::select_by_rule_bounded`] has its lengths **on the device only**
/// ([`RaggedBatch::lengths_on_host`] is false): the host knows the batch size, an upper bound of
/// every length ([`RaggedBatch::max_len`]) and the rows of its packed tensors
/// ([`RaggedBatch::total_tokens`], a capacity); rows past `cu_seqlens[B]` belong to no sequence
/// and hold unspecified values. Every op launches from those host values alone, so a forward over
/// such batches never waits on the GPU and can be captured into a CUDA graph.
#[derive(Debug, Clone)]
pub struct RaggedBatch {
    cu_seqlens: Tensor,
    /// Host copy of `cu_seqlens`; `None` when the lengths live on the device only.
    offsets: Option<Vec<u32>>,
    batch_size: usize,
    /// Rows of the packed tensors: the total, or the capacity of a device-lengths batch.
    rows: usize,
    positions: Option<Tensor>,
    /// One past the largest source position (unused when `positions` is `None`: `max_len` bounds it).
    position_bound: usize,
    max_len: usize,
}

impl RaggedBatch {
    /// A batch whose sequence `b` is the first `lengths[b]` tokens of image `b`.
    /// Every length must be at least 1.
    pub fn from_lengths(lengths: &[usize], device: &Device) -> Result<Self> {
        Self::build_from_lengths(lengths, false, device)
    }

    /// Like [`RaggedBatch::from_lengths`], but zero-length sequences are allowed (their attention
    /// output is empty and [`crate::unpack`] fills their rows with zeros).
    pub fn from_lengths_allowing_empty(lengths: &[usize], device: &Device) -> Result<Self> {
        Self::build_from_lengths(lengths, true, device)
    }

    fn build_from_lengths(lengths: &[usize], allow_empty: bool, device: &Device) -> Result<Self> {
        let offsets = offsets_from_lengths(lengths, allow_empty)?;
        let max_len = lengths.iter().copied().max().unwrap_or(0);
        let cu_seqlens = Tensor::from_slice(&offsets, offsets.len(), device)?;
        Ok(Self::known(cu_seqlens, offsets, None, 0, max_len))
    }

    /// A batch whose host copy of the offsets is `offsets` (validated by the caller).
    fn known(
        cu_seqlens: Tensor,
        offsets: Vec<u32>,
        positions: Option<Tensor>,
        position_bound: usize,
        max_len: usize,
    ) -> Self {
        let batch_size = offsets.len() - 1;
        let rows = *offsets.last().unwrap_or(&0) as usize;
        Self {
            cu_seqlens,
            offsets: Some(offsets),
            batch_size,
            rows,
            positions,
            position_bound,
            max_len,
        }
    }

    /// A batch whose lengths live on the device only: `cu_seqlens` (`[batch_size + 1]`, u32)
    /// must start at 0, never decrease, end at most at `rows`, and hold no sequence longer than
    /// `max_len` nor empty — the kernel that wrote it guarantees that, nothing here checks it.
    pub(crate) fn with_device_lengths(
        cu_seqlens: Tensor,
        batch_size: usize,
        rows: usize,
        max_len: usize,
    ) -> Self {
        Self {
            cu_seqlens,
            offsets: None,
            batch_size,
            rows,
            positions: None,
            position_bound: 0,
            max_len,
        }
    }

    /// A batch from kept token positions: `indices[b]` lists, strictly increasing, the positions of
    /// the tokens image `b` keeps out of `tokens_per_image`. Every image must keep at least one.
    pub fn from_keep_indices(
        indices: &[Vec<u32>],
        tokens_per_image: usize,
        device: &Device,
    ) -> Result<Self> {
        for (b, idx) in indices.iter().enumerate() {
            let increasing = idx.windows(2).all(|w| w[0] < w[1]);
            let in_range = idx
                .last()
                .is_none_or(|&last| (last as usize) < tokens_per_image);
            if !increasing || !in_range {
                return Err(RaggedError::BadKeepIndices {
                    index: b,
                    limit: tokens_per_image,
                    found: idx.clone(),
                });
            }
        }
        let lengths: Vec<usize> = indices.iter().map(Vec::len).collect();
        let offsets = offsets_from_lengths(&lengths, false)?;
        let flat: Vec<u32> = indices.iter().flatten().copied().collect();
        let position_bound = indices
            .iter()
            .filter_map(|i| i.last())
            .map(|&p| p as usize + 1)
            .max()
            .unwrap_or(0);
        let max_len = lengths.iter().copied().max().unwrap_or(0);
        let cu_seqlens = Tensor::from_slice(&offsets, offsets.len(), device)?;
        let positions = Tensor::from_slice(&flat, flat.len(), device)?;
        Ok(Self::known(
            cu_seqlens,
            offsets,
            Some(positions),
            position_bound,
            max_len,
        ))
    }

    /// A batch from a `[batch, tokens]` keep mask (any dtype; non-zero means kept). This reads the
    /// mask back to the host once: the total must be known there to allocate the packed tensor.
    pub fn from_keep_mask(mask: &Tensor) -> Result<Self> {
        let (b, n) = match mask.dims() {
            &[b, n] => (b, n),
            _ => {
                return Err(RaggedError::KeepMaskShape {
                    shape: mask.shape().clone(),
                })
            }
        };
        let rows = mask.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        debug_assert_eq!(rows.len(), b);
        let indices: Vec<Vec<u32>> = rows
            .iter()
            .map(|row| {
                row.iter()
                    .enumerate()
                    .filter(|(_, &k)| k != 0.0)
                    .map(|(i, _)| i as u32)
                    .collect()
            })
            .collect();
        Self::from_keep_indices(&indices, n, mask.device())
    }

    /// A batch from an existing `cu_seqlens` tensor (`[batch + 1]`, u32). Reads it back to the host
    /// once to validate it (starts at 0, never decreases, no empty sequence).
    pub fn from_cu_seqlens(cu_seqlens: &Tensor) -> Result<Self> {
        check_cu_seqlens_tensor(cu_seqlens)?;
        let offsets = cu_seqlens.to_vec1::<u32>()?;
        validate_offsets(&offsets, false)?;
        let max_len = offsets
            .windows(2)
            .map(|w| (w[1] - w[0]) as usize)
            .max()
            .unwrap_or(0);
        Ok(Self::known(cu_seqlens.clone(), offsets, None, 0, max_len))
    }

    /// A batch whose lengths live on the device only, over a `cu_seqlens` tensor (`[batch + 1]`,
    /// u32) the host does not read: packed tensors of `rows` rows, no sequence longer than
    /// `max_len`. For a forward captured into a CUDA graph that continues from a batch an earlier
    /// graph made (its `cu_seqlens` copied into the graph's input buffer, `rows` at least the
    /// total read back with [`RaggedBatch::read_total`]). Checks the tensor's dtype and shape only.
    ///
    /// # Safety
    /// The kernels index the packed tensors with these offsets unchecked: `cu_seqlens` must start
    /// at 0, never decrease, end at most at `rows`, and hold no sequence longer than `max_len`
    /// nor empty, as every `cu_seqlens` this crate writes does.
    pub unsafe fn from_device_cu_seqlens_unchecked(
        cu_seqlens: Tensor,
        rows: usize,
        max_len: usize,
    ) -> Result<Self> {
        check_cu_seqlens_tensor(&cu_seqlens)?;
        let batch_size = cu_seqlens.dim(0)? - 1;
        Ok(Self::with_device_lengths(
            cu_seqlens, batch_size, rows, max_len,
        ))
    }

    /// The number of packed rows that belong to a sequence, `cu_seqlens[B]`: the host copy, or,
    /// for a batch whose lengths live on the device only, one u32 read back (a host sync on
    /// CUDA).
    pub fn read_total(&self) -> Result<usize> {
        match &self.offsets {
            Some(o) => Ok(o[self.batch_size] as usize),
            None => Ok(self
                .cu_seqlens
                .narrow(0, self.batch_size, 1)?
                .to_vec1::<u32>()?[0] as usize),
        }
    }

    /// `cu_seqlens`, `[batch + 1]`, u32, on the device of the packed tensors.
    pub fn cu_seqlens(&self) -> &Tensor {
        &self.cu_seqlens
    }

    /// `cu_seqlens` on the host: the host copy, or, for a batch whose lengths live on the device
    /// only, read back (a host sync on CUDA).
    pub fn offsets(&self) -> Result<Cow<'_, [u32]>> {
        match &self.offsets {
            Some(o) => Ok(Cow::Borrowed(o)),
            None => Ok(Cow::Owned(self.cu_seqlens.to_vec1::<u32>()?)),
        }
    }

    /// The host copy of `cu_seqlens`, without reading anything back (`None` for a batch whose
    /// lengths live on the device only).
    pub fn host_offsets(&self) -> Option<&[u32]> {
        self.offsets.as_deref()
    }

    /// Whether the host knows every length (false for a batch made by
    /// [`crate::select_by_rule_bounded`]).
    pub fn lengths_on_host(&self) -> bool {
        self.offsets.is_some()
    }

    /// The length every sequence has, when the host knows they are all equal and non-zero (a
    /// dense batch, or one pruned at a fixed ratio). O(1): `max_len` bounds every length, so
    /// the lengths sum to `batch · max_len` only if each equals it. The attention kernels then
    /// place sequence `b` at row `b · len` without reading `cu_seqlens`.
    pub fn uniform_len(&self) -> Option<usize> {
        (self.offsets.is_some() && self.max_len > 0 && self.rows == self.batch_size * self.max_len)
            .then_some(self.max_len)
    }

    /// Source positions of the packed rows (`[total]`, u32), when built from kept positions.
    pub fn positions(&self) -> Option<&Tensor> {
        self.positions.as_ref()
    }

    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Rows of the packed tensors of this batch: the sum of the lengths, or, when the lengths
    /// live on the device only, the capacity (rows past `cu_seqlens[B]` belong to no sequence).
    pub fn total_tokens(&self) -> usize {
        self.rows
    }

    /// The longest sequence, or an upper bound of it when the lengths live on the device only.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// The first sequence of at most `len` tokens, `(index, its length)`, among lengths the host
    /// knows. `None` as well when the lengths live on the device only: nothing is read back (the
    /// selections that make such batches keep a token after the prefix in every sequence).
    pub fn first_sequence_at_most(&self, len: usize) -> Option<(usize, usize)> {
        self.offsets
            .as_deref()?
            .windows(2)
            .map(|w| (w[1] - w[0]) as usize)
            .enumerate()
            .find(|&(_, l)| l <= len)
    }

    /// Length of each sequence (read back when the lengths live on the device only).
    pub fn lengths(&self) -> Result<Vec<usize>> {
        Ok(self
            .offsets()?
            .windows(2)
            .map(|w| (w[1] - w[0]) as usize)
            .collect())
    }

    /// The device `cu_seqlens` lives on.
    pub fn device(&self) -> &Device {
        self.cu_seqlens.device()
    }

    /// The smallest number of tokens per image that [`crate::unpack`] can scatter into and
    /// [`crate::pack`] can gather from.
    pub fn min_tokens_per_image(&self) -> usize {
        if self.positions.is_some() {
            self.position_bound
        } else {
            self.max_len
        }
    }

    /// The same layout on another device (copies `cu_seqlens` and `positions`).
    pub fn to_device(&self, device: &Device) -> Result<Self> {
        Ok(Self {
            cu_seqlens: self.cu_seqlens.to_device(device)?,
            positions: self
                .positions
                .as_ref()
                .map(|p| p.to_device(device))
                .transpose()?,
            offsets: self.offsets.clone(),
            batch_size: self.batch_size,
            rows: self.rows,
            position_bound: self.position_bound,
            max_len: self.max_len,
        })
    }
}

/// A `cu_seqlens` tensor's dtype and shape: rank-1 u32 with at least 2 entries (one sequence).
fn check_cu_seqlens_tensor(cu_seqlens: &Tensor) -> Result<()> {
    if cu_seqlens.dtype() != DType::U32 || cu_seqlens.rank() != 1 || cu_seqlens.dim(0)? < 2 {
        return Err(RaggedError::CuSeqlensTensor {
            dtype: cu_seqlens.dtype(),
            shape: cu_seqlens.shape().clone(),
        });
    }
    Ok(())
}

fn offsets_from_lengths(lengths: &[usize], allow_empty: bool) -> Result<Vec<u32>> {
    if lengths.is_empty() {
        return Err(RaggedError::EmptyBatch);
    }
    let mut offsets = Vec::with_capacity(lengths.len() + 1);
    offsets.push(0u32);
    let mut total = 0usize;
    for (index, &len) in lengths.iter().enumerate() {
        if len == 0 && !allow_empty {
            return Err(RaggedError::EmptySequence { index });
        }
        total += len;
        let off = u32::try_from(total).map_err(|_| RaggedError::TooManyTokens { total })?;
        offsets.push(off);
    }
    Ok(offsets)
}

fn validate_offsets(offsets: &[u32], allow_empty: bool) -> Result<()> {
    if offsets[0] != 0 {
        return Err(RaggedError::CuSeqlensStart { first: offsets[0] });
    }
    for index in 1..offsets.len() {
        let (prev, value) = (offsets[index - 1], offsets[index]);
        if value < prev {
            return Err(RaggedError::CuSeqlensNotMonotone { index, prev, value });
        }
        if value == prev && !allow_empty {
            return Err(RaggedError::EmptySequence { index: index - 1 });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_give_prefix_sums() {
        let b = RaggedBatch::from_lengths(&[3, 1, 5], &Device::Cpu).unwrap();
        assert_eq!(&*b.offsets().unwrap(), &[0, 3, 4, 9]);
        assert_eq!(b.cu_seqlens().to_vec1::<u32>().unwrap(), vec![0, 3, 4, 9]);
        assert_eq!((b.batch_size(), b.total_tokens(), b.max_len()), (3, 9, 5));
        assert_eq!(b.lengths().unwrap(), vec![3, 1, 5]);
    }

    #[test]
    fn uniform_len_only_when_every_length_is_equal() {
        let dev = Device::Cpu;
        let of = |l: &[usize]| RaggedBatch::from_lengths(l, &dev).unwrap().uniform_len();
        assert_eq!(of(&[3, 3, 3]), Some(3));
        assert_eq!(of(&[197]), Some(197));
        assert_eq!(of(&[3, 1, 5]), None);
        // Same total as two of 3, and as 2 · 4 - 2: neither is uniform.
        assert_eq!(of(&[2, 4]), None);
        assert_eq!(of(&[4, 2]), None);
        let empty = RaggedBatch::from_lengths_allowing_empty(&[0, 0], &dev).unwrap();
        assert_eq!(empty.uniform_len(), None);
        let mixed = RaggedBatch::from_lengths_allowing_empty(&[2, 0, 2], &dev).unwrap();
        assert_eq!(mixed.uniform_len(), None);
        let kept = RaggedBatch::from_keep_indices(&[vec![0, 2], vec![1, 3]], 4, &dev).unwrap();
        assert_eq!(kept.uniform_len(), Some(2));
    }

    #[test]
    fn empty_inputs_are_refused_unless_allowed() {
        assert!(matches!(
            RaggedBatch::from_lengths(&[], &Device::Cpu),
            Err(RaggedError::EmptyBatch)
        ));
        assert!(matches!(
            RaggedBatch::from_lengths(&[2, 0, 1], &Device::Cpu),
            Err(RaggedError::EmptySequence { index: 1 })
        ));
        let b = RaggedBatch::from_lengths_allowing_empty(&[2, 0, 1], &Device::Cpu).unwrap();
        assert_eq!(&*b.offsets().unwrap(), &[0, 2, 2, 3]);
    }

    #[test]
    fn cu_seqlens_are_validated() {
        let dev = Device::Cpu;
        let bad_start = Tensor::new(&[1u32, 3, 4], &dev).unwrap();
        assert!(matches!(
            RaggedBatch::from_cu_seqlens(&bad_start),
            Err(RaggedError::CuSeqlensStart { first: 1 })
        ));
        let decreasing = Tensor::new(&[0u32, 5, 4], &dev).unwrap();
        assert!(matches!(
            RaggedBatch::from_cu_seqlens(&decreasing),
            Err(RaggedError::CuSeqlensNotMonotone {
                index: 2,
                prev: 5,
                value: 4
            })
        ));
        let wrong_dtype = Tensor::new(&[0i64, 5], &dev).unwrap();
        assert!(matches!(
            RaggedBatch::from_cu_seqlens(&wrong_dtype),
            Err(RaggedError::CuSeqlensTensor { .. })
        ));
        let too_short = Tensor::new(&[0u32], &dev).unwrap();
        assert!(matches!(
            RaggedBatch::from_cu_seqlens(&too_short),
            Err(RaggedError::CuSeqlensTensor { .. })
        ));
        let ok = RaggedBatch::from_cu_seqlens(&Tensor::new(&[0u32, 2, 7], &dev).unwrap()).unwrap();
        assert_eq!(
            (ok.batch_size(), ok.total_tokens(), ok.max_len()),
            (2, 7, 5)
        );
    }

    #[test]
    fn keep_indices_and_masks_agree() {
        let dev = Device::Cpu;
        let mask = Tensor::new(&[[1u8, 0, 1, 1], [0, 1, 0, 0]], &dev).unwrap();
        let from_mask = RaggedBatch::from_keep_mask(&mask).unwrap();
        let from_idx = RaggedBatch::from_keep_indices(&[vec![0, 2, 3], vec![1]], 4, &dev).unwrap();
        assert_eq!(from_mask.offsets().unwrap(), from_idx.offsets().unwrap());
        assert_eq!(&*from_mask.offsets().unwrap(), &[0, 3, 4]);
        let pos = from_mask.positions().unwrap().to_vec1::<u32>().unwrap();
        assert_eq!(pos, vec![0, 2, 3, 1]);
        assert_eq!(from_mask.min_tokens_per_image(), 4);
    }

    #[test]
    fn bad_keep_indices_are_refused() {
        let dev = Device::Cpu;
        assert!(matches!(
            RaggedBatch::from_keep_indices(&[vec![0, 0]], 4, &dev),
            Err(RaggedError::BadKeepIndices { index: 0, .. })
        ));
        assert!(matches!(
            RaggedBatch::from_keep_indices(&[vec![1], vec![4]], 4, &dev),
            Err(RaggedError::BadKeepIndices { index: 1, .. })
        ));
        assert!(matches!(
            RaggedBatch::from_keep_indices(&[vec![1], vec![]], 4, &dev),
            Err(RaggedError::EmptySequence { index: 1 })
        ));
    }
}
