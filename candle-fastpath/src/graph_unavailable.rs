//! [`CapturedForward`] in a build without the `cuda` feature: same API, and `capture` says why it
//! cannot work, so callers need no `cfg` of their own.

use candle_core::Tensor;

use crate::error::{FastpathError, Result};
use crate::GraphNodes;

/// See the CUDA build's documentation; without CUDA no value of this type can exist.
#[derive(Debug)]
pub struct CapturedForward {
    never: std::convert::Infallible,
}

impl CapturedForward {
    /// Always an error: CUDA graphs need a CUDA device (and this build has no CUDA support).
    pub fn capture<F>(example: &Tensor, _forward: F) -> Result<Self>
    where
        F: Fn(&Tensor) -> candle_core::Result<Tensor>,
    {
        Err(FastpathError::NotCuda {
            op: "CapturedForward::capture",
            device: format!(
                "{:?} (built without the `cuda` feature)",
                example.device().location()
            ),
        })
    }

    /// Always an error, as [`Self::capture`].
    pub fn capture_many<F>(examples: &[Tensor], _forward: F) -> Result<Self>
    where
        F: Fn(&[Tensor]) -> candle_core::Result<Vec<Tensor>>,
    {
        Err(FastpathError::NotCuda {
            op: "CapturedForward::capture",
            device: format!(
                "{:?} (built without the `cuda` feature)",
                examples.first().map(|x| x.device().location())
            ),
        })
    }

    pub fn run(&self, _input: &Tensor) -> Result<Tensor> {
        match self.never {}
    }

    pub fn replay(&self, _input: &Tensor) -> Result<()> {
        match self.never {}
    }

    pub fn replay_many(&self, _inputs: &[&Tensor]) -> Result<()> {
        match self.never {}
    }

    pub fn output(&self) -> &Tensor {
        match self.never {}
    }

    pub fn nodes(&self) -> Result<GraphNodes> {
        match self.never {}
    }

    pub fn outputs(&self) -> &[Tensor] {
        match self.never {}
    }
}
