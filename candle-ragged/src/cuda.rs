//! CUDA launches. The PTX is compiled by build.rs; its functions are loaded once per device and
//! kept, so a call does no module or function lookup: it checks sizes it already has on the host,
//! allocates the output and launches one kernel (two for a scatter that needs zeroing first).

use crate::batch::RaggedBatch;
use crate::error::RaggedError;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    sys, CudaFunction, CudaSlice, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorageSlice, DeviceId, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Result, Shape, Storage};
use std::sync::{Arc, Mutex};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/ragged_attention.ptx"));
const MODULE: &str = "candle_ragged";

/// The warpgroup-MMA attention kernels (kernels/ragged_attention_sm90.cu, compute_90a), when
/// build.rs compiled them (CUDA_COMPUTE_CAP >= 90).
#[cfg(ragged_wgmma)]
const PTX_SM90: Option<&str> = Some(include_str!(concat!(
    env!("OUT_DIR"),
    "/ragged_attention_sm90.ptx"
)));
#[cfg(not(ragged_wgmma))]
const PTX_SM90: Option<&str> = None;
const MODULE_SM90: &str = "candle_ragged_sm90";
/// By [dtype - 1]; head_dim 64 only, one warpgroup per block.
const WGMMA_NAMES: [&str; 2] = ["ragged_attn_wg1_f16_d64", "ragged_attn_wg1_bf16_d64"];
/// Longest sequence of the wgmma kernel (WG_MAX_LEN there).
const WGMMA_MAX_LEN: usize = 256;

/// The resident kernel (whole K / V of a (sequence, head) in shared memory, no barrier in the key
/// loop) for f16 / bf16 and head_dim 32 / 64, by [dtype - 1][head_dim index].
const RESIDENT_NAMES: [[&str; 2]; 2] = [
    [
        "ragged_attn_resident_f16_d32",
        "ragged_attn_resident_f16_d64",
    ],
    [
        "ragged_attn_resident_bf16_d32",
        "ragged_attn_resident_bf16_d64",
    ],
];
use crate::resident_plan::{
    resident_opt_in_bytes, resident_plan, GpuLimits, PlanKnobs, KEY_PARTS, RESIDENT_MAX_LEN,
};

const ATTN_NAMES: [[&str; 3]; 3] = [
    [
        "ragged_attn_f32_d32",
        "ragged_attn_f32_d64",
        "ragged_attn_f32_d128",
    ],
    [
        "ragged_attn_f16_d32",
        "ragged_attn_f16_d64",
        "ragged_attn_f16_d128",
    ],
    [
        "ragged_attn_bf16_d32",
        "ragged_attn_bf16_d64",
        "ragged_attn_bf16_d128",
    ],
];
/// Copy kernels by vector width in bytes: 16, 8, 4, 2.
const PACK_NAMES: [&str; 4] = [
    "ragged_pack_v16",
    "ragged_pack_v8",
    "ragged_pack_v4",
    "ragged_pack_v2",
];
const UNPACK_NAMES: [&str; 4] = [
    "ragged_unpack_v16",
    "ragged_unpack_v8",
    "ragged_unpack_v4",
    "ragged_unpack_v2",
];
const VEC_BYTES: [usize; 4] = [16, 8, 4, 2];

const SELECT_NAMES: [&str; 3] = [
    "ragged_select_top_k_f32",
    "ragged_select_top_k_f16",
    "ragged_select_top_k_bf16",
];
const DECIDE_NAMES: [&str; 3] = [
    "ragged_select_decide_f32",
    "ragged_select_decide_f16",
    "ragged_select_decide_bf16",
];
const GATHER_NAMES: [&str; 3] = [
    "ragged_select_gather_f32",
    "ragged_select_gather_f16",
    "ragged_select_gather_bf16",
];
const CLS_PROBS_NAMES: [&str; 3] = [
    "ragged_cls_probs_f32",
    "ragged_cls_probs_f16",
    "ragged_cls_probs_bf16",
];
const MEAN_NAMES: [&str; 3] = [
    "ragged_sequence_mean_f32",
    "ragged_sequence_mean_f16",
    "ragged_sequence_mean_bf16",
];
/// Floats of score-computation scratch a decide block may get beyond 4 per token (the logits of
/// a group of heads); with MAX_SEQ_LEN tokens the block then needs DECIDE_MAX_SMEM bytes.
const DECIDE_LOGIT_FLOATS: usize = 16384;
const DECIDE_MAX_SMEM: usize = 4 * DECIDE_LOGIT_FLOATS + 16 * crate::MAX_SEQ_LEN;
// The decide kernels are opted into DECIDE_MAX_SMEM on every device: it must fit the smallest
// per-block opt-in of the GPUs the kernels build for (99 KB on compute capability 8.6 / 8.9 /
// 12.x), or loading them would fail there.
const _: () = assert!(DECIDE_MAX_SMEM <= 99 * 1024);

struct Kernels {
    attn: Vec<Vec<CudaFunction>>,
    /// The resident kernels, [96-register, 80-register, paired, paired with Q in shared memory]
    /// (levers 35, 135 and 136), indexed by `ResidentKernel`, each
    /// [dtype - 1][head_dim index].
    resident: [Vec<Vec<CudaFunction>>; 4],
    /// The device's SMs and shared memory, for the resident plan (which splits a (sequence,
    /// head) over several blocks when the batch alone would not fill the SMs, counts the blocks
    /// an SM holds and keeps within what a block may opt into) and the selection kernels.
    gpu: GpuLimits,
    /// `CANDLE_RAGGED_ATTENTION=tiled` turns the resident kernel off (for A/B measurements).
    resident_enabled: bool,
    /// The wgmma kernel (lever 46; at parity with the resident one, so an A/B arm), by
    /// [dtype - 1], on compute capability 9.0 with `CANDLE_RAGGED_ATTENTION=wgmma1`.
    wgmma: Option<Vec<CudaFunction>>,
    /// `resident_plan`'s tunables, from the environment for A/B measurements:
    /// `CANDLE_RAGGED_KEY_PARTS` (1 turns key parts off, 4 keeps lever 16's rule; default 8),
    /// `CANDLE_RAGGED_SPLIT_BELOW` (warps per SM), `CANDLE_RAGGED_PAIR_WARPS` (lever 135's
    /// form; 0 never), `CANDLE_RAGGED_PAIRQ_PAIRS` (lever 136's, pairs per SM; 0 every
    /// pairable block, a large value never) and `CANDLE_RAGGED_PAIRQ_WARPS` (lever 136's at any
    /// batch from that many warps a block; 9 never).
    plan_knobs: PlanKnobs,
    select: Vec<CudaFunction>,
    decide: Vec<CudaFunction>,
    gather: Vec<CudaFunction>,
    pack: Vec<CudaFunction>,
    unpack: Vec<CudaFunction>,
    mean: Vec<CudaFunction>,
    offsets: CudaFunction,
    cls_probs: Vec<CudaFunction>,
    /// Whether `select_by_rule` (lever 33) and `select_top_k` (lever 39) compute class-attention
    /// scores in their own (sequence, head) blocks first: below `sm_count` sequences by default,
    /// `CANDLE_RAGGED_SPLIT_SCORES=1` always, `=0` never (the decide / select blocks compute them
    /// themselves; same bits either way, checked by `a_sequence_selects_the_same_in_any_batch`
    /// in tests/select.rs).
    split_scores: Option<bool>,
    /// Whether the attention kernels take equal-length sequences' spans from their length
    /// instead of `cu_seqlens` (lever 54; `CANDLE_RAGGED_UNIFORM_SPANS=0` reads `cu_seqlens`
    /// always, for A/B runs).
    uniform_spans: bool,
}

