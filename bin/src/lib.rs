//! Shared pieces of the command-line tools: device/dtype/model options and model loading, and
//! the one-line error reporting every tool uses.

/// Makes mimalloc the binary's global allocator (the `mimalloc` feature, on by default).
///
/// Why: a CPU forward allocates every op's output afresh (candle's CPU ops return new vectors),
/// hundreds of MB a forward at batch 8, from the pool's 16 threads at once. glibc's malloc hands
/// much of that back to the kernel and takes it again: ~950 page faults a DeiT-T forward at
/// batch 1 on a 16-core Intel host (5 a forward with mimalloc), each a kernel entry contending on
/// the process's memory map. There, DeiT-T / S at batch 1 and 8 ran 1.10-1.42x faster (median
/// 1.25x) with mimalloc; glibc with a raised mmap / trim threshold 0.89-1.20x, jemalloc
/// 0.83-1.33x (docs/BENCHMARKS.md, "The CPU path"). A library cannot choose the allocator of the
/// program that links it, so this lives in the tools; a program embedding our crates picks its
/// own (`#[global_allocator]`).
#[macro_export]
macro_rules! fast_allocator {
    () => {
        #[cfg(feature = "mimalloc")]
        #[global_allocator]
        static GLOBAL_ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
    };
}

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use clap::ValueEnum;
use models::{
    class_names, fetch, Checkpoint, CheckpointFiles, DeiT, DeiTConfig, HubSource, ModelError,
    PreprocessConfig, MODEL_NAMES,
};

/// Where to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DeviceArg {
    Cpu,
    Cuda,
}

impl DeviceArg {
    /// Opens the device; `cuda` needs a build with the `cuda` feature and a GPU.
    pub fn open(self) -> Result<Device> {
        match self {
            Self::Cpu => Ok(Device::Cpu),
            Self::Cuda => open_cuda(),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::Cuda => "cuda",
        }
    }
}

#[cfg(feature = "cuda")]
fn open_cuda() -> Result<Device> {
    let dev = Device::new_cuda(0)
        .context("cannot open CUDA device 0 (is there a GPU and a working driver?)")?;
    // Keep freed activations cached across read-backs (see candle_fastpath::retain_freed_memory).
    candle_fastpath::retain_freed_memory(&dev, true)?;
    Ok(dev)
}

#[cfg(not(feature = "cuda"))]
fn open_cuda() -> Result<Device> {
    bail!("this build has no CUDA support; rebuild with --features cuda")
}

/// Compute dtype of the weights and activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DTypeArg {
    F32,
    F16,
    Bf16,
}

impl DTypeArg {
    pub fn dtype(self) -> DType {
        match self {
            Self::F32 => DType::F32,
            Self::F16 => DType::F16,
            Self::Bf16 => DType::BF16,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::Bf16 => "bf16",
        }
    }
}

/// Which Hub repository family to download from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SourceArg {
    /// `timm/deit_{size}[_distilled]_patch16_224.fb_in1k`
    Timm,
    /// `facebook/deit-{size}[-distilled]-patch16-224`
    Facebook,
}

impl SourceArg {
    pub fn hub(self) -> HubSource {
        match self {
            Self::Timm => HubSource::Timm,
            Self::Facebook => HubSource::Facebook,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Timm => "timm",
            Self::Facebook => "facebook",
        }
    }
}

/// Options selecting and loading a model, shared by the tools.
#[derive(Debug, Clone, clap::Args)]
pub struct ModelArgs {
    /// Architecture (and Hub checkpoint) to use.
    #[arg(long, default_value = "deit-small", value_parser = clap::builder::PossibleValuesParser::new(MODEL_NAMES))]
    pub model: String,

    /// Hub repository family to download the weights from (ignored with --weights).
    #[arg(long, value_enum, default_value_t = SourceArg::Timm)]
    pub source: SourceArg,

    /// Local checkpoint (.safetensors, or PyTorch .bin/.pth/.pt); no network is used.
    /// config.json / preprocessor_config.json next to it are used for labels and preprocessing.
    /// Any of the three namings (timm, transformers ViT, transformers DeiT) is accepted.
    #[arg(long, value_name = "FILE")]
    pub weights: Option<PathBuf>,

    /// A timm or transformers config.json to use instead of the one next to the weights (class
    /// names, preprocessing, head count).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Take the architecture from the checkpoint's tensor shapes instead of --model (dim, depth,
    /// patch/image size, MLP ratio, classes, distillation). The head count comes from --heads,
    /// else config.json (num_heads / num_attention_heads), else the DeiT value for the width
    /// (192→3, 384→6, 768→12) or width/64.
    #[arg(long, requires = "weights")]
    pub infer_arch: bool,

