//! Shared pieces of the candle-ragged tests: the device under test, random inputs, poisoning and
//! an obviously-correct f64 reference.
#![allow(dead_code)]

use candle_core::{DType, Device, Tensor};
use candle_ragged::TokenScores;
use rand::{rngs::StdRng, Rng, SeedableRng};

/// CPU, or the first CUDA GPU when the crate is built with `cuda` and one is present: the same
/// tests then check the CUDA kernels (the GPU machine runs them; CI runs them on the CPU).
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

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// Fills freshly freed device memory with NaN so that an output element a kernel forgets to write
/// shows up as NaN: candle's CUDA allocator is stream-ordered and hands the same block back.
pub fn poison(device: &Device, elems: usize, dtype: DType) {
    if elems == 0 {
        return;
    }
    let t = Tensor::full(f32::NAN, elems, device)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    drop(t);
}

pub fn randn(rng: &mut StdRng, n: usize, std: f32) -> Vec<f32> {
    // Box-Muller; the tests only need a fresh, reproducible spread of values.
    (0..n)
        .map(|_| {
            let u1: f32 = rng.random::<f32>().max(1e-7);
            let u2: f32 = rng.random();
            std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
        })
        .collect()
}

/// Round-trips values through `dtype` so the reference sees exactly what the op sees.
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

/// A tensor's values as a flat f32 vector on the host.
pub fn host(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// The class token's attention per head, `[B, heads, len]` f32, from a fused projection `qkv`
/// `[B, len, 3·C]` as the pruners compute it with tensor ops: `q_cls · scale` and the logits in
/// the dtype of `qkv` (as its matmul rounds them), the softmax in f32.
pub fn cls_attention_by_tensor_ops(qkv: &Tensor, heads: usize, scale: f32) -> Tensor {
    use candle_core::D;
    let (b, len, c3) = qkv.dims3().unwrap();
    let (c, d) = (c3 / 3, c3 / 3 / heads);
    let q = (qkv
        .narrow(1, 0, 1)
        .unwrap()
        .narrow(2, 0, c)
        .unwrap()
        .reshape((b, heads, 1, d))
        .unwrap()
        * scale as f64)
        .unwrap();
    let k = qkv
        .narrow(2, c, c)
        .unwrap()
        .reshape((b, len, heads, d))
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .contiguous()
        .unwrap();
    let logits = q
        .matmul(&k.t().unwrap())
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let e = logits
        .broadcast_sub(&logits.max_keepdim(D::Minus1).unwrap())
        .unwrap()
        .exp()
        .unwrap();
    e.broadcast_div(&e.sum_keepdim(D::Minus1).unwrap())
        .unwrap()
        .squeeze(2)
        .unwrap()
}

/// Naive attention in f64: q, k, v as `[total, heads, dim]` row-major values.
pub fn reference(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    lengths: &[usize],
    heads: usize,
    dim: usize,
    scale: f64,
) -> Vec<f64> {
    let total: usize = lengths.iter().sum();
    let mut out = vec![0f64; total * heads * dim];
    let at = |t: usize, h: usize, d: usize| (t * heads + h) * dim + d;
    let mut start = 0;
    for &len in lengths {
        for h in 0..heads {
            for i in 0..len {
                let scores: Vec<f64> = (0..len)
                    .map(|j| {
                        (0..dim)
                            .map(|d| q[at(start + i, h, d)] as f64 * k[at(start + j, h, d)] as f64)
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let z: f64 = e.iter().sum();
                for d in 0..dim {
                    out[at(start + i, h, d)] = (0..len)
                        .map(|j| e[j] / z * v[at(start + j, h, d)] as f64)
                        .sum();
                }
            }
        }
        start += len;
    }
    out
}

/// max |got - want| / max |want|, with NaN counting as infinitely wrong.
pub fn max_rel_err(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f64, |m, w| m.max(w.abs())).max(1e-30);
    got.iter()
        .zip(want)
        .map(|(&g, &w)| {
            if g.is_finite() {
                (g as f64 - w).abs()
            } else {
                f64::INFINITY
            }
        })
        .fold(0f64, f64::max)
        / scale
}

/// max |a - b| over two tensors of the same shape (any float dtype, compared in f32 on the host),
/// NaN if any difference is NaN.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    host(a)
        .iter()
        .zip(&host(b))
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, |m, d| if d.is_nan() || d > m { d } else { m })
}

pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        _ => 1e-2,
    }
}

pub const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// The class token's attention from `qkv` as a selection's scores: ATS's significance when
/// `significance`, else EViT's mean over heads.
pub fn class_scores(qkv: &Tensor, heads: usize, scale: f32, significance: bool) -> TokenScores<'_> {
    if significance {
        TokenScores::Significance { qkv, heads, scale }
    } else {
        TokenScores::ClsAttention { qkv, heads, scale }
    }
}