static LOADED: Mutex<Vec<(DeviceId, Arc<Kernels>)>> = Mutex::new(Vec::new());

fn kernels(dev: &CudaDevice) -> Result<Arc<Kernels>> {
    let mut loaded = LOADED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, k)) = loaded.iter().find(|(id, _)| *id == dev.id()) {
        return Ok(k.clone());
    }
    let load = |name: &str| -> Result<CudaFunction> {
        Ok(dev
            .get_or_load_custom_func(name, MODULE, PTX)?
            .into_cuda_function())
    };
    // A/B arms, same launch shape and shared memory: `CANDLE_RAGGED_RESIDENT=k64` is v4's
    // resident kernel from before lever 24 (64-key softmax steps, two blocks per SM) for every
    // launch; `r96` / `r80` lever 35's kernel under one register bound for every launch instead
    // of the plan's choice (the paired kernels' launches included). `CANDLE_RAGGED_PAIRQ=32`:
    // lever 136's launches on its 32-key form (208 bytes spilled) instead of the 16-key one.
    let pairq = match std::env::var("CANDLE_RAGGED_PAIRQ").as_deref() {
        Ok("32") => "resident_pairq32_",
        _ => "resident_pairq16_",
    };
    let variants = match std::env::var("CANDLE_RAGGED_RESIDENT")
        .as_deref()
        .map(str::trim)
    {
        Ok("k64") => ["resident_k64_"; 4],
        Ok("r96") => ["resident_"; 4],
        Ok("r80") => ["resident_r80_"; 4],
        _ => ["resident_", "resident_r80_", "resident_pair_", pairq],
    };
    let load_resident = |variant: &str| -> Result<Vec<Vec<CudaFunction>>> {
        RESIDENT_NAMES
            .iter()
            .map(|row| {
                row.iter()
                    .map(|n| load(&n.replacen("resident_", variant, 1)))
                    .collect()
            })
            .collect()
    };
    let resident = [
        load_resident(variants[0])?,
        load_resident(variants[1])?,
        load_resident(variants[2])?,
        load_resident(variants[3])?,
    ];
    let attribute = |a: sys::CUdevice_attribute| -> Result<usize> {
        Ok(dev.cuda_stream().context().attribute(a).w()?.max(0) as usize)
    };
    let gpu = GpuLimits {
        sm_count: attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
            .max(1),
        smem_per_sm: attribute(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
        )?,
        smem_per_block: attribute(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )?,
    }
    .capped_kb(std::env::var("CANDLE_RAGGED_GPU_SMEM_KB").ok().as_deref());
    // Past 48 KB of dynamic shared memory a kernel must opt in; no plan asks for more than the
    // device allows a block (`resident_plan` keeps within it).
    for (fs, dim) in resident
        .iter()
        .flatten()
        .flat_map(|row| row.iter().zip([32, 64]))
    {
        fs.set_attribute(
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            resident_opt_in_bytes(dim).min(gpu.smem_per_block) as i32,
        )
        .w()?;
    }
    let attention_env = std::env::var("CANDLE_RAGGED_ATTENTION");
    let resident_enabled = attention_env.as_deref() != Ok("tiled");
    let wgmma = match PTX_SM90 {
        // compute_90a PTX loads on compute capability 9.0 only; the attributes are read only
        // when the arm is asked for.
        Some(ptx)
            if attention_env.as_deref() == Ok("wgmma1") && compute_capability(dev)? == (9, 0) =>
        {
            let fs: Vec<CudaFunction> = WGMMA_NAMES
                .iter()
                .map(|n| {
                    Ok(dev
                        .get_or_load_custom_func(n, MODULE_SM90, ptx)?
                        .into_cuda_function())
                })
                .collect::<Result<_>>()?;
            for f in &fs {
                f.set_attribute(
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    wgmma_smem_bytes(WGMMA_MAX_LEN) as i32,
                )
                .w()?;
            }
            Some(fs)
        }
        _ => None,
    };
    let defaults = PlanKnobs::default();
    let knob = |name: &str, default: usize| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(default)
    };
    let plan_knobs = PlanKnobs {
        max_parts: match std::env::var("CANDLE_RAGGED_KEY_PARTS").as_deref() {
            Ok("1") => 1,
            Ok("4") => KEY_PARTS,
            _ => defaults.max_parts,
        },
        split_below: knob("CANDLE_RAGGED_SPLIT_BELOW", defaults.split_below),
        pair_max_warps: knob("CANDLE_RAGGED_PAIR_WARPS", defaults.pair_max_warps),
        pairq_min_pairs_per_sm: knob("CANDLE_RAGGED_PAIRQ_PAIRS", defaults.pairq_min_pairs_per_sm),
        pairq_min_warps: knob("CANDLE_RAGGED_PAIRQ_WARPS", defaults.pairq_min_warps),
    };
    let decide: Vec<CudaFunction> = DECIDE_NAMES
        .iter()
        .map(|n| load(n))
        .collect::<Result<_>>()?;
    for f in &decide {
        f.set_attribute(
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            DECIDE_MAX_SMEM as i32,
        )
        .w()?;
    }
    let k = Arc::new(Kernels {
        attn: ATTN_NAMES
            .iter()
            .map(|row| row.iter().map(|n| load(n)).collect())
            .collect::<Result<_>>()?,
        resident,
        gpu,
        resident_enabled,
        wgmma,
        plan_knobs,
        select: SELECT_NAMES
            .iter()
            .map(|n| load(n))
            .collect::<Result<_>>()?,
        decide,
        gather: GATHER_NAMES
            .iter()
            .map(|n| load(n))
            .collect::<Result<_>>()?,
        pack: PACK_NAMES.iter().map(|n| load(n)).collect::<Result<_>>()?,
        unpack: UNPACK_NAMES
            .iter()
            .map(|n| load(n))
            .collect::<Result<_>>()?,
        mean: MEAN_NAMES.iter().map(|n| load(n)).collect::<Result<_>>()?,
        offsets: load("ragged_lengths_to_offsets")?,
        cls_probs: CLS_PROBS_NAMES
            .iter()
            .map(|n| load(n))
            .collect::<Result<_>>()?,
        split_scores: match std::env::var("CANDLE_RAGGED_SPLIT_SCORES").as_deref() {
            Ok("1") => Some(true),
            Ok("0") => Some(false),
            _ => None,
        },
        uniform_spans: std::env::var("CANDLE_RAGGED_UNIFORM_SPANS").as_deref() != Ok("0"),
    });
    loaded.push((dev.id(), k.clone()));
    Ok(k)
}

