//! `block_after_attention` (a pre-norm block after its attention, with or without the next
//! block's norm1 and qkv), `block_mlp` (its MLP half), `residual_norm_linear` and `norm_linear` on the CPU, where each runs its
//! steps as one pass over chunks of rows, against the layers called one after another: bit for
//! bit, every dtype, row counts from 1 (one token) to 1,576 (DeiT-T at batch 8) across the chunk
//! sizes (8 to 64 rows), in rayon pools of 1, 3 and 16 threads (one chunk; chunks that do not
//! divide the rows; more threads than chunks), with a Linear without bias and a strided input
//! (which takes the layers' own path). CPU only: on CUDA these functions are the fused kernels
//! that `norm_linear.rs` checks.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_fastpath::{
    block_after_attention, block_mlp, norm_linear, residual_norm_linear, BlockMlp, Epilogue,
    FusedLinear, LayerNorm,
};
use common::layers::{random_layer_norm, random_linear};
use common::{column_major, host};
use rand::{rngs::StdRng, SeedableRng};

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// A block's weights after its attention and the next block's norm1 and qkv, at width `c`; fc2
/// without bias when `fc2_bias` is false.
struct Weights {
    proj: FusedLinear,
    norm2: LayerNorm,
    fc1: FusedLinear,
    fc2: FusedLinear,
    norm1: LayerNorm,
    qkv: FusedLinear,
}

impl Weights {
    fn new(rng: &mut StdRng, dtype: DType, c: usize, fc2_bias: bool) -> Self {
        let dev = &Device::Cpu;
        let s = 1.0 / (c as f32).sqrt();
        Self {
            proj: random_linear(dev, rng, dtype, (c, c), s, Some(0.2)),
            norm2: random_layer_norm(dev, rng, dtype, c),
            fc1: random_linear(dev, rng, dtype, (4 * c, c), s, Some(0.5)),
            fc2: random_linear(
                dev,
                rng,
                dtype,
                (c, 4 * c),
                s / 2.0,
                fc2_bias.then_some(0.2),
            ),
            norm1: random_layer_norm(dev, rng, dtype, c),
            qkv: random_linear(dev, rng, dtype, (3 * c, c), s, Some(0.5)),
        }
    }

    fn mlp(&self, next: bool) -> BlockMlp<'_> {
        BlockMlp {
            norm2: &self.norm2,
            fc1: &self.fc1,
            fc2: &self.fc2,
            next: next.then_some((&self.norm1, &self.qkv)),
        }
    }
}

