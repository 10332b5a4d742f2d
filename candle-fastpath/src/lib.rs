//! The CUDA hot path for candle vision transformers, usable by any candle model:
//!
//! - [`FusedLinear`]: `x·Wᵀ + b`, optionally followed by the exact (erf) GELU or added to a
//!   residual, as one cuBLASLt call with the bias (and residual) in its epilogue (plus one
//!   in-place GELU kernel). candle's own `Linear` runs a matmul and then a separate broadcast add
//!   (and a GELU, and a residual add), each a full pass over the activations; in a ViT those
//!   passes cost more than the matmuls. On the CPU, with the same semantics, the product
//!   runs as AVX2 / FMA register tiles over the weight packed once into panels (in its own
//!   dtype), the bias, residual and GELU applied while each block is in cache ([`cpu_packed`];
//!   one f32 `gemm` call and one pass after it on other CPUs); f16 / bf16 inputs are widened,
//!   the output rounded once.
//! - [`LayerNorm`]: torch's LayerNorm as one bandwidth-bound kernel on CUDA (one pass a row of
//!   ours on the CPU); [`norm_linear`]: a LayerNorm and the Linear (and GELU) after it as one kernel
//!   where rows are few and narrow (a DeiT-T block at batch 1), [`residual_norm_linear`]
//!   the attention's output projection and residual in front of that, and
//!   [`attention_residual_norm_linear`] the attention itself too (one image's tokens); at
//!   DeiT-S's width, [`linear_residual_norm`] the projection, residual and LayerNorm, and
//!   [`attention_linear_residual_norm`] the attention in front of those (one image's tokens).
//! - [`linear_log_prob`]: one class's log-probability under a small linear classifier (a learned
//!   pruner's keep score) as one kernel.
//! - [`patchify`]: a ViT's patch rows (im2col of the stride-p patch conv) gathered and cast in
//!   one kernel ([`patchify_after_zero_rows`]: with zero rows where the class token goes, for a
//!   patch GEMM over a whole sequence's rows); [`embed_tokens`]: class / distillation tokens,
//!   patch tokens and the position embedding into the first block's input in one kernel.
//! - [`retain_freed_memory`] and [`PeakMemory`]: the CUDA memory pool candle allocates from,
//!   kept cached across synchronisations, and its high-water mark; [`track_buffer_events`]:
//!   cudarc's per-buffer events, which a single-stream program can skip.
//! - [`small_block`]: a whole pre-norm ViT block (LayerNorms, qkv, attention over packed
//!   sequences, proj, MLP, residuals) in one cooperative launch, for batch-1 token counts where
//!   launching the block's ~8 kernels one by one costs more host time than the GPU work.
//! - [`CapturedForward`] (CUDA; elsewhere `capture` returns an error): captures a whole forward (any closure of candle ops) into a CUDA
//!   graph once and replays it, so a call costs one graph launch instead of hundreds of kernel
//!   launches through candle's generic op path.
//!
//! ```
//! use candle_core::{Device, Module, Tensor};
//! use candle_fastpath::{Epilogue, FusedLinear};
//!
//! # fn main() -> candle_fastpath::Result<()> {
//! let dev = Device::Cpu;
//! let fc = FusedLinear::new(Tensor::randn(0f32, 1.0, (8, 4), &dev)?, Some(Tensor::zeros(8, candle_core::DType::F32, &dev)?))?;
//! let x = Tensor::randn(0f32, 1.0, (2, 3, 4), &dev)?; // any leading dims
//! let h = fc.forward_with(&x, Epilogue::Gelu)?; // gelu(x·Wᵀ + b): [2, 3, 8]
//! let y = fc.forward(&x)?; // the plain Module call
//! let r = fc.forward_with(&x, Epilogue::Residual(&y))?; // y + x·Wᵀ + b
//! assert_eq!(h.dims(), &[2, 3, 8]);
//! assert_eq!(r.dims(), &[2, 3, 8]);
//! # Ok(())
//! # }
//! ```

mod amx_cpu;
mod attention_norm_linear;
mod block_cpu;
mod cpu_pieces;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(all(feature = "cuda", fastpath_cutlass))]
mod cutlass;
mod embed;
mod error;
mod gelu_cpu;
mod gelu_form;
#[cfg(feature = "cuda")]
mod graph;
#[cfg(not(feature = "cuda"))]
#[path = "graph_unavailable.rs"]
mod graph;
mod graph_nodes;
mod head;
mod linear;
mod linear_cpu;
mod norm;
mod norm_cpu;
mod norm_linear;
mod packed_cpu;
mod patch;
mod pool;
mod pooled_head;
#[cfg(feature = "cuda")]
mod programmatic;
mod shared_memory;
mod small_block;
// Read only by CUDA code; compiled everywhere so its unit test runs in CI.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod switches;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod tuning;

pub use attention_norm_linear::{
    attention_block, attention_block_applies, attention_block_enabled, attention_block_with_norms,
    attention_cls_probs_enabled, attention_linear_residual_norm,
    attention_linear_residual_norm_applies, attention_linear_residual_norm_enabled,
    attention_residual, attention_residual_applies, attention_residual_enabled,
    attention_residual_norm_linear, attention_residual_norm_linear_applies,
    attention_residual_norm_linear_enabled, attention_residual_with_cls_probs, mlp_block,
    mlp_block_applies, mlp_block_enabled, select_attention_block, select_attention_block_applies,
    select_attention_block_enabled, select_attention_block_with_norms, select_mlp_block,
    select_mlp_block_applies, select_mlp_block_enabled, BlockTail, MlpTail,
};
pub use block_cpu::cpu_row_chunks;
pub use embed::embed_tokens;
pub use error::{FastpathError, Result};
pub use gelu_cpu::gelu_erf;
pub use gelu_form::gelu_phi_form;
pub use graph::CapturedForward;
pub use graph_nodes::{
    graph_input_copy_in_graph, is_capturing, programmatic_edges_enabled, GraphNodes,
};
pub use head::{linear_log_prob, HEAD_MAX_CLASSES};
pub use linear::{
    cpu_gemm, linear, linear_no_bias, thin_gemm_mode, thin_gemm_wide, Epilogue, FusedLinear,
    ThinGemmMode,
};
pub use norm::{cpu_norm, layer_norm, LayerNorm};
pub use norm_linear::{
    block_after_attention, block_mlp, fc2_then_next, linear_residual_norm,
    linear_residual_norm_applies, linear_residual_norm_enabled, norm_linear, norm_linear_applies,
    norm_linear_mode, norm_linear_tile_rows, residual_norm_linear, residual_norm_linear_applies,
    residual_norm_linear_forms, residual_norm_linear_step_applies, thin_residual_norm_tiles,
    BlockMlp, NormLinearMode, ResidualNormLinearForms, ThinResidualNormTiles, NORM_LINEAR_DIMS,
};
pub use packed_cpu::cpu_packed;
pub use patch::{patchify, patchify_after_zero_rows};
pub use pool::{retain_freed_memory, track_buffer_events, PeakMemory};
pub use pooled_head::{pooled_head_enabled, PooledMlpHead, POOLED_HEAD_WIDTHS};
pub use small_block::{
    small_block, small_block_applies, small_block_max_rows, small_block_mode, BlockWeights,
    SmallBlockMode, SMALL_BLOCK_DIMS, SMALL_BLOCK_HEAD_DIM, SMALL_BLOCK_MAX_LEN,
};
