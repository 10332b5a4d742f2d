//! `classify IMAGE...`: top-k ImageNet classes per image with a DeiT model.

bin::fast_allocator!();

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use bin::{load_model, run_main, ModelArgs};
use candle_core::{DType, D};
use clap::Parser;
use image::{Rgb, RgbImage};
use models::{DeiTConfig, ExecutionPath, PreprocessConfig, PruneStage};
use pruners::{PrunerSpec, PruningSchedule};
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

    /// Token pruning: none, threshold-l2, dynamicvit, evit, ats, optionally followed by -fixed
    /// or -adaptive (e.g. evit-adaptive); the default schedule (blocks depth/4, depth/2,
    /// 3·depth/4, keep 0.7 or the default adaptive rule).
    #[arg(long, default_value = "none", value_parser = parse_spec)]
    pruner: PrunerSpec,

    /// Execution path: dense, padded or ragged (default: ragged with a pruner, else dense).
    #[arg(long, value_parser = parse_path)]
    path: Option<ExecutionPath>,

    /// Draw the preprocessed input and, per pruning stage, the patches dropped so far shaded:
    /// one 224-wide panel per stage side by side (panel 0 = the input). Needs a --pruner; with
    /// several images, the image index is appended to the file name (OUT-0.png, OUT-1.png, ...).
    #[arg(long, value_name = "OUT.png")]
    show_pruning: Option<PathBuf>,

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
    /// Per pruning stage: original patches still kept (prefix and fused tokens not counted);
    /// empty without a pruner.
    kept_patches: Vec<usize>,
}

#[derive(Debug, Serialize)]
struct Report {
    model: String,
    weights: String,
    source: Option<&'static str>,
    device: &'static str,
    dtype: &'static str,
    pruner: String,
    path: &'static str,
    images: Vec<ImageResult>,
}

fn parse_spec(s: &str) -> Result<PrunerSpec, String> {
    s.parse().map_err(|e: pruners::PruneError| e.to_string())
}

fn parse_path(s: &str) -> Result<ExecutionPath, String> {
    s.parse()
}

fn main() -> ExitCode {
    let args = Args::parse();
    run_main(|| run(args))
}