/// A batch tensor's storage (read-locked) and its start offset; [`cuda_u32`] then views it.
fn u32_storage(t: &candle_core::Tensor) -> (candle_core::StorageRef<'_>, usize) {
    let (storage, layout) = t.storage_and_layout();
    (storage, layout.start_offset())
}

/// The u32 device slice of a batch tensor's storage; an error if it is not on a CUDA device.
fn cuda_u32(storage: &Storage) -> Result<&CudaSlice<u32>> {
    match storage {
        Storage::Cuda(s) => s.as_cuda_slice::<u32>(),
        _ => Err(candle_core::Error::Msg(
            "candle-ragged: batch tensor is not on a CUDA device".into(),
        )),
    }
}

/// Pushes the batch's `positions` onto a pack/unpack launch, or a null pointer when the batch
/// keeps leading tokens (the kernels then derive positions from `cu_seqlens`).
macro_rules! push_positions {
    ($builder:ident, $positions:expr) => {
        let null: u64 = 0;
        let view;
        match $positions {
            Some((storage, offset)) => {
                view = cuda_u32(storage)?.slice(*offset..);
                $builder.arg(&view);
            }
            None => {
                $builder.arg(&null);
            }
        }
    };
}

/// Pushes an optional device slice onto a launch, or a null pointer (kernels that read only the
/// pointer their mode needs).
macro_rules! push_opt {
    ($builder:ident, $opt:expr, $null:expr) => {
        match $opt {
            Some(v) => $builder.arg(v),
            None => $builder.arg($null),
        };
    };
}

/// `$run!(element type, kernel index)` for the f32 / f16 / bf16 storages of the select kernels,
/// or the unsupported-dtype error of `$op`.
macro_rules! by_float_dtype {
    ($dtype:expr, $op:expr, $run:ident) => {
        match $dtype {
            DType::F32 => $run!(f32, 0),
            DType::F16 => $run!(half::f16, 1),
            DType::BF16 => $run!(half::bf16, 2),
            dtype => return Err(RaggedError::UnsupportedDType { op: $op, dtype }.into()),
        }
    };
}

