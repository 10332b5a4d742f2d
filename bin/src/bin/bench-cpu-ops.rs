//! bench-cpu-ops: the CPU time of each operation of a DeiT block, one at a time, on the
//! model's shapes (random weights; f32 unless `--dtype`): where a CPU forward's time goes, op by op, and with
//! `scripts/peers/torch_cpu_ops.py` (the same operations in PyTorch, the same output lines) how
//! each compares with PyTorch's on the same machine.
//!
//! Each operation runs `--reps` times after three untimed calls; the median wall time is
//! reported with its GFLOP/s and the page faults one call takes (`/proc/self/stat`, Linux). Each
//! runs inside candle's CPU pool, as the model's forward does. The `block(2 ln)` line adds the
//! two LayerNorms, qkv, the attention, proj + residual, fc1 + GELU and fc2 + residual; the
//! `block` operation is the model's own block (`models::Block`, on the packed tokens, as the
//! ragged forward calls it): what the forward pays a block, sections and copies between the
//! operations included (DeiT-T at batch 1 on a 16-core host: ~0.76 ms against a sum of ~0.62).
//! Thread count: `RAYON_NUM_THREADS`, as for the model.

bin::fast_allocator!();

use std::collections::HashMap;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Result};
use bin::{run_main, DTypeArg};
use candle_core::{DType, Device, Tensor};
use candle_fastpath::{Epilogue, FusedLinear, LayerNorm};
use candle_nn::VarBuilder;
use candle_ragged::{ragged_attention, RaggedBatch};
use clap::Parser;
use models::{expected_tensors, AttentionInputs, Block, DeiTConfig, WeightNaming};

#[derive(Parser, Debug)]
#[command(about = "CPU time of each operation of a DeiT block on the model's shapes")]
struct Args {
    /// Models by name: deit-tiny, deit-small, deit-base (-distilled: the same shapes).
    #[arg(long, value_delimiter = ',', default_value = "deit-tiny,deit-small")]
    models: Vec<String>,
    /// Images a call (197 tokens each).
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    batch: Vec<usize>,
    /// Timed calls per operation (the median is reported).
    #[arg(long, default_value_t = 30)]
    reps: usize,
    /// Only these operations (ln, qkv, attn, proj+res, fc1+gelu, fc1, fc2+res, block); all if
    /// empty.
    #[arg(long, value_delimiter = ',')]
    ops: Vec<String>,
    /// Dtype of the weights and activations (f32, f16, bf16).
    #[arg(long, value_enum, default_value = "f32")]
    dtype: DTypeArg,
    /// First the AMX tile product alone (`candle_ragged::amx`, operands resident in L1, on one
    /// thread and on every core): the ceiling the bf16 products could reach on this host. An
    /// error where the CPU or kernel gives no AMX tiles.
    #[arg(long)]
    amx_ceiling: bool,
}

/// GFLOP/s of the AMX tile product alone on `threads` threads: each repeats one 32 × 32 block
/// over `k` terms (two 16-row tiles × two panels, [`candle_ragged::amx::Tiles::block`]) on its
/// own operands, small enough to stay in L1.
fn amx_ceiling(k: usize, threads: usize) -> Result<f64> {
    use candle_ragged::amx::{self, Tiles};
    use half::bf16;
    if !amx::usable() {
        bail!("--amx-ceiling: this CPU (or its kernel) gives no AMX tiles");
    }
    const CALLS: usize = 20_000;
    let kp = amx::padded_depth(k);
    let start = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                let a = vec![bf16::from_f32(0.5); 32 * kp];
                let b = vec![bf16::from_f32(0.25); 2 * kp * 16];
                let mut c = vec![0f32; 32 * 32];
                // SAFETY: AMX is usable (checked above); `a` holds 32 rows of `kp` terms, `b`
                // two panel blocks of `kp` terms, `c` 32 rows of 32 values.
                unsafe {
                    let tiles = Tiles::configure();
                    for _ in 0..CALLS {
                        tiles.block(
                            a.as_ptr(),
                            kp * 2,
                            true,
                            b.as_ptr(),
                            b.as_ptr().add(kp * 16),
                            kp / amx::STEP,
                            c.as_mut_ptr(),
                            32 * 4,
                        );
                    }
                }
                std::hint::black_box(&c);
            });
        }
    });
    let secs = start.elapsed().as_secs_f64();
    Ok(2.0 * (32 * 32 * kp * CALLS * threads) as f64 / secs / 1e9)
}

