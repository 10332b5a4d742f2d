//! Typed errors of this crate. Public functions return [`Result`]; `FastpathError` converts into
//! `candle_core::Error`, so `?` works inside ordinary candle code (a `Module::forward`) too.

use candle_core::{DType, Shape};

#[derive(Debug, thiserror::Error)]
pub enum FastpathError {
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error("{op}: {what} must have rank {expected}, got shape {shape:?}")]
    Rank {
        op: &'static str,
        what: &'static str,
        expected: &'static str,
        shape: Shape,
    },
    #[error("{op}: {what} has shape {found:?}, expected {expected:?}")]
    ShapeMismatch {
        op: &'static str,
        what: &'static str,
        expected: Shape,
        found: Shape,
    },
    #[error("{op}: {what} has no elements (shape {shape:?})")]
    Empty {
        op: &'static str,
        what: &'static str,
        shape: Shape,
    },
    #[error("{op}: dtype mismatch, {what} is {found:?} but the weight is {expected:?}")]
    DTypeMismatch {
        op: &'static str,
        what: &'static str,
        expected: DType,
        found: DType,
    },
    #[error("{op}: unsupported dtype {dtype:?} (supported: f32, f16, bf16)")]
    UnsupportedDType { op: &'static str, dtype: DType },
    #[error("{op}: {what} is on {found} but the weight is on {expected}")]
    DeviceMismatch {
        op: &'static str,
        what: &'static str,
        expected: String,
        found: String,
    },
    #[error("{op}: needs a CUDA device, got {device}")]
    NotCuda { op: &'static str, device: String },
    #[error("{op}: cuBLASLt failed: {status}")]
    Cublas { op: &'static str, status: String },
    #[error("fused_linear: the CUTLASS GEMM failed: {status}")]
    Cutlass { status: String },
    #[error("CUDA graph: {0}")]
    Graph(String),
    #[error("CUDA memory pool, {what}: {code}")]
    Pool { what: String, code: String },
    /// A fused kernel called where its `*_applies` check says no (the caller should have taken
    /// the unfused path).
    #[error("{op}: the fused kernel does not apply ({inputs}); check {op}_applies first")]
    NotApplicable { op: &'static str, inputs: String },
}

impl FastpathError {
    /// `Err(DeviceMismatch)` unless `found` is on `expected`'s device.
    pub(crate) fn check_same_device(
        op: &'static str,
        what: &'static str,
        found: &candle_core::Device,
        expected: &candle_core::Device,
    ) -> Result<()> {
        if found.same_device(expected) {
            return Ok(());
        }
        Err(FastpathError::DeviceMismatch {
            op,
            what,
            expected: format!("{:?}", expected.location()),
            found: format!("{:?}", found.location()),
        })
    }
}

impl From<FastpathError> for candle_core::Error {
    fn from(e: FastpathError) -> Self {
        match e {
            FastpathError::Candle(e) => e,
            other => candle_core::Error::wrap(other),
        }
    }
}

pub type Result<T> = std::result::Result<T, FastpathError>;