fn run(args: Args) -> Result<()> {
    // Cheap checks first, so a typo'd path or a file that is no image fails before a download
    // or model load: each file's header (not its pixels) read here.
    for p in &args.images {
        match std::fs::metadata(p) {
            Ok(m) if m.is_file() => {}
            Ok(_) => bail!("cannot read image {}: not a regular file", p.display()),
            Err(e) => bail!("cannot read image {}: {e}", p.display()),
        }
        models::check_image_file(p, models::preprocess::DEFAULT_MAX_PIXELS)?;
    }
    let path = match (args.pruner.kind, args.path) {
        (None, p) => p.unwrap_or(ExecutionPath::Dense),
        (Some(_), None) => ExecutionPath::Ragged,
        (Some(_), Some(ExecutionPath::Dense)) => {
            bail!("--path dense does not prune; use padded or ragged with --pruner")
        }
        (Some(_), Some(p)) => p,
    };
    if args.show_pruning.is_some() && args.pruner.kind.is_none() {
        bail!("--show-pruning needs a --pruner other than none");
    }
    let loaded = load_model(&args.model)?;
    let schedule = match args.pruner.kind {
        None => PruningSchedule::none(),
        Some(kind) => PruningSchedule::default_for(kind, args.pruner.mode, loaded.config.depth),
    };
    let pruners = loaded.model.build_pruners(&schedule, None)?;
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
        pruner: match args.pruner.kind {
            None => "none".into(),
            Some(k) => format!("{k}-{}", args.pruner.mode),
        },
        path: path.name(),
        images: Vec::new(),
    };
    for (c, chunk) in args.images.chunks(args.batch_size as usize).enumerate() {
        let pixels = loaded
            .preprocess
            .load_batch(chunk)?
            .to_device(&loaded.device)?;
        let out = loaded.model.forward_pruned(&pixels, &pruners, path)?;
        if let Some(file) = &args.show_pruning {
            for (j, image) in chunk.iter().enumerate() {
                let i = c * args.batch_size as usize + j;
                let target = if args.images.len() == 1 {
                    file.clone()
                } else {
                    indexed_name(file, i)
                };
                let drawing =
                    draw_pruning(&loaded.preprocess, &loaded.config, image, &out.stages, j)?;
                drawing
                    .save_with_format(&target, image::ImageFormat::Png)
                    .with_context(|| format!("cannot write {}", target.display()))?;
            }
        }
        let logits = out.logits.to_dtype(DType::F32)?;
        let probs = candle_nn::ops::softmax(&logits, D::Minus1)?.to_vec2::<f32>()?;
        let logits = logits.to_vec2::<f32>()?;
        let prefix = loaded.config.num_prefix_tokens() as u32;
        for (j, ((path, row), logit_row)) in chunk.iter().zip(probs).zip(logits).enumerate() {
            let result = ImageResult {
                path: path.display().to_string(),
                kept_patches: out
                    .stages
                    .iter()
                    .map(|st| {
                        st.original_positions[j]
                            .iter()
                            .filter(|&&p| p >= prefix)
                            .count()
                    })
                    .collect(),
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

/// `out.png` → `out-{i}.png`.
fn indexed_name(file: &std::path::Path, i: usize) -> PathBuf {
    let stem = file
        .file_stem()
        .map(|s| s.to_string_lossy().to_string())
        .unwrap_or_default();
    let name = match file.extension() {
        Some(ext) => format!("{stem}-{i}.{}", ext.to_string_lossy()),
        None => format!("{stem}-{i}"),
    };
    file.with_file_name(name)
}

/// Shading of a dropped patch: 30 % of the pixel plus 70 % of a dark violet.
fn shade(p: Rgb<u8>) -> Rgb<u8> {
    const TINT: [f32; 3] = [40.0, 0.0, 60.0];
    Rgb(std::array::from_fn(|c| {
        (0.3 * p.0[c] as f32 + 0.7 * TINT[c]).round() as u8
    }))
}

/// Panel 0: the preprocessed (resized, centre-cropped, un-normalised) input of image `b` of the
/// batch; panel `k`: the same with the patches not surviving stage `k` shaded.
fn draw_pruning(
    pre: &PreprocessConfig,
    cfg: &DeiTConfig,
    path: &std::path::Path,
    stages: &[PruneStage],
    b: usize,
) -> Result<RgbImage> {
    let img = pre.decode_file(path)?;
    let (values, w, h) = pre.transform(&img);
    let plane = (w * h) as usize;
    let input = RgbImage::from_fn(w, h, |x, y| {
        let i = (y * w + x) as usize;
        Rgb(std::array::from_fn(|c| {
            let v = values[c * plane + i] * pre.std[c] + pre.mean[c];
            (v * 255.0).round().clamp(0.0, 255.0) as u8
        }))
    });
    let mut out = RgbImage::new(w * (stages.len() as u32 + 1), h);
    image::imageops::replace(&mut out, &input, 0, 0);
    let (grid, patch) = (cfg.grid_size(), cfg.patch_size as u32);
    let prefix = cfg.num_prefix_tokens() as u32;
    for (k, stage) in stages.iter().enumerate() {
        let mut kept = vec![false; grid * grid];
        for &pos in &stage.original_positions[b] {
            if pos >= prefix {
                kept[(pos - prefix) as usize] = true;
            }
        }
        let mut panel = input.clone();
        for (p, _) in kept.iter().enumerate().filter(|(_, k)| !**k) {
            let (px, py) = ((p % grid) as u32 * patch, (p / grid) as u32 * patch);
            for y in py..(py + patch).min(h) {
                for x in px..(px + patch).min(w) {
                    let v = shade(*panel.get_pixel(x, y));
                    panel.put_pixel(x, y, v);
                }
            }
        }
        image::imageops::replace(&mut out, &panel, (w as i64) * (k as i64 + 1), 0);
    }
    Ok(out)
}