/// The operations, in the order they run and print.
const OPS: [&str; 8] = [
    "ln", "qkv", "attn", "proj+res", "fc1+gelu", "fc1", "fc2+res", "block",
];

/// Tokens an image: 196 patches and the class token.
const TOKENS: usize = 197;

/// Minor page faults of this process so far (0 where `/proc/self/stat` cannot be read).
fn minor_faults() -> u64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0;
    };
    // Field 10 (minflt), counted after the command name's closing parenthesis.
    stat.rfind(')')
        .and_then(|at| stat[at + 2..].split(' ').nth(7))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// One operation's figures: median µs a call and the page faults of one call.
struct Timing {
    us: f64,
    faults: u64,
}

fn time(reps: usize, mut call: impl FnMut() -> Result<()>) -> Result<Timing> {
    for _ in 0..3 {
        call()?;
    }
    let before = minor_faults();
    call()?;
    let faults = minor_faults() - before;
    let mut us = Vec::with_capacity(reps);
    for _ in 0..reps {
        let start = Instant::now();
        call()?;
        us.push(start.elapsed().as_secs_f64() * 1e6);
    }
    us.sort_by(f64::total_cmp);
    Ok(Timing {
        us: us[reps / 2],
        faults,
    })
}

/// A `[out, in]` layer with bias, N(0, 0.02) weights, in `dtype`.
fn layer(inputs: usize, outputs: usize, dtype: DType, dev: &Device) -> Result<FusedLinear> {
    let w = Tensor::randn(0f32, 0.02, (outputs, inputs), dev)?.to_dtype(dtype)?;
    let b = Tensor::randn(0f32, 0.02, outputs, dev)?.to_dtype(dtype)?;
    Ok(FusedLinear::new(w, Some(b))?)
}

/// Block 0 of a `cfg` model with random weights (N(0, 0.02), LayerNorms at identity),
/// timm-named, in `dtype`.
fn random_block(cfg: &DeiTConfig, dtype: DType, dev: &Device) -> Result<Block> {
    let mut tensors = HashMap::new();
    for (name, shape) in expected_tensors(cfg, WeightNaming::Timm) {
        let Some(local) = name.strip_prefix("blocks.0.") else {
            continue;
        };
        let t = if local.starts_with("norm") && local.ends_with(".weight") {
            Tensor::ones(shape.as_slice(), DType::F32, dev)?
        } else if local.starts_with("norm") {
            Tensor::zeros(shape.as_slice(), DType::F32, dev)?
        } else {
            Tensor::randn(0f32, 0.02, shape.as_slice(), dev)?
        };
        tensors.insert(local.to_string(), t.to_dtype(dtype)?);
    }
    let vb = VarBuilder::from_tensors(tensors, dtype, dev);
    Ok(Block::new(cfg, vb)?)
}

