//! `eval DATASET`: accuracy, throughput and kept tokens of several pruning settings of one model
//! over a labelled image set, in one pass (each batch is decoded once, then every setting runs on
//! it), plus how far each pruned setting's logits are from the dense ones.

bin::fast_allocator!();

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bin::{load_model, run_main, ModelArgs};
use candle_core::{DType, Tensor};
use clap::Parser;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use models::{imagenet1k_index_of_wnid, BlockPruner, ExecutionPath, PreprocessConfig};
use pruners::{PrunerSpec, PruningSchedule};
use serde::Serialize;

/// Evaluate a DeiT model with several token-pruning settings over a labelled image set.
///
/// DATASET is an ImageNet-style folder (one sub-folder per class, named by WordNet id such as
/// n01440764 or by class index) or a CSV/TSV file of `path,label` lines (label: index or WordNet
/// id; relative paths are relative to the file; a header line is allowed). Images are taken in
/// sorted order (class folder, then file name). Unreadable images are reported and skipped.
#[derive(Debug, Parser)]
#[command(name = "eval", version)]
struct Args {
    /// Labelled folder or CSV/TSV file.
    #[arg(value_name = "DATASET")]
    dataset: PathBuf,

    #[command(flatten)]
    model: ModelArgs,

    /// Settings to evaluate, `PRUNER[:PATH]`: PRUNER as in bench (none, threshold-l2,
    /// dynamicvit, evit, ats, optionally -fixed / -adaptive), PATH dense|padded|ragged (default:
    /// dense for none, ragged otherwise). Pruners use the default schedule (blocks depth/4,
    /// depth/2, 3·depth/4; keep 0.7 or the default adaptive rule).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "none,evit:ragged,evit:padded"
    )]
    settings: Vec<String>,

    /// Images per forward pass.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..))]
    batch_size: u32,

    /// Evaluate only the first N images.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    limit: Option<u64>,

    /// Decoding/preprocessing threads (default: available cores).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    workers: Option<u32>,

    /// Write all results as JSON.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,

    /// Write the per-setting results as CSV.
    #[arg(long, value_name = "FILE")]
    csv: Option<PathBuf>,

    /// Write an SVG chart: top-1 accuracy vs mean kept tokens after the last stage.
    #[arg(long, value_name = "FILE.svg")]
    chart: Option<PathBuf>,
}

/// One evaluated setting.
#[derive(Debug, Clone)]
struct Setting {
    name: String,
    spec: PrunerSpec,
    path: ExecutionPath,
}

impl Setting {
    fn pruner(&self) -> String {
        self.spec.kind.map_or("none".into(), |k| k.to_string())
    }

    fn mode(&self) -> String {
        match self.spec.kind {
            Some(_) => self.spec.mode.to_string(),
            None => "none".into(),
        }
    }
}

fn parse_settings(list: &[String]) -> Result<Vec<Setting>> {
    let mut out: Vec<Setting> = Vec::new();
    for raw in list {
        let raw = raw.trim();
        if raw.is_empty() {
            continue;
        }
        // The pruner spec itself may contain ':' (`evit:adaptive`), so a path is only split off
        // when the last part parses as one.
        let (spec_str, path) = match raw.rsplit_once(':') {
            Some((s, p)) if p.parse::<ExecutionPath>().is_ok() => (s, p.parse().ok()),
            _ => (raw, None),
        };
        let spec: PrunerSpec = spec_str
            .parse()
            .with_context(|| format!("setting `{raw}`"))?;
        let path = match (spec.kind, path) {
            (None, p) => p.unwrap_or(ExecutionPath::Dense),
            (Some(_), None) => ExecutionPath::Ragged,
            (Some(_), Some(ExecutionPath::Dense)) => {
                bail!("setting `{raw}`: the dense path does not prune; use padded or ragged")
            }
            (Some(_), Some(p)) => p,
        };
        let base = match spec.kind {
            None if path == ExecutionPath::Dense => "none".to_string(),
            None => format!("none:{path}"),
            Some(k) => format!("{k}-{}:{path}", spec.mode),
        };
        let mut name = base.clone();
        let mut n = 2;
        while out.iter().any(|s| s.name == name) {
            name = format!("{base}#{n}");
            n += 1;
        }
        out.push(Setting { name, spec, path });
    }
    if out.is_empty() {
        bail!("--settings is empty");
    }
    Ok(out)
}

