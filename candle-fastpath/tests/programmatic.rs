//! Programmatic edges (lever 124): a CUDA graph of DeiT-S batch-1 blocks as the model runs them
//! (qkv on the thin GEMM, `attention_linear_residual_norm`, fc1 + GELU on the thin GEMM, fc2 with
//! its residual and the next norm1 in `linear_residual_norm`'s cluster kernel) gets a programmatic
//! edge into every one of those kernels that follows another kernel, and replays exactly what the
//! eager chain computes: launched that way the kernels ask for their weights before
//! `griddepcontrol.wait` and read activations after it (lever 125: eager launches keep their old
//! load order), so neither an early start nor the order may change a bit. Fresh random inputs each
//! replay, f16 and bf16, sequences of 197 (DeiT-S), 65 and 1 tokens; the graph's outputs are
//! poisoned (NaN) before each replay. `CANDLE_FASTPATH_PDL=0`: no programmatic edge. Runs where
//! the fused kernels apply (CUDA, compute capability 9.0); elsewhere it returns at once (CI's CPU
//! checks the capture's CPU error in tests/graph.rs).

mod common;

use candle_core::{DType, Device, Module, Tensor};
use candle_fastpath::{
    attention_linear_residual_norm, linear_residual_norm, CapturedForward, FusedLinear, LayerNorm,
};
use common::attention::tensor;
use common::{device, has_clusters, host, randn};
use rand::{rngs::StdRng, SeedableRng};

const HEAD_DIM: usize = 64;

fn linear(dev: &Device, rng: &mut StdRng, dtype: DType, out: usize, inp: usize) -> FusedLinear {
    let w = tensor(
        dev,
        &randn(rng, out * inp, 1.0 / (inp as f32).sqrt()),
        &[out, inp],
        dtype,
    );
    let b = tensor(dev, &randn(rng, out, 0.2), &[out], dtype);
    FusedLinear::new(w, Some(b)).unwrap()
}

fn norm(dev: &Device, rng: &mut StdRng, dtype: DType, c: usize) -> LayerNorm {
    let gamma: Vec<f32> = randn(rng, c, 0.3).iter().map(|g| 1.0 + g).collect();
    LayerNorm::new(
        tensor(dev, &gamma, &[c], dtype),
        tensor(dev, &randn(rng, c, 0.2), &[c], dtype),
        1e-6,
    )
    .unwrap()
}

/// One block's layers at width `c`, random: qkv, proj, fc1, fc2 and the LayerNorms after the
/// attention (norm2) and after the MLP (the next block's norm1).
struct Block {
    qkv: FusedLinear,
    proj: FusedLinear,
    fc1: FusedLinear,
    fc2: FusedLinear,
    norm2: LayerNorm,
    norm1_next: LayerNorm,
}

impl Block {
    fn new(dev: &Device, rng: &mut StdRng, dtype: DType, c: usize) -> Self {
        Self {
            qkv: linear(dev, rng, dtype, 3 * c, c),
            proj: linear(dev, rng, dtype, c, c),
            fc1: linear(dev, rng, dtype, 4 * c, c),
            fc2: linear(dev, rng, dtype, c, 4 * c),
            norm2: norm(dev, rng, dtype, c),
            norm1_next: norm(dev, rng, dtype, c),
        }
    }

    /// DeiT-S's batch-1 block (C = 384) on the residual stream `x` and its norm1 output `z` (both
    /// `[M, C]`), one sequence of M tokens (`cu_seqlens` = [0, M]): the next block's `(x, z)`.
    fn forward(
        &self,
        x: &Tensor,
        z: &Tensor,
        cu: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let qkv = self.qkv.forward(z)?;
        let scale = (HEAD_DIM as f64).powf(-0.5);
        let (x1, z2) =
            attention_linear_residual_norm(&qkv, cu, 6, scale, x, &self.proj, &self.norm2)?;
        let h = self.fc1.forward_gelu(&z2)?;
        Ok(linear_residual_norm(&h, &x1, &self.fc2, &self.norm1_next)?)
    }
}

/// Two DeiT-S blocks: inputs (x, z, cu_seqlens), outputs the last block's (x, z). Four kernels a
/// block.
fn chain_blocks(blocks: &[Block], xs: &[Tensor]) -> candle_core::Result<Vec<Tensor>> {
    let (mut x, mut z) = (xs[0].clone(), xs[1].clone());
    for b in blocks {
        (x, z) = b.forward(&x, &z, &xs[2])?;
    }
    Ok(vec![x, z])
}