    /// Attention heads, for --infer-arch.
    #[arg(long, requires = "infer_arch", value_parser = clap::value_parser!(u32).range(1..))]
    pub heads: Option<u32>,

    /// Device to run on.
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,

    /// Compute dtype.
    #[arg(long, value_enum, default_value_t = DTypeArg::F32)]
    pub dtype: DTypeArg,
}

/// A model ready to run, with its class names and preprocessing.
#[derive(Debug)]
pub struct LoadedModel {
    pub model: DeiT,
    pub config: DeiTConfig,
    pub labels: Vec<String>,
    pub preprocess: PreprocessConfig,
    pub files: CheckpointFiles,
    pub device: Device,
}

/// Opens the device, gets the checkpoint (local file or Hub), validates it against the config
/// and builds the model, class names and preprocessing.
pub fn load_model(args: &ModelArgs) -> Result<LoadedModel> {
    let device = args.device.open()?;
    let named = DeiTConfig::from_name(&args.model)?;
    let mut files = match &args.weights {
        Some(w) => CheckpointFiles::local(w),
        None => fetch(&named, args.source.hub())?,
    };
    if let Some(c) = &args.config {
        if !c.is_file() {
            bail!("cannot read config {}: no such file", c.display());
        }
        files.config = Some(c.clone());
    }
    let checkpoint = Checkpoint::from_file(&files.weights)?;
    let config = if args.infer_arch {
        let heads = match args.heads {
            Some(h) => Some(h as usize),
            None => heads_from_config(files.config.as_deref())?,
        };
        let mut cfg = checkpoint.infer_config(heads)?;
        cfg.name = format!(
            "{} (inferred from {})",
            if cfg.distilled {
                "deit-distilled"
            } else {
                "deit"
            },
            files.weights.display()
        );
        cfg
    } else {
        named
    };
    let model = checkpoint
        .load_model(&config, args.dtype.dtype(), &device)
        .map_err(|e| match e {
            ModelError::ShapeMismatch { .. }
            | ModelError::MissingTensor { .. }
            | ModelError::UnexpectedTensor { .. }
            | ModelError::DistilledMismatch { .. }
                if args.weights.is_some() && !args.infer_arch =>
            {
                anyhow::anyhow!(
                    "{e}; for a checkpoint of another architecture pass --infer-arch (and --heads)"
                )
            }
            e => e.into(),
        })
        .with_context(|| format!("cannot load {}", files.weights.display()))?;
    let labels = class_names(config.num_classes, files.config.as_deref())?;
    let preprocess = PreprocessConfig::for_checkpoint(
        files.config.as_deref(),
        files.preprocessor_config.as_deref(),
        config.image_size as u32,
    )?;
    let want = (config.image_size as u32, config.image_size as u32);
    if preprocess.output_size() != Some(want) {
        bail!(
            "the preprocessing config produces {:?} images but the model expects {}x{}",
            preprocess.output_size(),
            want.0,
            want.1
        );
    }
    Ok(LoadedModel {
        model,
        config,
        labels,
        preprocess,
        files,
        device,
    })
}

/// `num_attention_heads` (transformers) or `num_heads` / `model_args.num_heads` (timm).
fn heads_from_config(path: Option<&Path>) -> Result<Option<usize>> {
    let Some(path) = path else { return Ok(None) };
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read config {}", path.display()))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("cannot read config {}: invalid JSON", path.display()))?;
    let get = |v: Option<&serde_json::Value>| v.and_then(|v| v.as_u64()).map(|v| v as usize);
    Ok(get(json.get("num_attention_heads"))
        .or_else(|| get(json.get("num_heads")))
        .or_else(|| get(json.get("model_args").and_then(|m| m.get("num_heads")))))
}

/// Runs a tool's body and turns an error into ONE line on stderr (`error: a: b: c`, the anyhow
/// chain with newlines flattened) and exit code 1, instead of `main` returning `Err` (which
/// prints a Debug dump).
pub fn run_main(body: impl FnOnce() -> Result<()>) -> ExitCode {
    match body() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let msg = format!("{e:#}");
            let msg = msg.split_whitespace().collect::<Vec<_>>().join(" ");
            eprintln!("error: {msg}");
            ExitCode::FAILURE
        }
    }
}