/// Pairs `(a, b)` to compare: every other setting against the first unpruned one (the
/// baseline), and padded against ragged of the same pruner and mode.
fn comparison_pairs(settings: &[Setting]) -> Vec<(usize, usize)> {
    let mut pairs = Vec::new();
    if let Some(base) = settings.iter().position(|s| s.spec.kind.is_none()) {
        for i in 0..settings.len() {
            if i != base {
                pairs.push((base, i));
            }
        }
    }
    for (i, a) in settings.iter().enumerate() {
        for (j, b) in settings.iter().enumerate() {
            if a.spec.kind.is_some()
                && a.spec == b.spec
                && a.path == ExecutionPath::Padded
                && b.path == ExecutionPath::Ragged
                && !pairs.contains(&(i, j))
            {
                pairs.push((i, j));
            }
        }
    }
    pairs
}

/// One labelled image.
#[derive(Debug, Clone)]
struct Sample {
    path: PathBuf,
    label: usize,
}

const IMAGE_EXTENSIONS: [&str; 7] = ["jpg", "jpeg", "png", "webp", "gif", "bmp", "jfif"];

fn is_image_name(p: &Path) -> bool {
    p.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| IMAGE_EXTENSIONS.contains(&e.to_ascii_lowercase().as_str()))
}

/// A class label: a WordNet id or an integer < `num_classes`.
fn parse_label(label: &str, num_classes: usize) -> Option<usize> {
    let label = label.trim();
    let idx = match label.parse::<usize>() {
        Ok(i) => Some(i),
        Err(_) => imagenet1k_index_of_wnid(label),
    };
    idx.filter(|&i| i < num_classes)
}

fn unknown_label(label: &str, num_classes: usize) -> String {
    format!(
        "unknown label `{label}`: neither an ImageNet-1k WordNet id nor a class index below {num_classes}"
    )
}

/// Whether the dataset at `root` is a folder (else a list file); an error naming it when it
/// cannot be read.
fn dataset_is_folder(root: &Path) -> Result<bool> {
    let meta = std::fs::metadata(root)
        .with_context(|| format!("cannot read dataset {}", root.display()))?;
    Ok(meta.is_dir())
}

/// The samples of the dataset at `root`, a folder of class folders (`is_folder`, from
/// [`dataset_is_folder`]) or a list file.
fn load_dataset(root: &Path, is_folder: bool, num_classes: usize) -> Result<Vec<Sample>> {
    if is_folder {
        load_folder(root, num_classes)
    } else {
        load_list(root, num_classes)
    }
}

fn sorted_entries(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut v = std::fs::read_dir(dir)
        .with_context(|| format!("cannot read folder {}", dir.display()))?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<Vec<_>>>()
        .with_context(|| format!("cannot read folder {}", dir.display()))?;
    v.retain(|p| {
        !p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with('.'))
    });
    v.sort();
    Ok(v)
}

fn load_folder(root: &Path, num_classes: usize) -> Result<Vec<Sample>> {
    let classes: Vec<PathBuf> = sorted_entries(root)?
        .into_iter()
        .filter(|p| p.is_dir())
        .collect();
    if classes.is_empty() {
        bail!(
            "dataset folder {} has no class sub-folders (expected one folder per class, named by WordNet id or class index)",
            root.display()
        );
    }
    let mut samples = Vec::new();
    for dir in classes {
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        let Some(label) = parse_label(&name, num_classes) else {
            bail!(
                "class folder {}: {}",
                dir.display(),
                unknown_label(&name, num_classes)
            );
        };
        for p in sorted_entries(&dir)? {
            if p.is_file() && is_image_name(&p) {
                samples.push(Sample { path: p, label });
            }
        }
    }
    if samples.is_empty() {
        bail!(
            "dataset folder {} has no images (extensions: {})",
            root.display(),
            IMAGE_EXTENSIONS.join(", ")
        );
    }
    Ok(samples)
}