pub(crate) fn attention(
    batch: &RaggedBatch,
    softmax_scale: f32,
    (sq, lq): (&CudaStorage, &Layout),
    (sk, lk): (&CudaStorage, &Layout),
    (sv, lv): (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)> {
    let dev = &sq.device;
    let (total, heads, dim) = lq.shape().dims3()?;
    let dim_index = match dim {
        32 => 0,
        64 => 1,
        128 => 2,
        _ => {
            return Err(RaggedError::UnsupportedHeadDim {
                op: "ragged_attention",
                head_dim: dim,
                supported: crate::SUPPORTED_HEAD_DIMS,
            }
            .into())
        }
    };
    let dtype_index = match sq.dtype() {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
        dtype => {
            return Err(RaggedError::UnsupportedDType {
                op: "ragged_attention",
                dtype,
            }
            .into())
        }
    };
    let shape = lq.shape().clone();
    if total == 0 {
        return Ok((zero_len_storage(dev, sq.dtype())?, shape));
    }
    let k = kernels(dev)?;
    let (cu_storage, cu_off) = u32_storage(batch.cu_seqlens());
    let cu = cuda_u32(&cu_storage)?.slice(cu_off..);

    let strides = |l: &Layout| (l.stride()[0] as i64, l.stride()[1] as i64);
    let (q_tok, q_head) = strides(lq);
    let (k_tok, k_head) = strides(lk);
    let (v_tok, v_head) = strides(lv);
    let heads_i = heads as i32;
    let scale_log2 = softmax_scale * std::f32::consts::LOG2_E;
    // 0: the kernels read each sequence's span from cu_seqlens.
    let uniform_len = match batch.uniform_len() {
        Some(len) if k.uniform_spans => len as i32,
        _ => 0,
    };
    let wgmma = match &k.wgmma {
        Some(fs) if dtype_index > 0 && dim == 64 && batch.max_len() <= WGMMA_MAX_LEN => {
            Some(&fs[dtype_index - 1])
        }
        _ => None,
    };
    // The launch shape of the resident kernel (blocks, warps, key parts, shared memory):
    // crate::resident_plan, asked only where the wgmma A/B arm is not taken; `None` where it
    // does not fit the device (the tiled kernel then).
    let resident = || {
        let eligible = k.resident_enabled
            && dtype_index > 0
            && dim <= 64
            && batch.max_len() <= RESIDENT_MAX_LEN;
        eligible
            .then(|| {
                resident_plan(
                    batch.batch_size(),
                    heads,
                    batch.max_len(),
                    dim,
                    k.gpu,
                    k.plan_knobs,
                )
            })
            .flatten()
    };
    let (func, cfg) = if let Some(func) = wgmma {
        let cfg = LaunchConfig {
            grid_dim: (1, heads as u32, batch.batch_size() as u32),
            block_dim: (128, 1, 1),
            shared_mem_bytes: wgmma_smem_bytes(batch.max_len()) as u32,
        };
        (func, cfg)
    } else if let Some(plan) = resident() {
        let cfg = LaunchConfig {
            grid_dim: plan.grid,
            block_dim: plan.block,
            shared_mem_bytes: plan.shared_mem_bytes,
        };
        (
            &k.resident[plan.kernel as usize][dtype_index - 1][dim_index],
            cfg,
        )
    } else {
        let cfg = LaunchConfig {
            grid_dim: (
                batch.max_len().div_ceil(64) as u32,
                heads as u32,
                batch.batch_size() as u32,
            ),
            block_dim: (if dtype_index == 0 { 64 } else { 128 }, 1, 1),
            shared_mem_bytes: 0,
        };
        (&k.attn[dtype_index][dim_index], cfg)
    };
    let elems = total * heads * dim;
    macro_rules! launch {
        ($ty:ty, $variant:ident) => {{
            let q = sq.as_cuda_slice::<$ty>()?.slice(lq.start_offset()..);
            let kk = sk.as_cuda_slice::<$ty>()?.slice(lk.start_offset()..);
            let v = sv.as_cuda_slice::<$ty>()?.slice(lv.start_offset()..);
            // SAFETY: every element is written by the kernel: each query row of each sequence.
            let out = unsafe { dev.alloc::<$ty>(elems)? };
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(func);
            b.arg(&q).arg(&kk).arg(&v).arg(&out).arg(&cu);
            b.arg(&q_tok).arg(&q_head).arg(&k_tok).arg(&k_head).arg(&v_tok).arg(&v_head);
            b.arg(&heads_i).arg(&scale_log2).arg(&uniform_len);
            // SAFETY: argument list matches ATTN_ARGS in kernels/ragged_attention.cu; sizes checked above.
            unsafe { b.launch(cfg) }.w()?;
            CudaStorage { slice: CudaStorageSlice::$variant(out), device: dev.clone() }
        }};
    }
    let storage = match dtype_index {
        0 => launch!(f32, F32),
        1 => launch!(half::f16, F16),
        _ => launch!(half::bf16, BF16),
    };
    Ok((storage, shape))
}

/// The device's compute capability (major, minor).
fn compute_capability(dev: &CudaDevice) -> Result<(i32, i32)> {
    let ctx = dev.cuda_stream().context().clone();
    Ok((
        ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            .w()?,
        ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
            .w()?,
    ))
}

/// Dynamic shared memory of the wgmma kernel for sequences up to `max_len`: K and V in 64-key
/// chunks of 8 KB each, plus the slack to align them to 1024 bytes (the swizzle's period).
fn wgmma_smem_bytes(max_len: usize) -> usize {
    2 * max_len.div_ceil(64) * 64 * 128 + 1024
}

fn zero_len_storage(dev: &CudaDevice, dtype: DType) -> Result<CudaStorage> {
    let slice = match dtype {
        DType::F32 => CudaStorageSlice::F32(dev.alloc_zeros::<f32>(0)?),
        DType::F16 => CudaStorageSlice::F16(dev.alloc_zeros::<half::f16>(0)?),
        DType::BF16 => CudaStorageSlice::BF16(dev.alloc_zeros::<half::bf16>(0)?),
        _ => CudaStorageSlice::U32(dev.alloc_zeros::<u32>(0)?),
    };
    Ok(CudaStorage {
        slice,
        device: dev.clone(),
    })
}

/// Widest vector (index into VEC_BYTES) dividing the row size, every stride and the start offset.
fn vec_choice(elem: usize, row: usize, offsets_and_strides: &[usize]) -> usize {
    VEC_BYTES
        .iter()
        .position(|&v| {
            v >= elem
                && (row * elem).is_multiple_of(v)
                && offsets_and_strides
                    .iter()
                    .all(|s| (s * elem).is_multiple_of(v))
        })
        .unwrap_or(3)
}

pub(crate) fn pack(
    batch: &RaggedBatch,
    s: &CudaStorage,
    l: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let dev = &s.device;
    let (_b, _n, c) = l.shape().dims3()?;
    let total = batch.total_tokens();
    let shape = Shape::from((total, c));
    if total == 0 || c == 0 {
        return Ok((zero_len_storage(dev, s.dtype())?, shape));
    }
    let elem = s.dtype().size_in_bytes();
    let (sb, sn) = (l.stride()[0], l.stride()[1]);
    let vi = vec_choice(elem, c, &[l.start_offset(), sb, sn]);
    let per = VEC_BYTES[vi] / elem;
    let k = kernels(dev)?;
    let (cu_storage, cu_off) = u32_storage(batch.cu_seqlens());
    let cu = cuda_u32(&cu_storage)?.slice(cu_off..);
    let pos_guard = batch.positions().map(u32_storage);
    let batch_i = batch.batch_size() as i32;
    let (x_b, x_n, row_vecs) = ((sb / per) as i64, (sn / per) as i64, (c / per) as i32);
    let cfg = LaunchConfig {
        grid_dim: (total as u32, 1, 1),
        block_dim: ((row_vecs as u32).clamp(32, 256).next_multiple_of(32), 1, 1),
        shared_mem_bytes: 0,
    };
    macro_rules! launch {
        ($ty:ty, $variant:ident) => {{
            let x = s.as_cuda_slice::<$ty>()?.slice(l.start_offset()..);
            // SAFETY: every packed row is written by its block.
            let out = unsafe { dev.alloc::<$ty>(total * c)? };
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&k.pack[vi]);
            b.arg(&x).arg(&out).arg(&cu);
            push_positions!(b, &pos_guard);
            b.arg(&batch_i).arg(&x_b).arg(&x_n).arg(&row_vecs);
            // SAFETY: arguments match ragged_pack_* in kernels/ragged_attention.cu.
            unsafe { b.launch(cfg) }.w()?;
            CudaStorage {
                slice: CudaStorageSlice::$variant(out),
                device: dev.clone(),
            }
        }};
    }
    let storage = match s.dtype() {
        DType::F32 => launch!(f32, F32),
        DType::F16 => launch!(half::f16, F16),
        DType::BF16 => launch!(half::bf16, BF16),
        DType::U32 => launch!(u32, U32),
        dtype => return Err(RaggedError::UnsupportedDType { op: "pack", dtype }.into()),
    };
    Ok((storage, shape))
}

