//! Shared pieces of the candle-fastpath tests: the device under test, poisoning, random inputs,
//! dtype rounding and reading results back.
#![allow(dead_code)]

use candle_core::{DType, Device, Tensor};
use rand::{rngs::StdRng, Rng};

pub mod attention;
pub mod layers;

/// CPU, or the first CUDA GPU when built with `cuda` and one is present: the same tests then
/// check the CUDA paths (the GPU machine runs them; CI runs them on the CPU).
pub fn device() -> Device {
    #[cfg(feature = "cuda")]
    {
        if let Ok(d) = Device::new_cuda(0) {
            return d;
        }
        if std::env::var_os("CANDLE_RAGGED_REQUIRE_CUDA").is_some() {
            panic!("CANDLE_RAGGED_REQUIRE_CUDA is set but no CUDA device could be opened");
        }
    }
    Device::Cpu
}

/// NaN-fills freshly freed device memory: candle's CUDA allocator is stream-ordered and hands
/// the same block back, so an element the op forgets to write shows up as NaN.
pub fn poison(dev: &Device, elems: usize, dtype: DType) {
    let t = Tensor::full(f32::NAN, elems, dev)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    drop(t);
}

pub fn randn(rng: &mut StdRng, n: usize, std: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let u1: f32 = rng.random::<f32>().max(1e-7);
            let u2: f32 = rng.random();
            std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
        })
        .collect()
}

/// Values as the op sees them after rounding to `dtype`.
pub fn quantize(v: &[f32], dtype: DType) -> Vec<f32> {
    Tensor::from_slice(v, v.len(), &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// A 2-D tensor's values as a strided view: the transpose of a contiguous copy of its
/// transpose (rows one apart, columns `rows` apart), for the tests that hand ops non-contiguous
/// operands.
pub fn column_major(t: &Tensor) -> Tensor {
    t.t().unwrap().contiguous().unwrap().t().unwrap()
}

/// A tensor's values as a flat f32 vector on the host.
pub fn host(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// What the tests of the cluster kernels whose shared memory grows with the sequence
/// (attention_norm_linear's ops) expect of `dev`: `Some(false)` without clusters (every call
/// refused), `Some(true)` with clusters and a per-block shared-memory opt-in of at least the
/// H100's 227 KB (every size under test fused), `None` with clusters and less (compute
/// capability 12.x at 99 KB, or the H100 under `CANDLE_FASTPATH_GPU_SMEM_KB`, which lowers the
/// limit the crate reads as it does here): there each launch is fused where it fits and refused
/// where not, as its applies check says, and the tests hold the op to that answer.
pub fn cluster_kernels_expected(dev: &Device) -> Option<bool> {
    if !has_clusters(dev) {
        return Some(false);
    }
    full_shared_memory(dev).then_some(true)
}

/// Whether a block of `dev` may opt into at least the H100's 227 KB of shared memory, the limit
/// the fused kernels' fixed expectations are written for (every kernel opted in); below it a
/// test holds each op to its applies check instead.
pub fn full_shared_memory(dev: &Device) -> bool {
    block_opt_in_bytes(dev) >= 227 * 1024
}

/// The shared memory a block of `dev` may opt into, lowered by `CANDLE_FASTPATH_GPU_SMEM_KB`
/// as candle-fastpath lowers it; 0 off CUDA.
pub fn block_opt_in_bytes(dev: &Device) -> usize {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = dev {
        use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN as OPT_IN;
        let limit = d.cuda_stream().context().attribute(OPT_IN).unwrap().max(0) as usize;
        let knob = std::env::var("CANDLE_FASTPATH_GPU_SMEM_KB").ok();
        return match knob.and_then(|v| v.trim().parse::<usize>().ok()) {
            Some(kb) => limit.min(kb * 1024),
            None => limit,
        };
    }
    let _ = dev;
    0
}

/// Whether `dev` runs thread-block clusters (compute capability 9.0 and up).
pub fn has_clusters(dev: &Device) -> bool {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = dev {
        use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR as MAJOR;
        return d.cuda_stream().context().attribute(MAJOR).unwrap() >= 9;
    }
    let _ = dev;
    false
}