fn load_list(file: &Path, num_classes: usize) -> Result<Vec<Sample>> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("cannot read {}", file.display()))?;
    let base = file.parent().unwrap_or(Path::new(""));
    let mut samples = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((path, label)) = line.rsplit_once(['\t', ',']) else {
            bail!(
                "{} line {}: expected `path,label` or `path<TAB>label`",
                file.display(),
                i + 1
            );
        };
        let (path, label) = (path.trim(), label.trim());
        let Some(label_idx) = parse_label(label, num_classes) else {
            if samples.is_empty() && label.eq_ignore_ascii_case("label") {
                continue; // header
            }
            bail!(
                "{} line {}: {}",
                file.display(),
                i + 1,
                unknown_label(label, num_classes)
            );
        };
        let p = Path::new(path);
        samples.push(Sample {
            path: if p.is_absolute() {
                p.to_path_buf()
            } else {
                base.join(p)
            },
            label: label_idx,
        });
    }
    if samples.is_empty() {
        bail!("{} lists no images", file.display());
    }
    Ok(samples)
}

/// A decoded batch from a loader worker.
struct LoadedBatch {
    /// `[n, 3, H, W]` on the CPU; `None` when every image failed.
    pixels: Option<Tensor>,
    labels: Vec<usize>,
    skipped: Vec<Skipped>,
    /// Images decoded and the worker's time spent on them.
    decoded: usize,
    busy: Duration,
}

#[derive(Debug, Clone, Serialize)]
struct Skipped {
    name: String,
    reason: String,
}

fn decode_batch(pre: &PreprocessConfig, samples: &[Sample]) -> Result<LoadedBatch> {
    let t0 = Instant::now();
    let mut images = Vec::with_capacity(samples.len());
    let mut labels = Vec::with_capacity(samples.len());
    let mut skipped = Vec::new();
    for s in samples {
        match pre.load(&s.path) {
            Ok(t) => {
                images.push(t);
                labels.push(s.label);
            }
            Err(e) => skipped.push(Skipped {
                name: s.path.display().to_string(),
                reason: e.to_string(),
            }),
        }
    }
    let pixels = if images.is_empty() {
        None
    } else {
        Some(Tensor::stack(&images, 0)?)
    };
    Ok(LoadedBatch {
        pixels,
        decoded: labels.len(),
        labels,
        skipped,
        busy: t0.elapsed(),
    })
}

#[derive(Debug, Default)]
struct SettingStats {
    top1: usize,
    top5: usize,
    seconds: f64,
    /// Per stage: kept tokens summed over images.
    kept_sum: Vec<f64>,
    initial_tokens: usize,
}

#[derive(Debug, Default)]
struct PairStats {
    max_abs: f64,
    sum_abs: f64,
    count: usize,
    agree: usize,
}

#[derive(Debug, Serialize)]
struct SettingReport {
    name: String,
    pruner: String,
    mode: String,
    path: String,
    top1: f64,
    top5: f64,
    img_s: f64,
    mean_kept_tokens_per_stage: Vec<f64>,
    /// Tokens per image after the last stage (the initial count when nothing is pruned).
    mean_final_tokens: f64,
}

#[derive(Debug, Serialize)]
struct ComparisonReport {
    a: String,
    b: String,
    max_abs_dlogit: f64,
    mean_abs_dlogit: f64,
    top1_agreement: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    model: String,
    weights: String,
    dataset: String,
    device: &'static str,
    dtype: &'static str,
    batch_size: u32,
    workers: usize,
    images: usize,
    skipped: Vec<Skipped>,
    skipped_count: usize,
    loader_img_s: f64,
    settings: Vec<SettingReport>,
    comparisons: Vec<ComparisonReport>,
}

fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if v.total_cmp(&row[best]).is_gt() {
            best = i;
        }
    }
    best
}

/// Whether `label` is among the 5 largest logits (ties broken towards lower indices).
fn in_top5(row: &[f32], label: usize) -> bool {
    let v = row[label];
    let better = row
        .iter()
        .enumerate()
        .filter(|&(i, x)| x.total_cmp(&v).is_gt() || (x.total_cmp(&v).is_eq() && i < label))
        .count();
    better < 5
}

fn main() -> ExitCode {
    let args = Args::parse();
    run_main(|| run(args))
}

