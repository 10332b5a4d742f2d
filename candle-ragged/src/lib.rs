//! Ragged attention for candle: bidirectional attention over a packed batch of variable-length
//! sequences in one kernel launch, plus the pack / unpack ops that move tokens between the
//! image-shaped `[batch, tokens, channels]` layout and the packed `[total, channels]` one.
//!
//! Built for token-pruned vision transformers, where every image keeps a different number of
//! tokens: instead of padding to the longest image, the kept tokens are packed and described by
//! a [`RaggedBatch`] (`cu_seqlens`, FlashAttention's varlen convention).
//!
//! Every op has a CPU implementation and, with the `cuda` feature, a CUDA one with identical
//! semantics (f32, f16, bf16; f32 accumulation). The CUDA path launches one kernel per call,
//! never waits on the GPU and loads its kernels once per device.
//!
//! ```
//! use candle_core::{DType, Device, IndexOp, Tensor};
//! use candle_ragged::{pack, ragged_attention, unpack, RaggedBatch};
//!
//! # fn main() -> candle_ragged::Result<()> {
//! let dev = Device::Cpu;
//! let (heads, head_dim) = (2, 32);
//! // Two images of 5 tokens; the first keeps tokens 0, 1, 3, the second keeps 0 and 4.
//! let x = Tensor::randn(0f32, 1.0, (2, 5, 3 * heads * head_dim), &dev)?;
//! let batch = RaggedBatch::from_keep_indices(&[vec![0, 1, 3], vec![0, 4]], 5, &dev)?;
//! let packed = pack(&x, &batch)?; // [5, 3 * heads * head_dim]
//! let qkv = packed.reshape((batch.total_tokens(), 3, heads, head_dim))?;
//! let (q, k, v) = (qkv.i((.., 0))?, qkv.i((.., 1))?, qkv.i((.., 2))?); // strided views, no copies
//! let o = ragged_attention(&q, &k, &v, &batch, 1.0 / (head_dim as f32).sqrt())?;
//! assert_eq!(o.dims(), &[5, heads, head_dim]);
//! let back = unpack(&o.reshape((5, heads * head_dim))?, &batch, 5)?; // [2, 5, heads * head_dim]
//! assert_eq!(back.dims(), &[2, 5, heads * head_dim]);
//! assert_eq!(back.dtype(), DType::F32);
//! # Ok(())
//! # }
//! ```

#[doc(hidden)]
pub mod amx;
mod attention;
mod attention_amx;
mod batch;
mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod error;
#[doc(hidden)]
pub mod half_cpu;
pub mod keep;
mod pack;
mod reduce;
mod resident_plan;
mod scores;
mod select;
mod select_rule;
mod step_scores;

pub use attention::{ragged_attention, RaggedAttention, SUPPORTED_HEAD_DIMS};
pub use batch::{RaggedBatch, MAX_SEQ_LEN};
pub use error::{RaggedError, Result};
pub use keep::{KeepCount, KeepRule};
pub use pack::{leading_rows, pack, unpack, LeadingRows, Pack, Unpack};
pub use reduce::{sequence_mean, SequenceMean};
pub use scores::TokenScores;
pub use select::{select_top_k, select_top_k_by, select_top_k_gathering, DroppedFusion};
pub use select_rule::{select_by_rule, select_by_rule_bounded};
pub use step_scores::{step_scores, StepScoreLayout, StepScores};
