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
use common::layers::{random_layer_norm, random_linear};
use common::{cluster_kernels_expected, device, host, randn};
use rand::{rngs::StdRng, SeedableRng};

const C: usize = 384;
const HEADS: usize = 6;
const BLOCKS: usize = 2;

/// One block's layers, random: qkv, proj, fc1, fc2 and the LayerNorms after attention (norm2) and
/// after the MLP (the next block's norm1).
struct Block {
    qkv: FusedLinear,
    proj: FusedLinear,
    fc1: FusedLinear,
    fc2: FusedLinear,
    norm2: LayerNorm,
    norm1_next: LayerNorm,
}

impl Block {
    fn new(dev: &Device, rng: &mut StdRng, dtype: DType) -> Self {
        let linear = |rng: &mut StdRng, out: usize, inp: usize| {
            let w_std = 1.0 / (inp as f32).sqrt();
            random_linear(dev, rng, dtype, (out, inp), w_std, Some(0.2))
        };
        Self {
            qkv: linear(rng, 3 * C, C),
            proj: linear(rng, C, C),
            fc1: linear(rng, 4 * C, C),
            fc2: linear(rng, C, 4 * C),
            norm2: random_layer_norm(dev, rng, dtype, C),
            norm1_next: random_layer_norm(dev, rng, dtype, C),
        }
    }

    /// The block on the residual stream `x` and its norm1 output `z` (both `[M, C]`), one
    /// sequence of M tokens (`cu_seqlens` = [0, M]): the next block's `(x, z)`.
    fn forward(
        &self,
        x: &Tensor,
        z: &Tensor,
        cu: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let qkv = self.qkv.forward(z)?;
        let scale = (C as f64 / HEADS as f64).powf(-0.5);
        let (x1, z2) =
            attention_linear_residual_norm(&qkv, cu, HEADS, scale, x, &self.proj, &self.norm2)?;
        let h = self.fc1.forward_gelu(&z2)?;
        Ok(linear_residual_norm(&h, &x1, &self.fc2, &self.norm1_next)?)
    }
}

fn chain(blocks: &[Block], xs: &[Tensor]) -> candle_core::Result<Vec<Tensor>> {
    let (mut x, mut z) = (xs[0].clone(), xs[1].clone());
    for b in blocks {
        (x, z) = b.forward(&x, &z, &xs[2])?;
    }
    Ok(vec![x, z])
}

#[test]
fn captured_blocks_launch_early_and_replay_exactly() {
    let dev = device();
    // The chain of fused DeiT-S kernels this counts exists where they all fit (its fc2 form
    // needs 144 KB of shared memory a block).
    if !dev.is_cuda() || cluster_kernels_expected(&dev) != Some(true) {
        return;
    }
    let pdl = candle_fastpath::programmatic_edges_enabled();
    let mut rng = StdRng::seed_from_u64(124);
    for dtype in [DType::F16, DType::BF16] {
        let blocks: Vec<Block> = (0..BLOCKS)
            .map(|_| Block::new(&dev, &mut rng, dtype))
            .collect();
        for m in [197usize, 65, 1] {
            let inputs = |rng: &mut StdRng| -> Vec<Tensor> {
                vec![
                    tensor(&dev, &randn(rng, m * C, 2.0), &[m, C], dtype),
                    tensor(&dev, &randn(rng, m * C, 1.0), &[m, C], dtype),
                    Tensor::from_slice(&[0u32, m as u32], 2, &dev).unwrap(),
                ]
            };
            let example = inputs(&mut rng);
            let captured =
                CapturedForward::capture_many(&example, |xs| chain(&blocks, xs)).unwrap();
            let what = format!("{dtype:?} M {m}");
            let nodes = captured.nodes().unwrap();
            // Four kernels a block, the first after the input copies (memcpy nodes): every
            // other one follows a kernel.
            assert_eq!(nodes.kernels, 4 * BLOCKS, "{what}: {nodes}");
            let want = if pdl { 4 * BLOCKS - 1 } else { 0 };
            assert_eq!(nodes.programmatic_edges, want, "{what}: {nodes}");
            for replay in 0..4 {
                let xs = inputs(&mut rng);
                let want: Vec<Vec<f32>> = chain(&blocks, &xs).unwrap().iter().map(host).collect();
                for out in captured.outputs() {
                    poison_in_place(out);
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

/// NaN into every element of a graph output, in place (its buffer is the graph's own, so the
/// replay must overwrite it).
fn poison_in_place(out: &Tensor) {
    let nan = Tensor::full(f32::NAN, out.shape(), out.device())
        .and_then(|t| t.to_dtype(out.dtype()))
        .unwrap();
    out.slice_set(&nan, 0, 0).unwrap();
}