fn run(args: Args) -> Result<()> {
    let settings = parse_settings(&args.settings)?;
    // A typo'd dataset path fails before a download or model load (its labels are read after,
    // against the model's class count).
    let is_folder = dataset_is_folder(&args.dataset)?;
    let loaded = load_model(&args.model)?;
    let num_classes = loaded.config.num_classes;
    let mut samples = load_dataset(&args.dataset, is_folder, num_classes)?;
    if let Some(n) = args.limit {
        samples.truncate(n as usize);
    }
    let workers = args.workers.map(|w| w as usize).unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    });
    let pairs = comparison_pairs(&settings);
    let device = loaded.device.clone();
    let model = &loaded.model;
    let pruners: Vec<Vec<BlockPruner>> = settings
        .iter()
        .map(|s| {
            let schedule = match s.spec.kind {
                None => PruningSchedule::none(),
                Some(kind) => PruningSchedule::default_for(kind, s.spec.mode, loaded.config.depth),
            };
            model.build_pruners(&schedule, None)
        })
        .collect::<Result<_, _>>()?;

    let mut stats: Vec<SettingStats> = settings.iter().map(|_| SettingStats::default()).collect();
    let mut pair_stats: Vec<PairStats> = pairs.iter().map(|_| PairStats::default()).collect();
    let mut skipped: Vec<Skipped> = Vec::new();
    let mut images = 0usize;
    let mut worker_rate = 0.0f64;

    let pb =
        ProgressBar::with_draw_target(Some(samples.len() as u64), ProgressDrawTarget::stderr());
    pb.set_style(
        ProgressStyle::with_template(
            "{bar:30} {pos}/{len} images, {per_sec} ({elapsed} < {eta}) {msg}",
        )
        .expect("valid progress template"),
    );

    let chunks: Vec<&[Sample]> = samples.chunks(args.batch_size as usize).collect();
    let next = AtomicUsize::new(0);
    let preprocess = &loaded.preprocess;
    let result = std::thread::scope(|scope| -> Result<()> {
        let (tx, rx) = mpsc::sync_channel::<Result<LoadedBatch>>(4);
        let mut handles = Vec::new();
        for _ in 0..workers.min(chunks.len()).max(1) {
            let tx = tx.clone();
            let (chunks, next) = (&chunks, &next);
            handles.push(scope.spawn(move || -> (usize, Duration) {
                let (mut n, mut busy) = (0, Duration::ZERO);
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(chunk) = chunks.get(i) else { break };
                    let batch = decode_batch(preprocess, chunk);
                    if let Ok(b) = &batch {
                        n += b.decoded;
                        busy += b.busy;
                    }
                    if tx.send(batch).is_err() {
                        break;
                    }
                }
                (n, busy)
            }));
        }
        drop(tx);
        let consumed = (|| -> Result<()> {
            let mut warmed = false;
            for batch in rx.iter() {
                let batch = batch?;
                for s in &batch.skipped {
                    pb.suspend(|| eprintln!("warning: skipped {}: {}", s.name, s.reason));
                }
                pb.inc(batch.skipped.len() as u64);
                skipped.extend(batch.skipped);
                let Some(pixels) = batch.pixels else { continue };
                let pixels = pixels.to_device(&device)?;
                let n = batch.labels.len();
                if !warmed {
                    // First calls load kernels and set up cuBLAS: keep that out of every img/s.
                    for (setting, pr) in settings.iter().zip(&pruners) {
                        model
                            .forward_pruned(&pixels, pr, setting.path)
                            .with_context(|| format!("setting {}", setting.name))?;
                    }
                    warmed = true;
                }
                let mut logits_all: Vec<Vec<Vec<f32>>> = Vec::with_capacity(settings.len());
                for ((setting, pr), st) in settings.iter().zip(&pruners).zip(stats.iter_mut()) {
                    device.synchronize()?;
                    let t0 = Instant::now();
                    let out = model
                        .forward_pruned(&pixels, pr, setting.path)
                        .with_context(|| format!("setting {}", setting.name))?;
                    let logits = out.logits.to_dtype(DType::F32)?;
                    device.synchronize()?;
                    st.seconds += t0.elapsed().as_secs_f64();
                    let logits = logits.to_vec2::<f32>()?;
                    st.initial_tokens = out.initial_tokens;
                    if st.kept_sum.len() < out.stages.len() {
                        st.kept_sum.resize(out.stages.len(), 0.0);
                    }
                    for (k, stage) in out.stages.iter().enumerate() {
                        st.kept_sum[k] += stage.kept_tokens.iter().sum::<usize>() as f64;
                    }
                    for (row, &label) in logits.iter().zip(&batch.labels) {
                        st.top1 += usize::from(argmax(row) == label);
                        st.top5 += usize::from(in_top5(row, label));
                    }
                    logits_all.push(logits);
                }
                for (&(a, b), ps) in pairs.iter().zip(pair_stats.iter_mut()) {
                    for (ra, rb) in logits_all[a].iter().zip(&logits_all[b]) {
                        for (x, y) in ra.iter().zip(rb) {
                            let d = (*x as f64 - *y as f64).abs();
                            ps.max_abs = ps.max_abs.max(d);
                            ps.sum_abs += d;
                            ps.count += 1;
                        }
                        ps.agree += usize::from(argmax(ra) == argmax(rb));
                    }
                }
                images += n;
                pb.inc(n as u64);
                pb.set_message(format!(
                    "top-1 {} {:.2}%",
                    settings[0].name,
                    100.0 * stats[0].top1 as f64 / images as f64
                ));
            }
            Ok(())
        })();
        drop(rx);
        for h in handles {
            let (n, busy) = h
                .join()
                .map_err(|_| anyhow::anyhow!("a loader thread panicked"))?;
            if busy > Duration::ZERO {
                worker_rate += n as f64 / busy.as_secs_f64();
            }
        }
        consumed
    });
    pb.finish_and_clear();
    result?;
    if images == 0 {
        bail!(
            "no image of {} could be decoded ({} skipped)",
            args.dataset.display(),
            skipped.len()
        );
    }

    let pct = |c: usize| 100.0 * c as f64 / images as f64;
    let report = Report {
        model: loaded.config.name.clone(),
        weights: loaded.files.weights.display().to_string(),
        dataset: args.dataset.display().to_string(),
        device: args.model.device.name(),
        dtype: args.model.dtype.name(),
        batch_size: args.batch_size,
        workers,
        images,
        skipped_count: skipped.len(),
        skipped,
        loader_img_s: worker_rate,
        settings: settings
            .iter()
            .zip(&stats)
            .map(|(s, st)| {
                let per_stage: Vec<f64> = st.kept_sum.iter().map(|k| k / images as f64).collect();
                SettingReport {
                    name: s.name.clone(),
                    pruner: s.pruner(),
                    mode: s.mode(),
                    path: s.path.to_string(),
                    top1: pct(st.top1),
                    top5: pct(st.top5),
                    img_s: if st.seconds > 0.0 {
                        images as f64 / st.seconds
                    } else {
                        0.0
                    },
                    mean_final_tokens: per_stage
                        .last()
                        .copied()
                        .unwrap_or(st.initial_tokens as f64),
                    mean_kept_tokens_per_stage: per_stage,
                }
            })
            .collect(),
        comparisons: pairs
            .iter()
            .zip(&pair_stats)
            .map(|(&(a, b), ps)| ComparisonReport {
                a: settings[a].name.clone(),
                b: settings[b].name.clone(),
                max_abs_dlogit: ps.max_abs,
                mean_abs_dlogit: ps.sum_abs / ps.count.max(1) as f64,
                top1_agreement: pct(ps.agree),
            })
            .collect(),
    };
    print_text(&report);
    if let Some(p) = &args.json {
        std::fs::write(p, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("cannot write {}", p.display()))?;
    }
    if let Some(p) = &args.csv {
        std::fs::write(p, csv(&report)).with_context(|| format!("cannot write {}", p.display()))?;
    }
    if let Some(p) = &args.chart {
        chart(&report, p).with_context(|| format!("cannot write chart {}", p.display()))?;
    }
    Ok(())
}