/// `[rows, c]` rows with an offset each and a spread (so the LayerNorms' means and variances
/// both matter), in `dtype`.
fn rows_of(rng: &mut StdRng, dtype: DType, rows: usize, c: usize, std: f32) -> Tensor {
    let offsets = common::randn(rng, rows, 1.0);
    let v: Vec<f32> = common::randn(rng, rows * c, std)
        .iter()
        .enumerate()
        .map(|(i, x)| x + offsets[i / c])
        .collect();
    Tensor::from_vec(v, (rows, c), &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// The block after its attention as the layers, one call each.
fn layers(o: &Tensor, x: &Tensor, w: &Weights, next: bool) -> (Tensor, Option<Tensor>) {
    let x1 = w.proj.forward_residual(o, x).unwrap();
    let z = w.norm2.forward_checked(&x1).unwrap();
    let hidden = w.fc1.forward_with(&z, Epilogue::Gelu).unwrap();
    let y = w.fc2.forward_residual(&hidden, &x1).unwrap();
    let q = next.then(|| {
        let z = w.norm1.forward_checked(&y).unwrap();
        w.qkv.forward_with(&z, Epilogue::Plain).unwrap()
    });
    (y, q)
}

fn same(what: &str, got: &Tensor, want: &Tensor) {
    assert_eq!(got.dims(), want.dims(), "{what}");
    assert!(got.is_contiguous(), "{what}");
    let (g, w) = (host(got), host(want));
    if let Some(i) = (0..g.len()).find(|&i| g[i].to_bits() != w[i].to_bits()) {
        panic!("{what}: element {i} is {}, the layers give {}", g[i], w[i]);
    }
}

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
}

#[test]
fn after_attention_matches_the_layers() {
    let mut rng = StdRng::seed_from_u64(71);
    let c = 192;
    for dtype in DTYPES {
        let w = Weights::new(&mut rng, dtype, c, true);
        for rows in [1, 2, 7, 8, 9, 13, 63, 64, 65, 197, 577, 1576] {
            let o = rows_of(&mut rng, dtype, rows, c, 0.3);
            let x = rows_of(&mut rng, dtype, rows, c, 2.0);
            for next in [false, true] {
                let what = format!("{dtype:?} rows {rows} next {next}");
                let (want_y, want_q) = layers(&o, &x, &w, next);
                let (y, q) = block_after_attention(&o, &x, &w.proj, &w.mlp(next)).unwrap();
                same(&what, &y, &want_y);
                assert_eq!(q.is_some(), next, "{what}");
                if let (Some(q), Some(want_q)) = (q, &want_q) {
                    same(&what, &q, want_q);
                }
                // The MLP half alone, from x1 (the pruning step after the attention).
                let x1 = w.proj.forward_residual(&o, &x).unwrap();
                let (y, q) = block_mlp(&x1, &w.mlp(next)).unwrap();
                same(&what, &y, &want_y);
                if let (Some(q), Some(want_q)) = (q, &want_q) {
                    same(&what, &q, want_q);
                }
            }
        }
    }
}

#[test]
fn any_pool_and_layout_gives_the_layers() {
    let mut rng = StdRng::seed_from_u64(72);
    let c = 64;
    for threads in [1, 3, 16] {
        let pool = pool(threads);
        for dtype in DTYPES {
            // fc2 without bias: the chunks' product takes no bias there.
            let w = Weights::new(&mut rng, dtype, c, false);
            for rows in [1, 5, 17, 100, 197, 1000] {
                let what = format!("{threads} threads {dtype:?} rows {rows}");
                // Leading dims kept: [1, rows, c].
                let o = rows_of(&mut rng, dtype, rows, c, 0.3).unsqueeze(0).unwrap();
                let x = rows_of(&mut rng, dtype, rows, c, 2.0).unsqueeze(0).unwrap();
                pool.install(|| {
                    let (want_y, want_q) = layers(&o, &x, &w, true);
                    let (y, q) = block_after_attention(&o, &x, &w.proj, &w.mlp(true)).unwrap();
                    same(&what, &y, &want_y);
                    same(&what, &q.unwrap(), &want_q.unwrap());

                    // residual_norm_linear: proj into norm2 → fc1 + GELU, and fc2 into qkv.
                    let (x1, h) =
                        residual_norm_linear(&o, &x, &w.proj, &w.norm2, &w.fc1, true).unwrap();
                    let want_x1 = w.proj.forward_residual(&o, &x).unwrap();
                    let z = w.norm2.forward_checked(&want_x1).unwrap();
                    same(&what, &x1, &want_x1);
                    same(&what, &h, &w.fc1.forward_with(&z, Epilogue::Gelu).unwrap());
                    let (y2, q2) =
                        residual_norm_linear(&h, &x1, &w.fc2, &w.norm1, &w.qkv, false).unwrap();
                    same(&what, &y2, &want_y);
                    let z = w.norm1.forward_checked(&want_y).unwrap();
                    same(
                        &what,
                        &q2,
                        &w.qkv.forward_with(&z, Epilogue::Plain).unwrap(),
                    );

                    // norm_linear, with and without the GELU.
                    for gelu in [false, true] {
                        let epi = if gelu {
                            Epilogue::Gelu
                        } else {
                            Epilogue::Plain
                        };
                        let z = w.norm2.forward_checked(&x).unwrap();
                        let want = w.fc1.forward_with(&z, epi).unwrap();
                        same(
                            &what,
                            &norm_linear(&x, &w.norm2, &w.fc1, gelu).unwrap(),
                            &want,
                        );
                    }

                    // A strided o (a transposed copy read back transposed): the layers' path.
                    let o_t = column_major(&o.squeeze(0).unwrap());
                    assert!(rows == 1 || !o_t.is_contiguous());
                    let (y, _) =
                        block_after_attention(&o_t, &x.squeeze(0).unwrap(), &w.proj, &w.mlp(false))
                            .unwrap();
                    same(&what, &y, &want_y.squeeze(0).unwrap());
                });
            }
        }
    }
}

#[test]
fn bad_inputs_are_clear_errors() {
    let mut rng = StdRng::seed_from_u64(73);
    let (c, rows) = (64, 10);
    let w = Weights::new(&mut rng, DType::F32, c, true);
    let o = rows_of(&mut rng, DType::F32, rows, c, 0.3);
    let x = rows_of(&mut rng, DType::F32, rows, c, 2.0);
    let mlp = w.mlp(true);
    let cases: [(&str, Tensor, Tensor); 4] = [
        (
            "o of another width",
            rows_of(&mut rng, DType::F32, rows, c + 1, 1.0),
            x.clone(),
        ),
        (
            "o with other rows",
            rows_of(&mut rng, DType::F32, rows + 1, c, 1.0),
            x.clone(),
        ),
        (
            "x of another dtype",
            o.clone(),
            x.to_dtype(DType::F16).unwrap(),
        ),
        (
            "no rows",
            o.narrow(0, 0, 0).unwrap(),
            x.narrow(0, 0, 0).unwrap(),
        ),
    ];
    for (what, o, x) in cases {
        let err = block_after_attention(&o, &x, &w.proj, &mlp);
        assert!(err.is_err(), "{what}: expected an error");
    }
    // A next qkv of another width than the block: an error from its layer, not a panic.
    let wide = random_linear(
        &Device::Cpu,
        &mut rng,
        DType::F32,
        (3 * c, c + 8),
        0.1,
        None,
    );
    let bad = BlockMlp {
        next: Some((&w.norm1, &wide)),
        ..mlp
    };
    assert!(block_after_attention(&o, &x, &w.proj, &bad).is_err());
    assert!(block_mlp(&x, &bad).is_err());
}
