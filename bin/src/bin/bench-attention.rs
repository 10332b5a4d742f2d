//! bench-attention: ragged attention against candle's own padded attention, with a trivial candle
//! op as the dispatch yardstick of the same run.
//!
//! For every (heads, batch, keep, dtype) it measures, per method:
//! * host µs per call: `--host-calls` calls in a loop without synchronising, divided;
//! * GPU µs per call: CUDA events around each call, median of `--gpu-reps`; the GPU is first kept
//!   busy by large matmuls so that a chunk of calls is already queued when it gets to them, and the
//!   events then time the kernels, not the host's launch gaps;
//! * the HBM floor: bytes that must move (read q, k, v once, write o once) / `--hbm-tbps`.
//!
//! Rows go to a JSON file (`--out`), a table to stdout.

bin::fast_allocator!();

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, IndexOp, Tensor};
use candle_ragged::{pack, ragged_attention, unpack, RaggedBatch};
use clap::Parser;
use serde::Serialize;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "Benchmark ragged attention against candle's padded attention (run it on a GPU)")]
struct Args {
    /// Where to write the JSON rows.
    #[arg(long, default_value = "docs/benchmarks/h100-attention.json")]
    out: PathBuf,
    /// `cuda` (the point of this benchmark) or `cpu` (wall-clock only, for a smoke test).
    #[arg(long, default_value = "cuda")]
    device: String,
    #[arg(long, value_delimiter = ',', default_value = "3,6,12")]
    heads: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "1,8,64,256")]
    batch: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "1.0,0.7,0.5,0.3")]
    keep: Vec<f64>,
    #[arg(long, value_delimiter = ',', default_value = "f16,bf16")]
    dtype: Vec<String>,
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    /// Calls in the host-time loop.
    #[arg(long, default_value_t = 2000)]
    host_calls: usize,
    /// Event-timed calls per method (the median is reported).
    #[arg(long, default_value_t = 200)]
    gpu_reps: usize,
    /// Memory bandwidth used for the floor, in TB/s (copy bandwidth measured on the H100: ~3.0).
    #[arg(long, default_value_t = 3.0)]
    hbm_tbps: f64,
    #[arg(long, default_value_t = 0x5eed)]
    seed: u64,
    /// Give every device buffer cudarc's two stream-ordering events (candle's default, and this
    /// benchmark's, so its history stays comparable). `false` measures the dispatch a
    /// single-stream program gets after `candle_fastpath::track_buffer_events(dev, false)`: no
    /// event wait and record per operand, no events created per output allocation.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    event_tracking: bool,
    /// Where q, k and v live: `fused` (views of one `[total, 3, heads, head_dim]` tensor, what a
    /// fused qkv projection gives: a (sequence, head)'s rows are 128-byte pieces 3 · heads ·
    /// head_dim elements apart) or `head-major` (views of `[3, heads, total, head_dim]`: each
    /// (sequence, head)'s rows contiguous). Same values either way.
    #[arg(long, default_value = "fused")]
    qkv_layout: QkvLayout,
    /// Text recorded as the command in the JSON (defaults to this process's arguments).
    #[arg(long)]
    command: Option<String>,
}

#[derive(Serialize)]
struct Row {
    method: String,
    heads: usize,
    batch: usize,
    keep: f64,
    dtype: String,
    total_tokens: usize,
    max_len: usize,
    host_us: f64,
    gpu_us: f64,
    floor_us: f64,
    /// host_us of this row over host_us of the same run's candle_affine.
    host_vs_affine: f64,
    /// max |ragged - padded| over the real tokens (0 for the affine rows).
    max_abs_diff_vs_padded: f64,
}