/// Captures `chain` at M rows for each dtype, checks its kernel and programmatic-edge counts, and
/// replays it four times on fresh inputs (`inputs`) into poisoned outputs, each bit for bit the
/// eager chain's result.
fn captured_chain_replays_exactly(
    c: usize,
    blocks: usize,
    chain: fn(&[Block], &[Tensor]) -> candle_core::Result<Vec<Tensor>>,
    input_widths: [usize; 2],
    kernels: usize,
) {
    let dev = device();
    if !dev.is_cuda() || !has_clusters(&dev) {
        return;
    }
    let pdl = candle_fastpath::programmatic_edges_enabled();
    let mut rng = StdRng::seed_from_u64(124);
    for dtype in [DType::F16, DType::BF16] {
        let layers: Vec<Block> = (0..blocks)
            .map(|_| Block::new(&dev, &mut rng, dtype, c))
            .collect();
        for m in [197usize, 65, 1] {
            let inputs = |rng: &mut StdRng| -> Vec<Tensor> {
                let [a, b] = input_widths;
                vec![
                    tensor(&dev, &randn(rng, m * a, 2.0), &[m, a], dtype),
                    tensor(&dev, &randn(rng, m * b, 1.0), &[m, b], dtype),
                    Tensor::from_slice(&[0u32, m as u32], 2, &dev).unwrap(),
                ]
            };
            let example = inputs(&mut rng);
            let captured =
                CapturedForward::capture_many(&example, |xs| chain(&layers, xs)).unwrap();
            let what = format!("C {c} {dtype:?} M {m}");
            let nodes = captured.nodes().unwrap();
            // The first kernel follows the input copies (memcpy nodes): every other one follows a
            // kernel.
            assert_eq!(nodes.kernels, kernels, "{what}: {nodes}");
            let want = if pdl { kernels - 1 } else { 0 };
            assert_eq!(nodes.programmatic_edges, want, "{what}: {nodes}");
            for replay in 0..4 {
                let xs = inputs(&mut rng);
                let want: Vec<Vec<f32>> = chain(&layers, &xs).unwrap().iter().map(host).collect();
                for out in captured.outputs() {
                    out.inplace_op1(&Poison).unwrap();
                }
                let refs: Vec<&Tensor> = xs.iter().collect();
                captured.replay_many(&refs).unwrap();
                for (i, (out, want)) in captured.outputs().iter().zip(&want).enumerate() {
                    let got = host(out);
                    let same = got
                        .iter()
                        .zip(want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{what}: replay {replay}, output {i} differs from eager"
                    );
                }
            }
        }
    }
}

#[test]
fn captured_deit_s_blocks_launch_early_and_replay_exactly() {
    captured_chain_replays_exactly(384, 2, chain_blocks, [384, 384], 8);
}

/// NaN into every element of a tensor in place (a graph output before a replay).
struct Poison;

impl candle_core::InplaceOp1 for Poison {
    fn name(&self) -> &'static str {
        "poison"
    }

    fn cpu_fwd(
        &self,
        _: &mut candle_core::CpuStorage,
        _: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        candle_core::bail!("poison: CUDA only")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &mut candle_core::CudaStorage,
        l: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::cudarc::driver::DevicePtrMut;
        let elem = s.dtype().size_in_bytes();
        let (bytes, offset) = (l.shape().elem_count() * elem, l.start_offset() * elem);
        let stream = s.device.cuda_stream();
        let (ptr, _guard) = match s.dtype() {
            DType::F16 => s.as_cuda_slice_mut::<half::f16>()?.device_ptr_mut(&stream),
            DType::BF16 => s.as_cuda_slice_mut::<half::bf16>()?.device_ptr_mut(&stream),
            d => candle_core::bail!("poison: {d:?}"),
        };
        // SAFETY: the range lies inside the tensor's storage (contiguous from its offset);
        // 0xFF bytes are NaN in f16 and bf16.
        let r = unsafe {
            candle_core::cuda_backend::cudarc::driver::sys::cuMemsetD8Async(
                ptr + offset as u64,
                0xFF,
                bytes,
                stream.cu_stream(),
            )
        };
        if r != candle_core::cuda_backend::cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            candle_core::bail!("poison: {r:?}");
        }
        Ok(())
    }
}
