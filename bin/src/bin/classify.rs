//! `classify IMAGE...`: top-k ImageNet classes per image with a DeiT model.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Result};
use bin::{load_model, run_main, ModelArgs, PrunerArg};
use candle_core::{DType, Module, D};
use clap::Parser;
use serde::Serialize;

/// Classify images with a DeiT vision transformer.
///
/// By default the weights come from the Hugging Face Hub (timm/deit_small_patch16_224.fb_in1k),
/// cached on disk after the first download. With --weights FILE no network is used; the
/// architecture is --model's, or inferred from the checkpoint with --infer-arch (useful for
/// custom-sized checkpoints).
#[derive(Debug, Parser)]
#[command(name = "classify", version)]
struct Args {
    /// Image files (JPEG, PNG, WebP, GIF, BMP; the format is detected from the content).
    #[arg(required = true, value_name = "IMAGE")]
    images: Vec<PathBuf>,

    #[command(flatten)]
    model: ModelArgs,

    /// Token pruning strategy.
    #[arg(long, value_enum, default_value_t = PrunerArg::None)]
    pruner: PrunerArg,

    /// Number of classes to print per image.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    top_k: u32,

    /// Images per forward pass.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    batch_size: u32,

    /// Print one JSON document (model, device, dtype, and per image its top-k
    /// {index, label, prob}) instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Prediction {
    index: usize,
    label: String,
    prob: f32,
    /// The raw logit, so that runs on different devices, dtypes or paths can be compared exactly.
    logit: f32,
}

#[derive(Debug, Serialize)]
struct ImageResult {
    path: String,
    top_k: Vec<Prediction>,
}

#[derive(Debug, Serialize)]
struct Report {
    model: String,
    weights: String,
    source: Option<&'static str>,
    device: &'static str,
    dtype: &'static str,
    pruner: &'static str,
    images: Vec<ImageResult>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    run_main(|| run(args))
}

fn run(args: Args) -> Result<()> {
    // Cheap checks first, so a typo'd path fails before a download or model load.
    for p in &args.images {
        match std::fs::metadata(p) {
            Ok(m) if m.is_file() => {}
            Ok(_) => bail!("cannot read image {}: not a regular file", p.display()),
            Err(e) => bail!("cannot read image {}: {e}", p.display()),
        }
    }
    let loaded = load_model(&args.model)?;
    let k = (args.top_k as usize).min(loaded.config.num_classes);
    let mut report = Report {
        model: loaded.config.name.clone(),
        weights: loaded.files.weights.display().to_string(),
        source: args
            .model
            .weights
            .is_none()
            .then(|| args.model.source.name()),
        device: args.model.device.name(),
        dtype: args.model.dtype.name(),
        pruner: args.pruner.name(),
        images: Vec::new(),
    };
    for chunk in args.images.chunks(args.batch_size as usize) {
        let pixels = loaded
            .preprocess
            .load_batch(chunk)?
            .to_device(&loaded.device)?;
        let logits = loaded.model.forward(&pixels)?.to_dtype(DType::F32)?;
        let probs = candle_nn::ops::softmax(&logits, D::Minus1)?.to_vec2::<f32>()?;
        let logits = logits.to_vec2::<f32>()?;
        for ((path, row), logit_row) in chunk.iter().zip(probs).zip(logits) {
            let result = ImageResult {
                path: path.display().to_string(),
                top_k: top_k(&row, k)
                    .into_iter()
                    .map(|i| Prediction {
                        index: i,
                        label: loaded.labels[i].clone(),
                        prob: row[i],
                        logit: logit_row[i],
                    })
                    .collect(),
            };
            if !args.json {
                print_text(&result);
            }
            report.images.push(result);
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(())
}

/// Indices of the `k` largest values, largest first (ties: lower index first).
fn top_k(row: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

fn print_text(r: &ImageResult) {
    println!("{}", r.path);
    for p in &r.top_k {
        println!(
            "  {:>7.3}%  {} (class {})",
            p.prob * 100.0,
            p.label,
            p.index
        );
    }
}