#[derive(Serialize)]
struct Report {
    gpu: String,
    command: String,
    /// `--event-tracking`.
    event_tracking: bool,
    /// `--qkv-layout`.
    qkv_layout: QkvLayout,
    hbm_tbps: f64,
    host_calls: usize,
    gpu_reps: usize,
    candle_affine: Row,
    rows: Vec<Row>,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
enum QkvLayout {
    Fused,
    HeadMajor,
}

/// splitmix64: reproducible lengths without pulling in an RNG crate.
struct Lengths(u64);
impl Lengths {
    fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
    /// 196·keep patch tokens spread ±15 % per image, plus the class token; within [2, 197].
    fn draw(&mut self, batch: usize, keep: f64) -> Vec<usize> {
        (0..batch)
            .map(|_| {
                let spread = 1.0 + 0.3 * (self.next_f64() - 0.5);
                ((196.0 * keep * spread).round() as usize).clamp(1, 196) + 1
            })
            .collect()
    }
}

struct Timer {
    dev: Device,
    busy: Option<(Tensor, f64)>,
}

impl Timer {
    fn new(dev: &Device) -> Result<Self> {
        let mut t = Timer {
            dev: dev.clone(),
            busy: None,
        };
        if dev.is_cuda() {
            let m = Tensor::randn(0f32, 1.0, (4096, 4096), dev)?.to_dtype(DType::F16)?;
            for _ in 0..3 {
                m.matmul(&m)?;
            }
            let us = t.event_times(5, 0.0, &mut || m.matmul(&m))?;
            t.busy = Some((m, median(us)));
        }
        Ok(t)
    }

    /// Host time per call of `f`, unsynchronised loop.
    fn host_us(
        &self,
        calls: usize,
        f: &mut dyn FnMut() -> candle_core::Result<Tensor>,
    ) -> Result<f64> {
        for _ in 0..20 {
            f()?;
        }
        self.dev.synchronize()?;
        let start = Instant::now();
        for _ in 0..calls {
            f()?;
        }
        let el = start.elapsed();
        self.dev.synchronize()?;
        Ok(el.as_secs_f64() * 1e6 / calls as f64)
    }

    /// GPU time per call: event pairs around each call; on the CPU, wall-clock with a sync.
    fn gpu_us(
        &self,
        reps: usize,
        host_us: f64,
        f: &mut dyn FnMut() -> candle_core::Result<Tensor>,
    ) -> Result<f64> {
        if !self.dev.is_cuda() {
            let mut times = Vec::with_capacity(reps);
            for _ in 0..reps {
                let s = Instant::now();
                f()?;
                self.dev.synchronize()?;
                times.push(s.elapsed().as_secs_f64() * 1e6);
            }
            return Ok(median(times));
        }
        Ok(median(self.event_times(reps, host_us, f)?))
    }

    #[cfg(feature = "cuda")]
    fn event_times(
        &self,
        reps: usize,
        host_us: f64,
        f: &mut dyn FnMut() -> candle_core::Result<Tensor>,
    ) -> Result<Vec<f64>> {
        use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
        let stream = self.dev.as_cuda_device()?.cuda_stream();
        const CHUNK: usize = 25;
        let mut times = Vec::with_capacity(reps);
        while times.len() < reps {
            // Queue a chunk behind enough GPU work that the host's launch gaps disappear.
            if let Some((m, busy_us)) = &self.busy {
                let need = (host_us * 2.0 + 20.0) * CHUNK as f64;
                for _ in 0..(need / busy_us).ceil() as usize {
                    m.matmul(m)?;
                }
            }
            let mut pending = Vec::with_capacity(CHUNK);
            for _ in 0..CHUNK.min(reps - times.len()) {
                let a = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
                let out = f()?;
                let b = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
                pending.push((a, b, out));
            }
            stream.synchronize()?;
            for (a, b, _) in pending {
                times.push(a.elapsed_ms(&b)? as f64 * 1e3);
            }
        }
        Ok(times)
    }