/// [`crate::unpack`] (`use_positions`: scatter to the batch's positions when it has them) and
/// [`crate::leading_rows`] (`false`: the leading rows of each sequence, in packed order).
pub(crate) fn unpack(
    batch: &RaggedBatch,
    tokens: usize,
    use_positions: bool,
    s: &CudaStorage,
    l: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let dev = &s.device;
    let (total, c) = l.shape().dims2()?;
    let bsz = batch.batch_size();
    let shape = Shape::from((bsz, tokens, c));
    let out_elems = bsz * tokens * c;
    let elem = s.dtype().size_in_bytes();
    let st = l.stride()[0];
    let vi = vec_choice(elem, c, &[l.start_offset(), st]);
    let per = VEC_BYTES[vi] / elem;
    let (p_t, row_vecs, n_i, batch_i) = (
        (st / per) as i64,
        (c / per) as i32,
        tokens as i32,
        bsz as i32,
    );
    let positions = batch.positions().filter(|_| use_positions);
    let scatter = positions.is_some();
    // With positions, blocks walk packed rows over a zeroed output; without, they walk output rows.
    let rows = if scatter { total } else { bsz * tokens };
    let k = kernels(dev)?;
    let (cu_storage, cu_off) = u32_storage(batch.cu_seqlens());
    let cu = cuda_u32(&cu_storage)?.slice(cu_off..);
    let pos_guard = positions.map(u32_storage);
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: ((row_vecs as u32).clamp(32, 256).next_multiple_of(32), 1, 1),
        shared_mem_bytes: 0,
    };
    macro_rules! launch {
        ($ty:ty, $variant:ident) => {{
            let out = if scatter {
                dev.alloc_zeros::<$ty>(out_elems)?
            } else {
                // SAFETY: the kernel writes every output row (data or zeros).
                unsafe { dev.alloc::<$ty>(out_elems)? }
            };
            if rows > 0 && c > 0 {
                let x = s.as_cuda_slice::<$ty>()?.slice(l.start_offset()..);
                let stream = dev.cuda_stream();
                let mut b = stream.launch_builder(&k.unpack[vi]);
                b.arg(&x).arg(&out).arg(&cu);
                push_positions!(b, &pos_guard);
                b.arg(&batch_i).arg(&n_i).arg(&p_t).arg(&row_vecs);
                // SAFETY: arguments match ragged_unpack_* in kernels/ragged_attention.cu.
                unsafe { b.launch(cfg) }.w()?;
            }
            CudaStorage {
                slice: CudaStorageSlice::$variant(out),
                device: dev.clone(),
            }
        }};
    }
    let storage = match s.dtype() {
        DType::F32 => launch!(f32, F32),
        DType::F16 => launch!(half::f16, F16),
        DType::BF16 => launch!(half::bf16, BF16),
        DType::U32 => launch!(u32, U32),
        dtype => {
            return Err(RaggedError::UnsupportedDType {
                op: "unpack",
                dtype,
            }
            .into())
        }
    };
    Ok((storage, shape))
}

/// The class token's attention probabilities of `b` sequences of `len` tokens each, from their
/// fused projection `qkv` (`[b·len, 3c]`, contiguous, f32 / f16 / bf16): one `cls_probs` block
/// per (sequence, head), `[b, heads + 1, len]` f32 whose row `h < heads` holds head h's
/// probabilities and, with `value_norms`, row `heads` the value rows' sums of squares (without,
/// that row is left unwritten: the caller must not read it). The rows selection modes 4 / 5
/// read (select_common.cuh's step_score).
#[allow(clippy::too_many_arguments)]
pub(crate) fn class_attention_probs(
    (s, ls): (&CudaStorage, &Layout),
    b: usize,
    len: usize,
    c: usize,
    heads: i32,
    scale: f32,
    value_norms: bool,
) -> Result<CudaSlice<f32>> {
    let dev = &s.device;
    let k = kernels(dev)?;
    if !ls.is_contiguous() || ls.shape().elem_count() != b * len * 3 * c || heads <= 0 {
        candle_core::bail!(
            "cls_probs: qkv must be a contiguous [{}, {}]",
            b * len,
            3 * c
        );
    }
    let head_dim = c / heads as usize;
    // SAFETY: cls_probs writes the first `len` entries of every (sequence, row) it is given,
    // and every sequence has exactly `len` tokens here: the whole buffer but, without
    // `value_norms`, each sequence's row `heads` (documented above).
    let buf = unsafe { dev.alloc::<f32>(b * (heads as usize + 1) * len)? };
    let cfg = LaunchConfig {
        grid_dim: (b as u32, heads as u32 + value_norms as u32, 1),
        block_dim: (256, 1, 1),
        // (round_up(D, 4) + len) floats: see cls_probs.
        shared_mem_bytes: (4 * (head_dim.next_multiple_of(4) + len)) as u32,
    };
    let stream = dev.cuda_stream();
    let (len_i, c_i) = (len as i32, c as i32);
    let null: u64 = 0;
    macro_rules! run {
        ($t:ty, $i:expr) => {{
            let qkv = s.as_cuda_slice::<$t>()?.slice(ls.start_offset()..);
            let mut builder = stream.launch_builder(&k.cls_probs[$i]);
            // A null cu_seqlens: sequences of `len` (the out_stride) tokens each.
            builder.arg(&qkv).arg(&null).arg(&buf);
            builder.arg(&len_i).arg(&heads).arg(&c_i).arg(&scale);
            // SAFETY: arguments match ragged_cls_probs_* in kernels/ragged_attention.cu; qkv
            // holds B · len rows of 3 · C (checked above), the buffer B · (heads + 1) rows.
            unsafe { builder.launch(cfg) }.w()?;
        }};
    }
    by_float_dtype!(s.dtype(), "cls_probs", run);
    Ok(buf)
}