fn print_text(r: &Report) {
    println!(
        "{} on {} ({}, {}): {} images, {} skipped; loader {:.1} img/s",
        r.model, r.dataset, r.device, r.dtype, r.images, r.skipped_count, r.loader_img_s
    );
    println!(
        "{:<28} {:>8} {:>8} {:>10}  kept tokens per stage",
        "setting", "top-1 %", "top-5 %", "img/s"
    );
    for s in &r.settings {
        let kept: Vec<String> = s
            .mean_kept_tokens_per_stage
            .iter()
            .map(|k| format!("{k:.1}"))
            .collect();
        println!(
            "{:<28} {:>8.2} {:>8.2} {:>10.1}  {}",
            s.name,
            s.top1,
            s.top5,
            s.img_s,
            if kept.is_empty() {
                "-".into()
            } else {
                kept.join(" ")
            }
        );
    }
    if !r.comparisons.is_empty() {
        println!(
            "{:<28} {:<28} {:>13} {:>13} {:>13}",
            "a", "b", "max |dlogit|", "mean |dlogit|", "top-1 agree %"
        );
        for c in &r.comparisons {
            println!(
                "{:<28} {:<28} {:>13.4e} {:>13.4e} {:>13.2}",
                c.a, c.b, c.max_abs_dlogit, c.mean_abs_dlogit, c.top1_agreement
            );
        }
    }
}

