//! `bench`: end-to-end throughput of DeiT with token pruning, per execution path.
//!
//! For every model × dtype × batch size: the dense model, then every pruner × {fixed, adaptive}
//! (the default schedules: blocks 3/6/9, keep 0.7 / the default adaptive rule) on the padded and
//! the ragged path. Random weights (a random checkpoint built in memory; DynamicViT's predictors
//! randomly initialised) and random images of varied contrast, so adaptive pruners keep different
//! counts per image. Warm-up runs are excluded; each row is the median of `--reps` runs, timed
//! from a synchronised device to a synchronised device. Writes JSON to `--out` after every row.

bin::fast_allocator!();

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result};
use bin::{run_main, DTypeArg, DeviceArg};
use candle_core::Module;
use candle_core::{DType, Device, Tensor};
use candle_fastpath::{CapturedForward, PeakMemory};
use clap::Parser;
use models::{
    expected_tensors, Checkpoint, DeiT, DeiTConfig, ExecutionPath, Reads, StagedGraph, WeightNaming,
};
use pruners::{Mode, PrunerSpec, PruningSchedule};
use serde::Serialize;

/// End-to-end DeiT throughput: dense vs token-pruned (padded / ragged).
#[derive(Debug, Parser)]
#[command(name = "bench", version)]
struct Args {
    /// Models (deit-tiny, deit-small, deit-base, and -distilled variants).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "deit-tiny,deit-small,deit-base"
    )]
    models: Vec<String>,

    /// Batch sizes.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64")]
    batch: Vec<usize>,

    /// Compute dtypes.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "f16,bf16,f32"
    )]
    dtype: Vec<DTypeArg>,

    /// Pruners: none (the dense baseline), threshold-l2, dynamicvit, evit, ats; a bare name runs
    /// both modes, `evit-fixed` / `evit-adaptive` one.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "none,threshold-l2,dynamicvit,evit,ats"
    )]
    pruners: Vec<String>,

    /// Execution paths for the pruned rows (dense rows come from `none`).
    #[arg(long, value_delimiter = ',', default_value = "padded,ragged")]
    paths: Vec<String>,

    /// Timed runs per row (the median is reported).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..))]
    reps: u32,

    /// Untimed warm-up runs per row.
    #[arg(long, default_value_t = 3)]
    warmup: u32,

    #[arg(long, value_enum, default_value_t = DeviceArg::Cuda)]
    device: DeviceArg,

    /// Also time forwards captured once as a CUDA graph and replayed (extra rows with
    /// `"cuda_graph": true`: dense, and device-decided ragged for every pruner; CUDA only).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    cuda_graph: bool,

    /// Keep freed device memory cached across synchronisations (the tools' default); `false`
    /// restores the driver's release-at-every-sync, for A/B runs.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    retain_freed_memory: bool,

    /// Give every device buffer cudarc's two stream-ordering events (candle's default). Off by
    /// default here: candle runs a device's work on one stream, where they order nothing, and
    /// the first CUDA-graph capture turns them off for the rest of the process anyway, so rows
    /// before and after it would otherwise run differently.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    event_tracking: bool,

    /// Seed of the random weights and images: the same seed gives the same model and inputs on
    /// every run and machine (DynamicViT's adaptive rule, with its random predictor, keeps very
    /// different counts for different weights, so its rows compare across runs only this way).
    #[arg(long, default_value_t = 0)]
    seed: u64,

    /// For every captured CUDA graph, also print (stderr) its nodes by type and its replays'
    /// host time to return, host wall clock to a synchronised device and CUDA-event time
    /// (medians of `--reps`): where a replay's time goes besides its kernels.
    #[arg(long, default_value_t = false)]
    graph_anatomy: bool,

    /// Dtype of the input images: `model` (each row's compute dtype, as timm's half-precision
    /// models take them and scripts/peers/timm_deit.py feeds them; the default since lever 114)
    /// or `f32` (what a preprocessing pipeline hands over; the rows before lever 114).
    #[arg(long, value_enum, default_value_t = PixelsArg::Model)]
    pixels: PixelsArg,

    /// Output JSON file.
    #[arg(long, default_value = "docs/benchmarks/h100-e2e.json")]
    out: PathBuf,
}

/// `--pixels`: the input images' dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
enum PixelsArg {
    Model,
    F32,
}

