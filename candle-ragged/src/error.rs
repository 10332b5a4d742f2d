//! Typed errors of this crate. Public functions return [`Result`], whose error callers can match on;
//! `RaggedError` converts into `candle_core::Error`, so `?` works inside ordinary candle code too.

use candle_core::{DType, Shape};

#[derive(Debug, thiserror::Error)]
pub enum RaggedError {
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error("ragged batch: empty batch (no sequences)")]
    EmptyBatch,
    #[error("ragged batch: sequence {index} is empty (use the *_allowing_empty constructors if that is intended)")]
    EmptySequence { index: usize },
    #[error("ragged batch: cu_seqlens must start at 0, found {first}")]
    CuSeqlensStart { first: u32 },
    #[error("ragged batch: cu_seqlens must not decrease, but cu_seqlens[{index}] = {value} < cu_seqlens[{prev_index}] = {prev}", prev_index = index - 1)]
    CuSeqlensNotMonotone { index: usize, prev: u32, value: u32 },
    #[error("ragged batch: cu_seqlens must be a rank-1 u32 tensor with at least 2 entries, got dtype {dtype:?} and shape {shape:?}")]
    CuSeqlensTensor { dtype: DType, shape: Shape },
    #[error("ragged batch: {total} tokens in all overflow u32 offsets")]
    TooManyTokens { total: usize },
    #[error("ragged batch: keep indices of sequence {index} must be strictly increasing and below {limit}, found {found:?}")]
    BadKeepIndices {
        index: usize,
        limit: usize,
        found: Vec<u32>,
    },
    #[error(
        "ragged batch: keep mask must be a rank-2 [batch, tokens] tensor, got shape {shape:?}"
    )]
    KeepMaskShape { shape: Shape },
    #[error("{op}: {what} must have rank {expected}, got shape {shape:?}")]
    Rank {
        op: &'static str,
        what: &'static str,
        expected: usize,
        shape: Shape,
    },
    #[error("{op}: {what} has shape {found:?}, expected {expected:?}")]
    ShapeMismatch {
        op: &'static str,
        what: &'static str,
        expected: Shape,
        found: Shape,
    },
    #[error("{op}: {what} has {found} tokens but the batch describes {expected}")]
    TotalMismatch {
        op: &'static str,
        what: &'static str,
        expected: usize,
        found: usize,
    },
    #[error(
        "{op}: the last dimension of {what} must be contiguous (stride 1), got strides {stride:?}"
    )]
    LastDimNotContiguous {
        op: &'static str,
        what: &'static str,
        stride: Vec<usize>,
    },
    #[error("{op}: dtype mismatch, {what} is {found:?} but q is {expected:?}")]
    DTypeMismatch {
        op: &'static str,
        what: &'static str,
        expected: DType,
        found: DType,
    },
    #[error("{op}: unsupported dtype {dtype:?} (supported: f32, f16, bf16)")]
    UnsupportedDType { op: &'static str, dtype: DType },
    #[error("{op}: head_dim {head_dim} is not supported (supported: {supported:?})")]
    UnsupportedHeadDim {
        op: &'static str,
        head_dim: usize,
        supported: &'static [usize],
    },
    #[error("{op}: sequence length {len} exceeds the limit of {limit} tokens")]
    SequenceTooLong {
        op: &'static str,
        len: usize,
        limit: usize,
    },
    #[error("{op}: {what} is on {found} but q is on {expected}")]
    DeviceMismatch {
        op: &'static str,
        what: &'static str,
        expected: String,
        found: String,
    },
    #[error("{op}: softmax_scale must be finite, got {scale}")]
    BadScale { op: &'static str, scale: f32 },
    #[error("{op}: batch has {expected} sequences but the tensor has {found}")]
    BatchMismatch {
        op: &'static str,
        expected: usize,
        found: usize,
    },
    #[error("{op}: a kept position {position} is outside the {tokens} tokens per image")]
    PositionOutOfRange {
        op: &'static str,
        position: usize,
        tokens: usize,
    },
    #[error("{op}: a sequence of {len} tokens does not fit in {tokens} tokens per image")]
    SequenceDoesNotFit {
        op: &'static str,
        len: usize,
        tokens: usize,
    },
}

impl From<RaggedError> for candle_core::Error {
    fn from(e: RaggedError) -> Self {
        match e {
            RaggedError::Candle(e) => e,
            other => candle_core::Error::wrap(other),
        }
    }
}

pub type Result<T> = std::result::Result<T, RaggedError>;