fn run(args: Args) -> Result<()> {
    if args.reps == 0 {
        bail!("--reps must be at least 1");
    }
    if let Some(op) = args.ops.iter().find(|o| !OPS.contains(&o.as_str())) {
        bail!("unknown operation {op:?} (one of {})", OPS.join(", "));
    }
    if args.amx_ceiling {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        for k in [64, 384, 1536] {
            for threads in [1, cores] {
                let gflops = amx_ceiling(k, threads)?;
                println!("amx-ceiling k {k:4} threads {threads:2} {gflops:9.1} GFLOPS");
            }
        }
    }
    let dev = Device::Cpu;
    let dtype = args.dtype.dtype();
    let wanted = |op: &str| args.ops.is_empty() || args.ops.iter().any(|o| o == op);
    if let Some(&b) = args.batch.iter().find(|&&b| b == 0) {
        bail!("--batch values must be at least 1 (got {b})");
    }
    for model in &args.models {
        // Width, heads and head dim from the model's config; the weights once a model.
        let cfg = DeiTConfig::from_name(model)?;
        let (c, heads, head_dim) = (cfg.dim, cfg.heads, cfg.head_dim());
        let (qkv, proj) = (layer(c, 3 * c, dtype, &dev)?, layer(c, c, dtype, &dev)?);
        let (fc1, fc2) = (layer(c, 4 * c, dtype, &dev)?, layer(4 * c, c, dtype, &dev)?);
        let norm = LayerNorm::new(
            Tensor::ones(c, dtype, &dev)?,
            Tensor::zeros(c, dtype, &dev)?,
            1e-6,
        )?;
        let block = random_block(&cfg, dtype, &dev)?;
        for &b in &args.batch {
            let rows = b * TOKENS;
            let x = Tensor::randn(0f32, 1.0, (rows, c), &dev)?.to_dtype(dtype)?;
            let hidden = Tensor::randn(0f32, 1.0, (rows, 4 * c), &dev)?.to_dtype(dtype)?;
            let batch = RaggedBatch::from_lengths(&vec![TOKENS; b], &dev)?;
            // q, k and v as the model reads them: strided views of the fused projection.
            let fused = qkv
                .forward_with(&x, Epilogue::Plain)?
                .reshape((rows, 3, heads, head_dim))?;
            let part = |i| fused.narrow(1, i, 1).and_then(|t| t.squeeze(1));
            let (q, k, v) = (part(0)?, part(1)?, part(2)?);
            let scale = (head_dim as f32).powf(-0.5);
            let linear_flops = |i: usize, o: usize| 2.0 * (rows * i * o) as f64;
            let attention_flops = 4.0 * (b * heads * TOKENS * TOKENS * head_dim) as f64;
            type Call<'a> = Box<dyn FnMut() -> Result<()> + Send + 'a>;
            // The names from OPS, so the list checked against --ops is the list that runs.
            let [ln, qkv_op, attn, proj_res, fc1_gelu, fc1_op, fc2_res, block_op] = OPS;
            let inputs = AttentionInputs::Ragged { batch: &batch };
            let block_flops = linear_flops(c, 3 * c)
                + attention_flops
                + linear_flops(c, c)
                + linear_flops(c, 4 * c)
                + linear_flops(4 * c, c);
            let ops: Vec<(&str, f64, Call)> = vec![
                (
                    ln,
                    0.0,
                    Box::new(|| {
                        norm.forward_checked(&x)?;
                        Ok(())
                    }),
                ),
                (
                    qkv_op,
                    linear_flops(c, 3 * c),
                    Box::new(|| {
                        qkv.forward_with(&x, Epilogue::Plain)?;
                        Ok(())
                    }),
                ),
                (
                    attn,
                    attention_flops,
                    Box::new(|| {
                        ragged_attention(&q, &k, &v, &batch, scale)?;
                        Ok(())
                    }),
                ),
                (
                    proj_res,
                    linear_flops(c, c),
                    Box::new(|| {
                        proj.forward_with(&x, Epilogue::Residual(&x))?;
                        Ok(())
                    }),
                ),
                (
                    fc1_gelu,
                    linear_flops(c, 4 * c),
                    Box::new(|| {
                        fc1.forward_with(&x, Epilogue::Gelu)?;
                        Ok(())
                    }),
                ),
                (
                    fc1_op,
                    linear_flops(c, 4 * c),
                    Box::new(|| {
                        fc1.forward_with(&x, Epilogue::Plain)?;
                        Ok(())
                    }),
                ),
                (
                    fc2_res,
                    linear_flops(4 * c, c),
                    Box::new(|| {
                        fc2.forward_with(&hidden, Epilogue::Residual(&x))?;
                        Ok(())
                    }),
                ),
                (
                    block_op,
                    block_flops,
                    Box::new(|| {
                        block.forward_with(&x, &inputs)?;
                        Ok(())
                    }),
                ),
            ];
            let mut sum = 0.0;
            for (name, flops, mut call) in ops {
                if !wanted(name) {
                    continue;
                }
                let t = dev.with_context(|| time(args.reps, &mut call))?;
                sum += match name {
                    "ln" => 2.0 * t.us,
                    "fc1" | "block" => 0.0,
                    _ => t.us,
                };
                println!(
                    "{model} {} b{b} {name:10} {:9.1} us  {:7.1} GFLOPS  {} faults/call",
                    args.dtype.name(),
                    t.us,
                    flops / t.us / 1e3,
                    t.faults
                );
            }
            if args.ops.is_empty() {
                println!(
                    "{model} {} b{b} block(2 ln) {sum:.1} us; x12 = {:.2} ms",
                    args.dtype.name(),
                    sum * 12.0 / 1e3
                );
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    run_main(|| run(args))
}