#[derive(Debug, Serialize)]
struct Row {
    model: String,
    pruner: String,
    mode: String,
    path: String,
    batch: usize,
    dtype: String,
    img_s: f64,
    latency_ms: f64,
    /// Mean tokens per image after the last pruning step (prefix and fused token included).
    mean_kept_tokens: f64,
    /// Whether the forward was replayed from a captured CUDA graph.
    cuda_graph: bool,
    /// Where pruning decisions were made: "host" (scores read back and decided on the CPU, per
    /// step), "device" (a kernel decides: no host sync for fixed-ratio pruners, one read of
    /// the new lengths per step otherwise; as a CUDA graph, no read at all), "two-stage" (a
    /// kernel decides; two CUDA graphs with one read of the first step's total between them,
    /// `models::StagedGraph` with `Reads::First`) or "staged" (the same with a read after every
    /// step, `Reads::EveryStep`).
    decisions: String,
    /// Most device memory in use at once during the timed runs (weights and inputs included);
    /// null on the CPU.
    peak_mem_mb: Option<f64>,
}

#[derive(Debug, Serialize)]
struct Report {
    gpu: String,
    command: String,
    /// `--event-tracking`: whether device buffers carried cudarc's per-buffer events.
    event_tracking: bool,
    /// `--seed` of the random weights and images.
    seed: u64,
    /// `--pixels`: the input images' dtype (`model` or `f32`).
    pixels: PixelsArg,
    rows: Vec<Row>,
}

/// One benchmark variant: which pruner (None: dense) in which mode on which path.
#[derive(Debug, Clone, Copy)]
struct Variant {
    spec: PrunerSpec,
    path: ExecutionPath,
}

fn variants(pruners: &[String], paths: &[String]) -> Result<Vec<Variant>> {
    let paths: Vec<ExecutionPath> = paths
        .iter()
        .map(|p| p.parse().map_err(anyhow::Error::msg))
        .collect::<Result<_>>()?;
    let mut out = Vec::new();
    for name in pruners {
        let spec: PrunerSpec = name.parse()?;
        if spec.kind.is_none() {
            out.push(Variant {
                spec,
                path: ExecutionPath::Dense,
            });
            continue;
        }
        let explicit_mode = name.to_ascii_lowercase().ends_with("fixed")
            || name.to_ascii_lowercase().ends_with("adaptive");
        let modes = if explicit_mode {
            vec![spec.mode]
        } else {
            vec![Mode::Fixed, Mode::Adaptive]
        };
        for mode in modes {
            for &path in paths.iter().filter(|p| **p != ExecutionPath::Dense) {
                out.push(Variant {
                    spec: PrunerSpec { mode, ..spec },
                    path,
                });
            }
        }
    }
    Ok(out)
}

/// A random timm-named checkpoint for `cfg` (LayerNorms at identity, Linear weights
/// ~N(0, 1/fan_in)), so that activations and attention stay well scaled through the blocks.
fn random_model(cfg: &DeiTConfig, dtype: DType, seed: u64, device: &Device) -> Result<DeiT> {
    let mut tensors = HashMap::new();
    for (name, shape) in expected_tensors(cfg, WeightNaming::Timm) {
        let is_norm = name.contains("norm") && !name.contains("patch_embed");
        let t = if is_norm && name.ends_with(".weight") {
            Tensor::ones(shape.as_slice(), DType::F32, &Device::Cpu)?
        } else if name.ends_with(".bias") {
            Tensor::zeros(shape.as_slice(), DType::F32, &Device::Cpu)?
        } else {
            let fan_in: usize = shape[1..].iter().product::<usize>().max(1);
            let std = if name.ends_with("_token") || name == "pos_embed" {
                0.5
            } else {
                (1.0 / fan_in as f64).sqrt()
            };
            let n = shape.iter().product();
            let values = seeded_normal(n, std as f32, seed ^ fnv1a(name.as_bytes()));
            Tensor::from_vec(values, shape.as_slice(), &Device::Cpu)?
        };
        tensors.insert(name, t);
    }
    Ok(Checkpoint::from_tensors(tensors)?.load_model(cfg, dtype, device)?)
}

