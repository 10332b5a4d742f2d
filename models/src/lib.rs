//! DeiT vision transformers in candle: configs, modules, checkpoint loading (timm and
//! transformers namings, safetensors and PyTorch pickles, from the Hub or local files),
//! preprocessing and class names; token-pruned execution (dense / padded / ragged) in
//! [`pruned`].
//!
//! ```no_run
//! use candle_core::{DType, Device, Module};
//! use models::{fetch, Checkpoint, DeiTConfig, HubSource, PreprocessConfig};
//!
//! # fn main() -> anyhow::Result<()> {
//! let cfg = DeiTConfig::from_name("deit-small")?;
//! let files = fetch(&cfg, HubSource::Timm)?;
//! let model = Checkpoint::from_file(&files.weights)?.load_model(&cfg, DType::F32, &Device::Cpu)?;
//! let pre = PreprocessConfig::for_checkpoint(files.config.as_deref(), None, 224)?;
//! let logits = model.forward(&pre.load_batch(&["cat.jpg"])?)?;
//! # Ok(()) }
//! ```

pub mod attention;
pub mod checkpoint;
pub mod config;
mod cpu_pool;
pub mod deit;
pub mod error;
pub mod hub;
pub mod labels;
pub mod on_device;
pub mod preprocess;
pub mod pruned;
pub mod staged;
pub mod uniform_batches;

pub use attention::{attend, cls_attention, AttentionInputs, KeyPaddingMask};
pub use checkpoint::{expected_tensors, load_deit, Checkpoint, CheckpointFiles, WeightNaming};
pub use config::{DeiTConfig, MODEL_NAMES};
pub use deit::{Attention, Block, DeiT, Mlp, PatchEmbed};
pub use error::{ModelError, PreprocessError};
pub use hub::{fetch, HubSource};
pub use labels::{class_names, imagenet1k_classes, imagenet1k_index_of_wnid, ImageNetClass};
pub use on_device::{CapturablePrunedForward, DevicePrunedForward, PrunedTokens};
pub use preprocess::{check_image_file, decode_image, Interpolation, PreprocessConfig, Resize};
pub use pruned::{BlockPruner, ExecutionPath, PruneStage, PrunedForward};
pub use staged::{Reads, StagedGraph};
pub use uniform_batches::UniformBatches;

/// Whether the environment variable `name` is `value` (trimmed), read once into `cell`: the
/// models' A/B switches (`CANDLE_DEIT_*`, listed in the README).
pub(crate) fn env_switch(
    cell: &'static std::sync::OnceLock<bool>,
    name: &str,
    value: &str,
) -> bool {
    *cell.get_or_init(|| std::env::var(name).is_ok_and(|v| v.trim() == value))
}