/// [`crate::select_top_k`] on CUDA: blocks of 512 threads, one or more per sequence.
pub(crate) fn select_top_k(
    op: &crate::select::SelectTopK,
    (x, lx): (&CudaStorage, &Layout),
    (s, ls): (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)> {
    use crate::scores::ScoreSource;
    let dev = &x.device;
    let (rows, c) = lx.shape().dims2()?;
    let b = rows / op.len;
    let aux_elems = match op.source {
        ScoreSource::Given => b * op.len,
        ScoreSource::RowL2Norm => rows * c,
        ScoreSource::ClsAttention { .. } | ScoreSource::Significance { .. } => rows * 3 * c,
    };
    if !lx.is_contiguous() || !ls.is_contiguous() || ls.shape().elem_count() != aux_elems {
        candle_core::bail!(
            "select_top_k: x and its scores / qkv must be contiguous and agree in size"
        );
    }
    if op.len > crate::MAX_SEQ_LEN {
        candle_core::bail!("select_top_k: sequences longer than {}", crate::MAX_SEQ_LEN);
    }
    let k = kernels(dev)?;
    let out_rows = b * op.out_len();
    let c2 = match &op.also {
        Some(a) if op.fusion.is_none() => a.dim(1)?,
        Some(_) => candle_core::bail!("select_top_k: `also` cannot be gathered with a fused token"),
        None => 0,
    };
    let c2_i = c2 as i32;
    let (len, cc, prefix, keep) = (op.len as i32, c as i32, op.prefix as i32, op.keep as i32);
    let (mode, heads, scale) = op.source.kernel_args();
    // The kernel reads only the pointer its mode needs; the others get a null pointer.
    let null: u64 = 0;
    let scores = match op.source {
        ScoreSource::Given => Some(s.as_cuda_slice::<f32>()?.slice(ls.start_offset()..)),
        _ => None,
    };
    let fuse: i32 = match op.fusion {
        None => 0,
        Some(crate::DroppedFusion::WeightedMean) => 1,
        Some(crate::DroppedFusion::WeightedSum) => 2,
    };
    // Lever 39: class-attention scores (EViT, ATS) in (sequence, head) blocks first, as
    // select_by_rule does since lever 33 (same switch, `CANDLE_RAGGED_SPLIT_SCORES`): below one
    // sequence per SM every block of a sequence below would otherwise compute all of its heads'
    // logits again, each reading the whole sequence's keys. `[B, heads + 1, len]` f32, the rows
    // modes 4 / 5 read (the same bits as modes 2 / 3).
    let split = op.source.reads_qkv() && k.split_scores.unwrap_or(b < k.gpu.sm_count);
    let probs = if split {
        let vnorm = matches!(op.source, ScoreSource::Significance { .. });
        Some(class_attention_probs(
            (s, ls),
            b,
            op.len,
            c,
            heads,
            scale,
            vnorm,
        )?)
    } else {
        None
    };
    let (scores, mode) = match (&probs, op.source) {
        (Some(buf), ScoreSource::ClsAttention { .. }) => (Some(buf.slice(0..)), 4),
        (Some(buf), _) => (Some(buf.slice(0..)), 5),
        (None, _) => (scores, mode),
    };
    // Blocks per sequence: enough to spread the row copies over the GPU at small batches (each
    // block of a sequence scores and ranks it again, O(len²/512) per thread), one at large ones.
    // 512 threads: at batch 1 a block's scoring and ranking are the step's latency, and they
    // split over threads (the kernel takes any multiple of 32 up to 1024).
    let per_seq = (264 / b.max(1)).clamp(1, op.len.div_ceil(8)) as u32;
    let cfg = LaunchConfig {
        grid_dim: (b as u32, per_seq, 1),
        block_dim: (512, 1, 1),
        shared_mem_bytes: 0,
    };
    let stream = dev.cuda_stream();
    macro_rules! run {
        ($t:ty, $i:expr) => {{
            let xs = x.as_cuda_slice::<$t>()?.slice(lx.start_offset()..);
            let qkv = if op.source.reads_qkv() && probs.is_none() {
                Some(s.as_cuda_slice::<$t>()?.slice(ls.start_offset()..))
            } else {
                None
            };
            // `also` (select_top_k_gathering): its kept rows after x's in the same buffer.
            let also_guard = op.also.as_ref().map(|t| t.storage_and_layout());
            let mut also_view = None;
            if let Some((storage, layout)) = &also_guard {
                let Storage::Cuda(a) = &**storage else {
                    candle_core::bail!("select_top_k: `also` is not on the CUDA device");
                };
                if a.dtype() != x.dtype()
                    || !layout.is_contiguous()
                    || layout.shape().dims() != [rows, c2]
                {
                    candle_core::bail!(
                        "select_top_k: `also` must be a contiguous [{rows}, {c2}] of x's dtype"
                    );
                }
                also_view = Some(a.as_cuda_slice::<$t>()?.slice(layout.start_offset()..));
            }
            // SAFETY: the kernel writes every one of the `out_rows · (c + c2)` elements.
            let out = unsafe { dev.alloc::<$t>(out_rows * (c + c2))? };
            let also_out = out.slice(out_rows * c..);
            let mut builder = stream.launch_builder(&k.select[$i]);
            builder.arg(&xs);
            push_opt!(builder, &scores, &null);
            push_opt!(builder, &qkv, &null);
            builder.arg(&out);
            builder.arg(&len);
            builder.arg(&cc);
            builder.arg(&prefix);
            builder.arg(&keep);
            builder.arg(&fuse);
            builder.arg(&mode);
            builder.arg(&heads);
            builder.arg(&scale);
            push_opt!(builder, &also_view, &null);
            if also_view.is_some() {
                builder.arg(&also_out);
            } else {
                builder.arg(&null);
            }
            builder.arg(&c2_i);
            // SAFETY: sizes checked above and by select_top_k; one block per sequence; `also`
            // (when given) has the same rows as x and its output the rows after x's.
            unsafe { builder.launch(cfg) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        }};
    }
    let out = by_float_dtype!(x.dtype(), "select_top_k", run);
    let shape = if c2 > 0 {
        Shape::from(out_rows * (c + c2))
    } else {
        Shape::from((out_rows, c))
    };
    Ok((out, shape))
}

/// The leading `n` u32 of a CUDA tensor, copied to the host (and nothing else of it).
pub(crate) fn read_u32_prefix(t: &candle_core::Tensor, n: usize) -> Result<Vec<u32>> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else {
        candle_core::bail!("candle-ragged: expected a CUDA tensor");
    };
    let view = cs
        .as_cuda_slice::<u32>()?
        .slice(layout.start_offset()..layout.start_offset() + n);
    cs.device.cuda_stream().clone_dtoh(&view).w()
}

/// [`crate::select_by_rule`]'s first kernel on CUDA: one block of 1024 threads per sequence.
pub(crate) fn select_decide(
    op: &crate::select_rule::Decide,
    (x, lx): (&CudaStorage, &Layout),
    (s, ls): (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)> {
    use crate::keep::{KeepCount, KeepRule};
    use crate::select_rule::plan_len;
    let dev = &x.device;
    let (rows, c) = lx.shape().dims2()?;
    let batch = &op.batch;
    let (b, max_len) = (batch.batch_size(), batch.max_len());
    if !lx.is_contiguous() || !ls.is_contiguous() || rows != batch.total_tokens() {
        candle_core::bail!("select_by_rule: x and its scores / qkv must be contiguous");
    }
    if max_len > crate::MAX_SEQ_LEN {
        candle_core::bail!(
            "select_by_rule: sequences longer than {}",
            crate::MAX_SEQ_LEN
        );
    }
    let (mode, heads, scale) = op.source.kernel_args();
    let k = kernels(dev)?;
    // Class-attention scores in (sequence, head) blocks first (`cls_probs`), the decide kernel
    // then reading them as modes 4 / 5: one block per sequence is one SM's loads at small batches.
    let split = op.source.reads_qkv() && k.split_scores.unwrap_or(b < k.gpu.sm_count);
    // Scratch: the logits of a group of heads (and their queries), and at least 4 floats per
    // token (two f64 arrays for the inverse-transform rule); a multiple of 4 keeps them aligned.
    let head_dim = c / heads.max(1) as usize;
    let logits = if op.source.reads_qkv() && !split {
        (heads.clamp(1, 16) as usize * (max_len + head_dim)).min(DECIDE_LOGIT_FLOATS)
    } else {
        0
    };
    let tmp_floats = (4 * max_len)
        .max(max_len + head_dim)
        .max(logits)
        .next_multiple_of(4);
    let smem = 4 * tmp_floats + 16 * max_len;
    let (rule, count_kind, count, param): (i32, i32, i32, f64) = {
        let count = |c: KeepCount| match c {
            KeepCount::Exactly(k) => (0, k.min(i32::MAX as usize) as i32, 0.0),
            KeepCount::CeilRatio(r) => (1, 0, r),
        };
        match op.rule {
            KeepRule::Top(c) => {
                let (kind, k, r) = count(c);
                (0, kind, k, r)
            }
            KeepRule::AtLeast(t) => (1, 0, 0, t as f64),
            KeepRule::Above(t) => (2, 0, 0, t as f64),
            KeepRule::AtLeastMeanTimes(f) => (3, 0, 0, f as f64),
            KeepRule::MassShare(share) => (4, 0, 0, share),
            KeepRule::InverseTransform { samples } => {
                let (kind, k, r) = count(samples);
                (5, kind, k, r)
            }
        }
    };
    let fuse: i32 = match op.fusion {
        None => 0,
        Some(crate::DroppedFusion::WeightedMean) => 1,
        Some(crate::DroppedFusion::WeightedSum) => 2,
    };
    let (cu_storage, cu_off) = u32_storage(batch.cu_seqlens());
    let cu = cuda_u32(&cu_storage)?.slice(cu_off..);
    let null: u64 = 0;
    let stream = dev.cuda_stream();
    // `[B, heads + 1, max_len]` f32: each head's probabilities, then the value rows' sums of
    // squares (written for Significance only).
    let probs = if split {
        let out_stride = max_len.max(1);
        // SAFETY: cls_probs writes every (sequence, head) row's first `len` entries, which are all
        // the decide kernel reads.
        let buf = unsafe { dev.alloc::<f32>(b * (heads as usize + 1) * out_stride)? };
        let vnorm = matches!(op.source, crate::scores::ScoreSource::Significance { .. });
        let cfg = LaunchConfig {
            grid_dim: (b as u32, heads as u32 + vnorm as u32, 1),
            block_dim: (256, 1, 1),
            // (round_up(D, 4) + max_len) floats: see cls_probs.
            shared_mem_bytes: (4 * (head_dim.next_multiple_of(4) + max_len)) as u32,
        };
        let (stride_i, heads_i, c_i) = (out_stride as i32, heads, c as i32);
        macro_rules! run {
            ($t:ty, $i:expr) => {{
                let qkv = s.as_cuda_slice::<$t>()?.slice(ls.start_offset()..);
                let mut builder = stream.launch_builder(&k.cls_probs[$i]);
                builder.arg(&qkv).arg(&cu).arg(&buf);
                builder.arg(&stride_i).arg(&heads_i).arg(&c_i).arg(&scale);
                // SAFETY: arguments match ragged_cls_probs_* in kernels/ragged_attention.cu; the
                // buffer holds B · (heads + 1) rows of max_len floats.
                unsafe { builder.launch(cfg) }.w()?;
            }};
        }
        by_float_dtype!(x.dtype(), "select_by_rule", run);
        Some((buf, out_stride))
    } else {
        None
    };
    let scores = match (&probs, op.source) {
        (Some((buf, _)), _) => Some(buf.slice(0..)),
        (None, crate::scores::ScoreSource::Given) => {
            Some(s.as_cuda_slice::<f32>()?.slice(ls.start_offset()..))
        }
        _ => None,
    };
    let mode = match (&probs, op.source) {
        (Some(_), crate::scores::ScoreSource::ClsAttention { .. }) => 4,
        (Some(_), _) => 5,
        (None, _) => mode,
    };
    let score_stride = probs.as_ref().map_or(op.score_stride, |(_, st)| *st);
    let (b_i, total_i, c_i, prefix_i, stride_i, tmp_i) = (
        b as i32,
        rows as i32,
        c as i32,
        op.prefix as i32,
        score_stride as i32,
        tmp_floats as i32,
    );
    let cfg = LaunchConfig {
        grid_dim: (b as u32, 1, 1),
        // DECIDE_THREADS in the kernel source.
        block_dim: (1024, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    // SAFETY: the kernel writes every entry of the plan (see plan_len).
    let plan = unsafe { dev.alloc::<u32>(plan_len(b, rows))? };
    macro_rules! run {
        ($t:ty, $i:expr) => {{
            let xs = x.as_cuda_slice::<$t>()?.slice(lx.start_offset()..);
            let qkv = if op.source.reads_qkv() && probs.is_none() {
                Some(s.as_cuda_slice::<$t>()?.slice(ls.start_offset()..))
            } else {
                None
            };
            let mut builder = stream.launch_builder(&k.decide[$i]);
            builder.arg(&xs);
            push_opt!(builder, &scores, &null);
            builder.arg(&stride_i);
            push_opt!(builder, &qkv, &null);
            builder.arg(&cu).arg(&plan);
            builder.arg(&b_i).arg(&total_i).arg(&c_i).arg(&prefix_i);
            builder.arg(&mode).arg(&heads).arg(&scale);
            builder.arg(&rule).arg(&count_kind).arg(&count).arg(&param);
            builder.arg(&fuse).arg(&tmp_i);
            // SAFETY: arguments match ragged_select_decide_* in kernels/ragged_attention.cu;
            // sizes checked above and by select_by_rule.
            unsafe { builder.launch(cfg) }.w()?;
        }};
    }
    by_float_dtype!(x.dtype(), "select_by_rule", run);
    let n = plan_len(b, rows);
    Ok((
        CudaStorage::wrap_cuda_slice(plan, dev.clone()),
        Shape::from(n),
    ))
}

/// [`crate::select_by_rule`]'s second kernel on CUDA: a warp per input row, then a block per
/// sequence for its fused row.
pub(crate) fn select_gather(
    op: &crate::select_rule::Gather,
    (x, lx): (&CudaStorage, &Layout),
    (p, lp): (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)> {
    let dev = &x.device;
    let (rows, c) = lx.shape().dims2()?;
    let b = op.batch.batch_size();
    let out_rows = op.new_batch.total_tokens();
    if !lx.is_contiguous()
        || rows != op.batch.total_tokens()
        || lp.shape().elem_count() != crate::select_rule::plan_len(b, rows)
    {
        candle_core::bail!("select_by_rule: x and the plan do not match the batch");
    }
    let k = kernels(dev)?;
    let (cu_storage, cu_off) = u32_storage(op.batch.cu_seqlens());
    let cu = cuda_u32(&cu_storage)?.slice(cu_off..);
    let (new_storage, new_off) = u32_storage(op.new_batch.cu_seqlens());
    let new_cu = cuda_u32(&new_storage)?.slice(new_off..);
    let plan = p.as_cuda_slice::<u32>()?.slice(lp.start_offset()..);
    let row_blocks = rows.div_ceil(8);
    // Blocks per fused row (column slices of at least 32): enough to spread a small batch's fused
    // rows over the GPU, one per sequence at large batches.
    let fused_slices = (264 / b.max(1)).clamp(1, c.div_ceil(32).max(1));
    let (b_i, total_i, c_i, row_blocks_i, slices_i) = (
        b as i32,
        rows as i32,
        c as i32,
        row_blocks as i32,
        fused_slices as i32,
    );
    let cfg = LaunchConfig {
        grid_dim: ((row_blocks + b * fused_slices) as u32, 1, 1),
        // GATHER_THREADS in the kernel source.
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let stream = dev.cuda_stream();
    macro_rules! run {
        ($t:ty, $i:expr) => {{
            let xs = x.as_cuda_slice::<$t>()?.slice(lx.start_offset()..);
            // SAFETY: every output row is a kept row's slot or a fused row (see the kernel).
            let out = unsafe { dev.alloc::<$t>(out_rows * c)? };
            let mut builder = stream.launch_builder(&k.gather[$i]);
            builder.arg(&xs).arg(&plan).arg(&cu).arg(&new_cu).arg(&out);
            builder
                .arg(&b_i)
                .arg(&total_i)
                .arg(&c_i)
                .arg(&row_blocks_i)
                .arg(&slices_i);
            // SAFETY: arguments match ragged_select_gather_* in kernels/ragged_attention.cu.
            unsafe { builder.launch(cfg) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        }};
    }
    let out = by_float_dtype!(x.dtype(), "select_by_rule", run);
    Ok((out, Shape::from((out_rows, c))))
}

/// [`crate::sequence_mean`] on CUDA: a block of 8 warps per (sequence, 32 columns).
pub(crate) fn sequence_mean(
    batch: &RaggedBatch,
    skip: usize,
    s: &CudaStorage,
    l: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let dev = &s.device;
    let (rows, d) = l.shape().dims2()?;
    let b = batch.batch_size();
    if rows != batch.total_tokens() || l.stride()[1] != 1 {
        candle_core::bail!("sequence_mean: x does not match the batch or has a strided last dim");
    }
    let k = kernels(dev)?;
    let (cu_storage, cu_off) = u32_storage(batch.cu_seqlens());
    let cu = cuda_u32(&cu_storage)?.slice(cu_off..);
    let (row_stride, d_i, skip_i) = (l.stride()[0] as i64, d as i32, skip as i32);
    let cfg = LaunchConfig {
        grid_dim: (b as u32, d.div_ceil(32) as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let stream = dev.cuda_stream();
    macro_rules! run {
        ($t:ty, $i:expr) => {{
            let xs = s.as_cuda_slice::<$t>()?.slice(l.start_offset()..);
            // SAFETY: block (b, y) writes columns 32y.. of output row b; the grid covers them all.
            let out = unsafe { dev.alloc::<$t>(b * d)? };
            let mut builder = stream.launch_builder(&k.mean[$i]);
            builder.arg(&xs).arg(&out).arg(&cu);
            builder.arg(&row_stride).arg(&d_i).arg(&skip_i);
            // SAFETY: arguments match ragged_sequence_mean_* in kernels/ragged_attention.cu; every
            // sequence has more than `skip` rows (checked by sequence_mean).
            unsafe { builder.launch(cfg) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        }};
    }
    let out = by_float_dtype!(s.dtype(), "sequence_mean", run);
    Ok((out, Shape::from((b, d))))
}

/// [`crate::select_rule::LengthsToOffsets`] on CUDA: one block scans the plan's `b` leading
/// lengths into a fresh `[b + 1]` `cu_seqlens`.
pub(crate) fn lengths_to_offsets(
    b: usize,
    plan: &CudaStorage,
    l: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let dev = &plan.device;
    if l.shape().elem_count() < b || !l.is_contiguous() {
        candle_core::bail!("select_by_rule: the plan holds fewer than {b} lengths");
    }
    let k = kernels(dev)?;
    let lengths = plan.as_cuda_slice::<u32>()?.slice(l.start_offset()..);
    // SAFETY: the kernel writes all b + 1 entries.
    let cu = unsafe { dev.alloc::<u32>(b + 1)? };
    let b_i = b as i32;
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        // OFFSETS_THREADS in the kernel source.
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 0,
    };
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(&k.offsets);
    builder.arg(&lengths).arg(&cu).arg(&b_i);
    // SAFETY: arguments match ragged_lengths_to_offsets in kernels/ragged_attention.cu.
    unsafe { builder.launch(cfg) }.w()?;
    Ok((
        CudaStorage::wrap_cuda_slice(cu, dev.clone()),
        Shape::from(b + 1),
    ))
}