/// `[b, 3, S, S]` random images whose contrast grows across the batch.
fn random_pixels(b: usize, cfg: &DeiTConfig, seed: u64, device: &Device) -> Result<Tensor> {
    let s = cfg.image_size;
    let values = seeded_normal(b * 3 * s * s, 1.0, seed ^ fnv1a(b"pixels") ^ b as u64);
    let x = Tensor::from_vec(values, (b, 3, s, s), &Device::Cpu)?;
    let contrast: Vec<f32> = (0..b)
        .map(|i| 0.2 + 1.8 * i as f32 / b.max(2) as f32)
        .collect();
    let contrast = Tensor::from_vec(contrast, (b, 1, 1, 1), &Device::Cpu)?;
    Ok(x.broadcast_mul(&contrast)?.to_device(device)?)
}

/// `n` values of N(0, std²), the same for the same seed on every run and machine: splitmix64
/// for uniform bits, Box–Muller for the normal pairs.
fn seeded_normal(n: usize, std: f32, seed: u64) -> Vec<f32> {
    let mut state = seed;
    let mut next_unit = || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        // 53 random bits in (0, 1]: never 0, so the logarithm below is finite.
        ((z >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    };
    let mut out = Vec::with_capacity(n + 1);
    while out.len() < n {
        let (u1, u2) = (next_unit(), next_unit());
        let r = (-2.0 * u1.ln()).sqrt() * std as f64;
        let theta = std::f64::consts::TAU * u2;
        out.push((r * theta.cos()) as f32);
        out.push((r * theta.sin()) as f32);
    }
    out.truncate(n);
    out
}

/// FNV-1a of a tensor name: a per-tensor seed offset.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xCBF2_9CE4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3)
    })
}

fn device_name(arg: DeviceArg) -> String {
    match arg {
        DeviceArg::Cpu => "cpu".into(),
        DeviceArg::Cuda => std::process::Command::new("nvidia-smi")
            .args(["--query-gpu=name", "--format=csv,noheader", "--id=0"])
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "cuda:0".into()),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// Median seconds per call of `run` over `reps` timed calls (each from a synchronised device to a
/// synchronised device) after `warmup` untimed ones; also the last call's value (mean kept
/// tokens) and the peak device memory of the timed calls.
fn time(
    device: &Device,
    warmup: u32,
    reps: u32,
    run: impl Fn() -> Result<f64>,
) -> Result<(f64, f64, Option<f64>)> {
    for _ in 0..warmup {
        run()?;
    }
    device.synchronize()?;
    let peak = PeakMemory::start(device)?;
    let mut times = Vec::with_capacity(reps as usize);
    let mut kept = 0.0;
    for _ in 0..reps {
        let t0 = Instant::now();
        kept = run()?;
        device.synchronize()?;
        times.push(t0.elapsed().as_secs_f64());
    }
    Ok((median(times), kept, peak.peak_mb()?))
}

/// `--graph-anatomy`: one line on `graph` and its replays (see the flag).
#[cfg(feature = "cuda")]
fn graph_anatomy(
    device: &Device,
    graph: &CapturedForward,
    pixels: &Tensor,
    reps: u32,
    label: &str,
) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
    let Device::Cuda(cuda) = device else {
        return Ok(());
    };
    let nodes = graph.nodes()?;
    let stream = cuda.cuda_stream();
    let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let (mut launch, mut wall, mut gpu) = (Vec::new(), Vec::new(), Vec::new());
    device.synchronize()?;
    for _ in 0..reps {
        let t0 = Instant::now();
        let e0 = stream.record_event(timing)?;
        graph.replay(pixels)?;
        let e1 = stream.record_event(timing)?;
        let t1 = Instant::now();
        device.synchronize()?;
        let t2 = Instant::now();
        launch.push((t1 - t0).as_secs_f64() * 1e6);
        wall.push((t2 - t0).as_secs_f64() * 1e6);
        gpu.push(e0.elapsed_ms(&e1)? as f64 * 1e3);
    }
    eprintln!(
        "graph {label}: {nodes}; replay: host {:.1} us to return, {:.1} us wall to a synchronised device, {:.1} us between events (medians of {reps})",
        median(launch),
        median(wall),
        median(gpu)
    );
    Ok(())
}

/// Without CUDA no graph can be captured, so there is nothing to look at.
#[cfg(not(feature = "cuda"))]
fn graph_anatomy(
    _device: &Device,
    graph: &CapturedForward,
    _pixels: &Tensor,
    _reps: u32,
    _label: &str,
) -> Result<()> {
    graph.nodes()?;
    Ok(())
}