    #[cfg(not(feature = "cuda"))]
    fn event_times(
        &self,
        _: usize,
        _: f64,
        _: &mut dyn FnMut() -> candle_core::Result<Tensor>,
    ) -> Result<Vec<f64>> {
        bail!("GPU timing needs a build with --features cuda")
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn parse_dtype(s: &str) -> Result<DType> {
    Ok(match s {
        "f16" => DType::F16,
        "bf16" => DType::BF16,
        "f32" => DType::F32,
        _ => bail!("unknown dtype {s:?} (f16, bf16, f32)"),
    })
}

/// candle's padded attention over the same packed qkv: pad (one unpack kernel), per-head matmul,
/// key-padding mask, softmax, matmul, back to `[batch, len, heads, dim]`.
fn padded_attention(
    qkv: &Tensor,
    batch: &RaggedBatch,
    mask: &Tensor,
    heads: usize,
    dim: usize,
    scale: f64,
) -> candle_core::Result<Tensor> {
    let (b, l) = (batch.batch_size(), batch.max_len());
    let x = unpack(qkv, batch, l)
        .map_err(candle_core::Error::from)?
        .reshape((b, l, 3, heads, dim))?;
    let q = x.i((.., .., 0))?.transpose(1, 2)?.contiguous()?;
    let k = x.i((.., .., 1))?.transpose(1, 2)?.contiguous()?;
    let v = x.i((.., .., 2))?.transpose(1, 2)?.contiguous()?;
    let s = (q.matmul(&k.t()?)? * scale)?.broadcast_add(mask)?;
    let p = candle_nn::ops::softmax_last_dim(&s)?;
    p.matmul(&v)?.transpose(1, 2)?.contiguous()
}

fn main() {
    if let Err(e) = run(Args::parse()) {
        eprintln!("bench-attention: {e:#}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<()> {
    let dev = match args.device.as_str() {
        "cpu" => Device::Cpu,
        "cuda" => Device::new_cuda(0)
            .context("--device cuda: no usable CUDA device (or a build without --features cuda)")?,
        other => bail!("unknown device {other:?} (cpu, cuda)"),
    };
    // SAFETY: this process uses the device from candle's one stream only.
    unsafe { candle_fastpath::track_buffer_events(&dev, args.event_tracking)? };
    let command = args
        .command
        .clone()
        .unwrap_or_else(|| std::env::args().collect::<Vec<_>>().join(" "));
    let gpu = gpu_name(&dev);
    let timer = Timer::new(&dev)?;
    let mut lengths_rng = Lengths(args.seed);

    // The dispatch yardstick: affine on 1024 floats.
    let small = Tensor::randn(0f32, 1.0, 1024, &dev)?;
    let affine_host = timer.host_us(args.host_calls, &mut || small.affine(1.5, 0.5))?;
    let affine_gpu = timer.gpu_us(args.gpu_reps, affine_host, &mut || small.affine(1.5, 0.5))?;
    let affine = Row {
        method: "candle_affine".into(),
        heads: 0,
        batch: 0,
        keep: 0.0,
        dtype: "f32".into(),
        total_tokens: 1024,
        max_len: 0,
        host_us: affine_host,
        gpu_us: affine_gpu,
        floor_us: 2.0 * 1024.0 * 4.0 / (args.hbm_tbps * 1e6),
        host_vs_affine: 1.0,
        max_abs_diff_vs_padded: 0.0,
    };
    println!(
        "candle_affine: host {affine_host:.2} us, gpu {affine_gpu:.2} us (event tracking {})",
        if args.event_tracking { "on" } else { "off" }
    );
    println!(
        "{:>6} {:>5} {:>5} {:>5} {:>6} {:>7} | {:>9} {:>8} {:>7} | {:>9} {:>8} | {:>7} {:>9} {:>9}",
        "dtype",
        "heads",
        "batch",
        "keep",
        "total",
        "floor",
        "rag host",
        "rag gpu",
        "h/aff",
        "pad host",
        "pad gpu",
        "gpu x",
        "gpu/floor",
        "max diff"
    );

    let mut rows = Vec::new();
    for dtype_name in &args.dtype {
        let dtype = parse_dtype(dtype_name)?;
        for &heads in &args.heads {
            for &b in &args.batch {
                for &keep in &args.keep {
                    let lengths = lengths_rng.draw(b, keep);
                    let batch = RaggedBatch::from_lengths(&lengths, &dev)?;
                    let total = batch.total_tokens();
                    let d = args.head_dim;
                    let scale = 1.0 / (d as f64).sqrt();
                    let qkv =
                        Tensor::randn(0f32, 1.0, (total, 3 * heads * d), &dev)?.to_dtype(dtype)?;
                    let qkv4 = qkv.reshape((total, 3, heads, d))?;
                    let (q, k, v) = match args.qkv_layout {
                        QkvLayout::Fused => (qkv4.i((.., 0))?, qkv4.i((.., 1))?, qkv4.i((.., 2))?),
                        QkvLayout::HeadMajor => {
                            // [3, heads, total, d] contiguous, viewed back as [total, heads, d].
                            let hm = qkv4.permute((1, 2, 0, 3))?.contiguous()?;
                            let view = |j: usize| hm.i(j).and_then(|t| t.transpose(0, 1));
                            (view(0)?, view(1)?, view(2)?)
                        }
                    };
                    let mask: Vec<f32> = lengths
                        .iter()
                        .flat_map(|&len| {
                            (0..batch.max_len())
                                .map(move |j| if j < len { 0.0 } else { f32::NEG_INFINITY })
                        })
                        .collect();
                    let mask = Tensor::from_vec(mask, (b, 1, 1, batch.max_len()), &dev)?
                        .to_dtype(dtype)?;

                    let mut ragged = || {
                        ragged_attention(&q, &k, &v, &batch, scale as f32)
                            .map_err(candle_core::Error::from)
                    };
                    let mut padded = || padded_attention(&qkv, &batch, &mask, heads, d, scale);

                    // Agreement of the two methods on the real tokens.
                    let r = ragged()?;
                    let p = padded()?.reshape((b, batch.max_len(), heads * d))?;
                    let p_real = pack(&p, &batch)?; // drop the padding queries' rows
                    let diff = (r.reshape((total, heads * d))?.to_dtype(DType::F32)?
                        - p_real.to_dtype(DType::F32)?)?
                    .abs()?
                    .flatten_all()?
                    .max(0)?
                    .to_scalar::<f32>()? as f64;

                    let rag_host = timer.host_us(args.host_calls, &mut ragged)?;
                    let rag_gpu = timer.gpu_us(args.gpu_reps, rag_host, &mut ragged)?;
                    let pad_host = timer.host_us(args.host_calls, &mut padded)?;
                    let pad_gpu = timer.gpu_us(args.gpu_reps, pad_host, &mut padded)?;
                    let bytes = 4.0 * (total * heads * d * dtype.size_in_bytes()) as f64;
                    let floor = bytes / (args.hbm_tbps * 1e6);
                    println!(
                        "{:>6} {:>5} {:>5} {:>5.2} {:>6} {:>7.2} | {:>9.2} {:>8.2} {:>7.2} | {:>9.2} {:>8.2} | {:>7.2} {:>9.2} {:>9.2e}",
                        dtype_name,
                        heads,
                        b,
                        keep,
                        total,
                        floor,
                        rag_host,
                        rag_gpu,
                        rag_host / affine_host,
                        pad_host,
                        pad_gpu,
                        pad_gpu / rag_gpu,
                        rag_gpu / floor,
                        diff
                    );
                    for (method, host, gpu_us, diff) in [
                        ("ragged", rag_host, rag_gpu, diff),
                        ("padded", pad_host, pad_gpu, diff),
                    ] {
                        rows.push(Row {
                            method: method.into(),
                            heads,
                            batch: b,
                            keep,
                            dtype: dtype_name.clone(),
                            total_tokens: total,
                            max_len: batch.max_len(),
                            host_us: host,
                            gpu_us,
                            floor_us: floor,
                            host_vs_affine: host / affine_host,
                            max_abs_diff_vs_padded: diff,
                        });
                    }
                }
            }
        }
    }
    let report = Report {
        gpu,
        command,
        event_tracking: args.event_tracking,
        qkv_layout: args.qkv_layout,
        hbm_tbps: args.hbm_tbps,
        host_calls: args.host_calls,
        gpu_reps: args.gpu_reps,
        candle_affine: affine,
        rows,
    };
    if let Some(dir) = args.out.parent() {
        std::fs::create_dir_all(dir).ok();
    }
    std::fs::write(&args.out, serde_json::to_string_pretty(&report)?)
        .with_context(|| format!("writing {}", args.out.display()))?;
    println!("wrote {}", args.out.display());
    Ok(())
}

fn gpu_name(dev: &Device) -> String {
    if !dev.is_cuda() {
        return "cpu".into();
    }
    std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=name", "--format=csv,noheader"])
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.lines().next().unwrap_or("").trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown CUDA GPU".into())
}