/// One row per setting; the per-stage kept tokens are `;`-separated in one column.
fn csv(r: &Report) -> String {
    let mut out = String::from(
        "model,device,dtype,images,skipped,loader_img_s,name,pruner,mode,path,top1,top5,img_s,mean_final_tokens,mean_kept_tokens_per_stage\n",
    );
    for s in &r.settings {
        let kept: Vec<String> = s
            .mean_kept_tokens_per_stage
            .iter()
            .map(|k| format!("{k:.3}"))
            .collect();
        out.push_str(&format!(
            "\"{}\",{},{},{},{},{:.3},{},{},{},{},{:.4},{:.4},{:.3},{:.3},{}\n",
            r.model.replace('"', "\"\""),
            r.device,
            r.dtype,
            r.images,
            r.skipped_count,
            r.loader_img_s,
            s.name,
            s.pruner,
            s.mode,
            s.path,
            s.top1,
            s.top5,
            s.img_s,
            s.mean_final_tokens,
            kept.join(";")
        ));
    }
    out
}

/// Top-1 vs mean final kept tokens, one series per pruner (and mode), one marker per setting.
fn chart(r: &Report, path: &Path) -> Result<()> {
    use plotters::prelude::*;

    let mut groups: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    for s in &r.settings {
        let key = if s.pruner == "none" {
            "none".to_string()
        } else {
            format!("{}-{}", s.pruner, s.mode)
        };
        let i = *index.entry(key.clone()).or_insert_with(|| {
            groups.push((key, Vec::new()));
            groups.len() - 1
        });
        groups[i].1.push((s.mean_final_tokens, s.top1));
    }
    let xs = r.settings.iter().map(|s| s.mean_final_tokens);
    let (xmin, xmax) = xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| {
        (a.min(x), b.max(x))
    });
    let pad = ((xmax - xmin) * 0.1).max(1.0);
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        let root = SVGBackend::new(path, (800, 560)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut ch = ChartBuilder::on(&root)
            .caption(
                format!("{}: top-1 vs kept tokens", r.model),
                ("sans-serif", 20),
            )
            .margin(16)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d((xmin - pad)..(xmax + pad), 0f64..100f64)?;
        ch.configure_mesh()
            .x_desc("mean tokens per image after the last pruning stage")
            .y_desc("top-1 accuracy (%)")
            .label_style(("sans-serif", 14))
            .axis_desc_style(("sans-serif", 16))
            .draw()?;
        for (i, (name, pts)) in groups.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let mut pts = pts.clone();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            ch.draw_series(LineSeries::new(pts.clone(), color.stroke_width(1)))?;
            ch.draw_series(
                pts.iter()
                    .map(|&(x, y)| Circle::new((x, y), 5, color.filled())),
            )?
            .label(name.as_str())
            .legend(move |(x, y)| Circle::new((x, y), 5, color.filled()));
        }
        ch.configure_series_labels()
            .label_font(("sans-serif", 14))
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::LowerRight)
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| anyhow::anyhow!("{e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_parse() {
        let s = parse_settings(&[
            "none".into(),
            "evit".into(),
            "evit:padded".into(),
            "threshold-l2-adaptive:ragged".into(),
            "evit:adaptive".into(),
            "none".into(),
        ])
        .unwrap();
        let names: Vec<&str> = s.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "none",
                "evit-fixed:ragged",
                "evit-fixed:padded",
                "threshold-l2-adaptive:ragged",
                "evit-adaptive:ragged",
                "none#2"
            ]
        );
        assert!(parse_settings(&["evit:dense".into()]).is_err());
        assert!(parse_settings(&["nope".into()]).is_err());
        let pairs = comparison_pairs(&s);
        assert!(pairs.contains(&(0, 5)));
        assert!(pairs.contains(&(2, 1)));
        assert_eq!(pairs.len(), 6);
    }

    #[test]
    fn labels_and_top5() {
        assert_eq!(parse_label("n01440764", 1000), Some(0));
        assert_eq!(parse_label("7", 10), Some(7));
        assert_eq!(parse_label("10", 10), None);
        assert_eq!(parse_label("cats", 10), None);
        let row = [0.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.5];
        assert!(in_top5(&row, 5));
        assert!(!in_top5(&row, 6));
        assert_eq!(argmax(&row), 1);
    }
}