/// `--graph-anatomy` for the dense forward's three parts, each captured alone: the embedding
/// (pixels → tokens), the blocks (tokens → tokens) and the head (final norm of the prefix tokens
/// → logits); each graph also copies its output once.
fn dense_parts_anatomy(
    device: &Device,
    model: &DeiT,
    pixels: &Tensor,
    reps: u32,
    label: &str,
) -> Result<()> {
    let embed = CapturedForward::capture(pixels, |x| model.embed(x))?;
    graph_anatomy(
        device,
        &embed,
        pixels,
        reps,
        &format!("{label}, embedding only"),
    )?;
    let tokens = model.embed(pixels)?;
    let blocks = CapturedForward::capture(&tokens, |x| model.blocks_on_tokens(x))?;
    let label_blocks = format!("{label}, {} blocks only", model.blocks.len());
    graph_anatomy(device, &blocks, &tokens, reps, &label_blocks)?;
    let head = CapturedForward::capture(&tokens, |x| model.logits_from_blocks(x))?;
    graph_anatomy(device, &head, &tokens, reps, &format!("{label}, head only"))?;
    Ok(())
}

fn main() -> ExitCode {
    run_main(|| {
        let args = Args::parse();
        let device = args.device.open()?;
        candle_fastpath::retain_freed_memory(&device, args.retain_freed_memory)?;
        // SAFETY: this process uses the device from candle's one stream only.
        unsafe { candle_fastpath::track_buffer_events(&device, args.event_tracking)? };
        let variants = variants(&args.pruners, &args.paths)?;
        let mut report = Report {
            gpu: device_name(args.device),
            command: std::env::args().collect::<Vec<_>>().join(" "),
            event_tracking: args.event_tracking,
            seed: args.seed,
            pixels: args.pixels,
            rows: Vec::new(),
        };
        if let Some(dir) = args.out.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        for name in &args.models {
            let cfg = DeiTConfig::from_name(name)?;
            for &dtype_arg in &args.dtype {
                let model = random_model(&cfg, dtype_arg.dtype(), args.seed, &device)?;
                for &batch in &args.batch {
                    let pixels = random_pixels(batch, &cfg, args.seed, &device)?;
                    let pixels = match args.pixels {
                        PixelsArg::Model => pixels.to_dtype(dtype_arg.dtype())?,
                        PixelsArg::F32 => pixels,
                    };
                    for v in &variants {
                        let schedule = match v.spec.kind {
                            None => PruningSchedule::none(),
                            Some(kind) => {
                                PruningSchedule::default_for(kind, v.spec.mode, cfg.depth)
                            }
                        };
                        let pruners = model.build_pruners(&schedule, None)?;
                        let run = || -> Result<f64> {
                            Ok(model
                                .forward_pruned(&pixels, &pruners, v.path)?
                                .mean_final_tokens())
                        };
                        let (latency, kept, peak) = time(&device, args.warmup, args.reps, run)?;
                        let mut rows = vec![(latency, kept, peak, false, "host")];
                        let graphable = args.cuda_graph && device.is_cuda();
                        if graphable && v.path == ExecutionPath::Dense {
                            let graph = CapturedForward::capture(&pixels, |x| model.forward(x))?;
                            if args.graph_anatomy {
                                let label = format!("{name} {dtype_arg:?} b{batch} dense");
                                graph_anatomy(&device, &graph, &pixels, args.reps, &label)?;
                                dense_parts_anatomy(&device, &model, &pixels, args.reps, &label)?;
                            }
                            let tokens = cfg.seq_len() as f64;
                            let run = || -> Result<f64> {
                                graph.replay(&pixels)?;
                                Ok(tokens)
                            };
                            let (latency, kept, peak) = time(&device, args.warmup, args.reps, run)?;
                            rows.push((latency, kept, peak, true, "host"));
                        }
                        // The ragged path can also decide on the device: with fixed counts no
                        // host sync, otherwise one read of the new lengths per step (eagerly);
                        // replayed from a CUDA graph with no sync either way.
                        if v.path == ExecutionPath::Ragged {
                            let fixed = pruners
                                .iter()
                                .all(|(_, p)| p.fixed_count(cfg.num_patches()).is_some());
                            let forward = |x: &Tensor| {
                                model
                                    .forward_pruned_on_device(x, &pruners)
                                    .map_err(candle_core::Error::wrap)
                            };
                            let initial = cfg.seq_len();
                            let run = || -> Result<f64> {
                                Ok(forward(&pixels)?.mean_final_tokens(initial))
                            };
                            let (latency, kept, peak) = time(&device, args.warmup, args.reps, run)?;
                            rows.push((latency, kept, peak, false, "device"));
                            if graphable {
                                // Fixed counts: the same call, captured. Counts from the scores:
                                // the capturable forward (lengths kept on the device, packed
                                // tokens at a bounded capacity), captured.
                                let forward = |x: &Tensor| {
                                    if fixed {
                                        Ok(forward(x)?.logits)
                                    } else {
                                        model
                                            .forward_pruned_capturable(x, &pruners)
                                            .map(|f| f.logits)
                                            .map_err(candle_core::Error::wrap)
                                    }
                                };
                                let graph = CapturedForward::capture(&pixels, forward)?;
                                if args.graph_anatomy {
                                    let label = format!(
                                        "{name} {dtype_arg:?} b{batch} {} {} ragged",
                                        v.spec.kind.map_or("none".into(), |k| k.to_string()),
                                        v.spec.mode
                                    );
                                    graph_anatomy(&device, &graph, &pixels, args.reps, &label)?;
                                }
                                let run = || -> Result<f64> {
                                    graph.replay(&pixels)?;
                                    Ok(kept)
                                };
                                let (latency, _, peak) =
                                    time(&device, args.warmup, args.reps, run)?;
                                rows.push((latency, kept, peak, true, "device"));
                            }
                            if graphable && !fixed {
                                // Counts from the scores: CUDA graphs with a read of one
                                // step's total between them, the rest over that many rows.
                                for (reads, name) in
                                    [(Reads::First, "two-stage"), (Reads::EveryStep, "staged")]
                                {
                                    let staged =
                                        StagedGraph::capture(&model, &pixels, &pruners, reads)?;
                                    let run = || -> Result<f64> {
                                        staged.replay(&pixels)?;
                                        Ok(kept)
                                    };
                                    let (latency, _, peak) =
                                        time(&device, args.warmup, args.reps, run)?;
                                    rows.push((latency, kept, peak, true, name));
                                }
                            }
                        }
                        for (latency, kept, peak_mem_mb, cuda_graph, decisions) in rows {
                            let row = Row {
                                model: cfg.name.clone(),
                                pruner: v.spec.kind.map_or("none".into(), |k| k.to_string()),
                                mode: if v.spec.kind.is_some() {
                                    v.spec.mode.to_string()
                                } else {
                                    "none".into()
                                },
                                path: v.path.to_string(),
                                batch,
                                dtype: dtype_arg.name().into(),
                                img_s: batch as f64 / latency,
                                latency_ms: latency * 1e3,
                                mean_kept_tokens: kept,
                                cuda_graph,
                                decisions: decisions.into(),
                                peak_mem_mb,
                            };
                            eprintln!(
                            "{:<12} {:<5} b={:<3} {:<13} {:<8} {:<6}{}{} {:>9.1} img/s {:>9.3} ms  tokens {:.1}  peak {:.0} MiB",
                            row.model, row.dtype, batch, row.pruner, row.mode, row.path,
                            match decisions { "device" => "+dev", "two-stage" => "+2st", "staged" => "+stg", _ => "    " },
                            if cuda_graph { "+graph" } else { "      " },
                            row.img_s, row.latency_ms, kept, peak_mem_mb.unwrap_or(0.0)
                        );
                            report.rows.push(row);
                        }
                        std::fs::write(&args.out, serde_json::to_string_pretty(&report)?)
                            .with_context(|| format!("writing {}", args.out.display()))?;
                    }
                }
            }
        }
        eprintln!("wrote {} rows to {}", report.rows.len(), args.out.display());
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeded_normal_is_reproducible_and_normal() {
        let a = seeded_normal(100_001, 2.0, 7);
        assert_eq!(a.len(), 100_001);
        assert_eq!(a, seeded_normal(100_001, 2.0, 7), "same seed, same values");
        assert_ne!(
            a[..100],
            seeded_normal(100, 2.0, 8)[..],
            "another seed, other values"
        );
        let n = a.len() as f64;
        let mean = a.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = a.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        assert!(mean.abs() < 0.03, "mean {mean}");
        assert!((var.sqrt() - 2.0).abs() < 0.03, "std {}", var.sqrt());
        assert!(a.iter().all(|x| x.is_finite()));
    }
}
