//! Typed errors of the `models` crate. Every variant names the thing that went wrong (model,
//! tensor, file) so that a one-line `{:#}` rendering is actionable.

use std::path::PathBuf;

/// Errors from configs, checkpoints and the forward pass.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("unknown model `{name}`; valid models: {valid}")]
    UnknownModel { name: String, valid: String },

    #[error("invalid config `{name}`: {reason}")]
    InvalidConfig { name: String, reason: String },

    #[error("checkpoint is missing tensor `{name}` (expected shape {expected:?})")]
    MissingTensor { name: String, expected: Vec<usize> },

    #[error("checkpoint has unexpected tensor `{name}` (shape {found:?}) that the {model} model does not use")]
    UnexpectedTensor {
        name: String,
        found: Vec<usize>,
        model: String,
    },

    #[error("tensor `{name}` has shape {found:?}, expected {expected:?} for {model}")]
    ShapeMismatch {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
        model: String,
    },

    #[error("model {model} {} but the checkpoint {}; use the matching config (e.g. deit-small vs deit-small-distilled)", if *model_distilled { "is distilled (has a distillation token)" } else { "is not distilled" }, if *model_distilled { "has no distillation token" } else { "has a distillation token (a *-distilled model)" })]
    DistilledMismatch {
        model: String,
        model_distilled: bool,
    },

    #[error("cannot recognise the checkpoint's tensor naming (no `cls_token`, `vit.embeddings.cls_token` or `deit.embeddings.cls_token`); is it a DeiT/ViT checkpoint?")]
    UnknownNaming,

    #[error("cannot infer the architecture from the checkpoint: {0}")]
    CannotInfer(String),

    #[error("cannot read weights file {}: {reason}", path.display())]
    ReadWeights { path: PathBuf, reason: String },

    #[error("unsupported weights file {}: expected .safetensors, .bin, .pth or .pt", path.display())]
    UnsupportedWeightsFormat { path: PathBuf },

    #[error("cannot download {repo}/{file} from the Hugging Face Hub: {reason}; pass --weights FILE to use a local checkpoint")]
    Download {
        repo: String,
        file: String,
        reason: String,
    },

    #[error("cannot read config {}: {reason}", path.display())]
    ReadConfig { path: PathBuf, reason: String },

    #[error("labels: {0}")]
    Labels(String),

    #[error("invalid pruning setup: {0}")]
    InvalidPruning(String),

    #[error(transparent)]
    Prune(#[from] pruners::PruneError),

    #[error(transparent)]
    Ragged(#[from] candle_ragged::RaggedError),

    #[error(transparent)]
    Candle(#[from] candle_core::Error),

    #[error(transparent)]
    Fastpath(#[from] candle_fastpath::FastpathError),
}

/// Errors from decoding and preprocessing one image; each names the file.
#[derive(Debug, thiserror::Error)]
pub enum PreprocessError {
    #[error("cannot read image {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("cannot decode image {}: the file is empty", path.display())]
    Empty { path: PathBuf },

    #[error("cannot decode image {}: unrecognised image format (supported: JPEG, PNG, WebP, GIF, BMP)", path.display())]
    UnknownFormat { path: PathBuf },

    #[error("cannot decode image {}: {width}x{height} is {} pixels, more than the limit of {max_pixels}", path.display(), *width as u64 * *height as u64)]
    TooLarge {
        path: PathBuf,
        width: u32,
        height: u32,
        max_pixels: u64,
    },

    #[error("cannot decode image {}: it has zero width or height", path.display())]
    ZeroSized { path: PathBuf },

    #[error("cannot decode image {}: {reason}", path.display())]
    Decode { path: PathBuf, reason: String },

    #[error("cannot read preprocessing config {}: {reason}", path.display())]
    Config { path: PathBuf, reason: String },

    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}
