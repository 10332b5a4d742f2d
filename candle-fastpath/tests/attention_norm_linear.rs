//! `attention_residual_norm_linear` (one sequence's attention from its fused qkv, then the output
//! projection with its residual, norm2, fc1 and the GELU, one cluster kernel on compute
//! capability 9.0) against the steps it replaces: a plain host attention (f64, over the rows as
//! rounded to the storage type), its output rounded to the storage type as the attention kernel
//! stores it, then `FusedLinear::forward_residual`, the LayerNorm and the Linear. Fresh random
//! inputs, f16 and bf16, sequence lengths 1, 2, 15-17, 63-65, 138, 197 and 352 (the one-wave
//! limit on the H100), buffers of more rows than the sequence (their tail NaN), and the output
//! memory poisoned (NaN) before each call. Built with `cuda` on a GPU with clusters the kernel
//! must apply to all of them; elsewhere (CI's CPU) it must not, and calling it is a clear error.
//! The same for `attention_block` (the attention through the next block's qkv) against
//! `attention_residual_norm_linear` and `residual_norm_linear`, and for `mlp_block` (a block's
//! MLP half through the next block's qkv) against `norm_linear` and `residual_norm_linear`;
//! `select_mlp_block` and `select_attention_block` (a pruning step at the head of those kernels)
//! against candle-ragged's selection and then the kernel.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_fastpath::{
    attention_block, attention_block_applies, attention_block_with_norms, attention_residual,
    attention_residual_applies, attention_residual_norm_linear,
    attention_residual_norm_linear_applies, attention_residual_with_cls_probs, mlp_block,
    mlp_block_applies, norm_linear, norm_linear_applies, residual_norm_linear,
    select_attention_block, select_attention_block_applies, select_attention_block_with_norms,
    select_mlp_block, select_mlp_block_applies, BlockTail, Epilogue, FastpathError, FusedLinear,
    LayerNorm, MlpTail,
};
use candle_ragged::{step_scores, StepScores, TokenScores};
use common::attention::{
    assert_rows_close, attention_host, expect_applies, fused_or_refused, sequence, sequence_cases,
    tensor, under_test, RefusalInputs, HEAD_DIM,
};
use common::layers::{random_layer_norm, random_linear};
use common::{cluster_kernels_expected, device, host, poison, randn};
use rand::{rngs::StdRng, SeedableRng};

const C: usize = 192;
const HEADS: usize = 3;

struct Weights {
    proj: FusedLinear,
    norm: LayerNorm,
    fc1: FusedLinear,
}

fn weights(dev: &Device, rng: &mut StdRng, dtype: DType, n: usize) -> Weights {
    let w_std = 1.0 / (C as f32).sqrt();
    let proj = random_linear(dev, rng, dtype, (C, C), w_std, Some(0.5));
    let norm = random_layer_norm(dev, rng, dtype, C);
    let fc1 = random_linear(dev, rng, dtype, (n, C), w_std, Some(0.5));
    Weights { proj, norm, fc1 }
}

/// `x2` and the next qkv of a fused block step equal, bit for bit and finite, to what the two
/// kernels it joins give.
fn assert_same_bits(what: &str, got: (&Tensor, &Tensor), want: (&Tensor, &Tensor)) {
    for (part, got, want) in [
        ("x2", host(got.0), host(want.0)),
        ("next qkv", host(got.1), host(want.1)),
    ] {
        for (i, (g, e)) in got.iter().zip(want.iter()).enumerate() {
            assert!(
                g.is_finite() && g.to_bits() == e.to_bits(),
                "{what}: {part} element {i} is {g}, the two kernels give {e}"
            );
        }
    }
}

/// A block's MLP half (norm2, fc1 of 4C, fc2) and the next block's norm1 and qkv, random (drawn
/// in that order): what `mlp_block` and `select_mlp_block` take, as [`Self::tail`].
struct MlpWeights {
    block: Weights,
    fc2: FusedLinear,
    next: Weights,
}

impl MlpWeights {
    fn new(dev: &Device, rng: &mut StdRng, dtype: DType) -> Self {
        let block = weights(dev, rng, dtype, 4 * C);
        let fc2 = fc2_layer(dev, rng, dtype);
        let next = weights(dev, rng, dtype, 3 * C);
        Self { block, fc2, next }
    }

    /// The whole block after its attention: `proj`, then this MLP half and the next block's
    /// norm1 and qkv (what `attention_block` and `select_attention_block` take).
    fn block_tail<'a>(&'a self, proj: &'a FusedLinear) -> BlockTail<'a> {
        BlockTail {
            proj,
            norm2: &self.block.norm,
            fc1: &self.block.fc1,
            fc2: &self.fc2,
            next_norm1: &self.next.norm,
            next_qkv: &self.next.fc1,
        }
    }

    fn tail(&self) -> MlpTail<'_> {
        MlpTail {
            norm2: &self.block.norm,
            fc1: &self.block.fc1,
            fc2: &self.fc2,
            next_norm1: &self.next.norm,
            next_qkv: &self.next.fc1,
        }
    }
}

/// A step test's case over `len` tokens (one prefix token): given scores `[1, len]` (random, with
/// a NaN and a tie past 4 tokens) and the keeps to try (~0.7 of the patches only when `quick`,
/// else 1, half, ~0.7 and every patch).
fn step_case(dev: &Device, rng: &mut StdRng, len: usize, quick: bool) -> (Tensor, Vec<usize>) {
    let mut given = randn(rng, len, 1.0);
    if len > 4 {
        given[3] = f32::NAN;
        given[2] = given[len - 1];
    }
    let given = Tensor::from_slice(&given, (1, len), dev).unwrap();
    let patches = len - 1;
    let keeps = if quick {
        vec![(patches * 7).div_ceil(10)]
    } else {
        vec![1, patches.div_ceil(2), (patches * 7).div_ceil(10), patches]
    };
    (given, keeps)
}

/// Scores for the bad-input checks of a step kernel over `x` (20 tokens): `x`'s own (given), and
/// two that are not one sequence of its tokens (10 tokens' scores, and `x`'s as two sequences).
fn step_scores_and_wrong_ones(
    dev: &Device,
    rng: &mut StdRng,
    x: &Tensor,
) -> (StepScores, [(&'static str, StepScores); 2]) {
    let s20 = Tensor::from_slice(&randn(rng, 20, 1.0), (1, 20), dev).unwrap();
    let step = step_scores(x, 1, TokenScores::Given(&s20)).unwrap();
    let s10 = Tensor::from_slice(&randn(rng, 10, 1.0), (1, 10), dev).unwrap();
    let x10 = x.narrow(0, 0, 10).unwrap();
    let other = step_scores(&x10, 1, TokenScores::Given(&s10)).unwrap();
    let two = step_scores(x, 2, TokenScores::Given(&s20.reshape((2, 10)).unwrap())).unwrap();
    (step, [("10 tokens' scores", other), ("two sequences", two)])
}

/// A block's fc2, `[C, 4C]` with its bias, random (scaled so that its outputs stay a few units).
fn fc2_layer(dev: &Device, rng: &mut StdRng, dtype: DType) -> FusedLinear {
    let w_std = 0.5 / (C as f32).sqrt();
    random_linear(dev, rng, dtype, (C, 4 * C), w_std, Some(0.5))
}

#[test]
fn matches_attention_then_the_steps() {
    let dev = device();
    let expected = cluster_kernels_expected(&dev);
    let mut rng = StdRng::seed_from_u64(64);
    let scale = (HEAD_DIM as f64).powf(-0.5);
    let full = sequence_cases(352);
    let (dtypes, cases) = under_test(&full);
    for &dtype in dtypes {
        for gelu in [true, false] {
            let w = weights(&dev, &mut rng, dtype, 4 * C);
            for &(rows, len) in cases {
                let (qkv, qkv_t, r_t, cu) = sequence(&dev, &mut rng, dtype, rows, len, C);

                let o = attention_host(&dev, &qkv, len, C, HEADS, scale, dtype);
                let want_x1 = w
                    .proj
                    .forward_residual(&o, &r_t.narrow(0, 0, len).unwrap())
                    .unwrap();
                let epilogue = if gelu {
                    Epilogue::Gelu
                } else {
                    Epilogue::Plain
                };
                let want_y = host(
                    &w.fc1
                        .forward_with(&w.norm.forward_checked(&want_x1).unwrap(), epilogue)
                        .unwrap(),
                );
                let want_x1 = host(&want_x1);

                let applies = attention_residual_norm_linear_applies(
                    &qkv_t, &cu, HEADS, &r_t, &w.proj, &w.norm, &w.fc1, gelu,
                );
                let what = format!("{dtype:?} rows {rows} len {len} gelu {gelu}");
                expect_applies(expected, applies, &what);
                poison(&dev, rows * (C + 4 * C), dtype);
                let got = attention_residual_norm_linear(
                    &qkv_t, &cu, HEADS, scale, &r_t, &w.proj, &w.norm, &w.fc1, gelu,
                );
                let Some((x1, y)) = fused_or_refused(got, applies, &what) else {
                    continue;
                };
                assert_eq!(x1.dims(), &[rows, C]);
                assert_eq!(y.dims(), &[rows, 4 * C]);
                // The attention output may land one rounding of the storage type away (another
                // summation order), which the projection spreads over x1 and the LayerNorm
                // over y; then y's own GEMM order.
                let (tol_x1, tol_y) = match dtype {
                    DType::F16 => (2e-3, 8e-3),
                    _ => (1.6e-2, 6e-2),
                };
                let (x1, y) = (host(&x1), host(&y));
                assert_rows_close(&what, "x1", (&x1, &want_x1), len, C, tol_x1);
                assert_rows_close(&what, "y", (&y, &want_y), len, 4 * C, tol_y);
            }
        }
    }
}

#[test]
fn shapes_it_does_not_take_are_refused() {
    let dev = device();
    let mut rng = StdRng::seed_from_u64(65);
    let w = weights(&dev, &mut rng, DType::F16, 4 * C);
    let refusals = RefusalInputs::new(&dev, &mut rng, C);
    let (qkv, r, r_big) = (&refusals.qkv, &refusals.r, &refusals.r_big);
    let refused = |qkv: &Tensor, cu: &Tensor, heads: usize, r: &Tensor, fc1: &FusedLinear| {
        assert!(!attention_residual_norm_linear_applies(
            qkv, cu, heads, r, &w.proj, &w.norm, fc1, true
        ));
        let got =
            attention_residual_norm_linear(qkv, cu, heads, 0.125, r, &w.proj, &w.norm, fc1, true);
        fused_or_refused(got, false, "attention_residual_norm_linear");
    };
    refusals.each_common_refusal(HEADS, C, |qkv, cu, heads, r| {
        refused(qkv, cu, heads, r, &w.fc1)
    });
    // And fc1 of another width (not the proj form).
    let narrow_fc1 = weights(&dev, &mut rng, DType::F16, 3 * C).fc1;
    refused(qkv, &refusals.one, HEADS, r, &narrow_fc1);

    // mlp_block: fc1 not 4C wide (a qkv-shaped weight), x1 of another dtype, a non-contiguous
    // x1, x1 of another width, the one-wave limit.
    let fc2 = fc2_layer(&dev, &mut rng, DType::F16);
    let next = weights(&dev, &mut rng, DType::F16, 3 * C);
    let narrow_fc1 = weights(&dev, &mut rng, DType::F16, 3 * C);
    let tail = |fc1| MlpTail {
        norm2: &w.norm,
        fc1,
        fc2: &fc2,
        next_norm1: &next.norm,
        next_qkv: &next.fc1,
    };
    let mlp_refused = |x1: &Tensor, t: &MlpTail| {
        assert!(!mlp_block_applies(x1, t));
        fused_or_refused(mlp_block(x1, t), false, "mlp_block");
    };
    mlp_refused(r, &tail(&narrow_fc1.fc1));
    mlp_refused(&r.to_dtype(DType::F32).unwrap(), &tail(&w.fc1));
    mlp_refused(&qkv.narrow(1, 0, C).unwrap(), &tail(&w.fc1));
    mlp_refused(qkv, &tail(&w.fc1));
    mlp_refused(r_big, &tail(&w.fc1));
}

/// `attention_block` (lever 65: the attention kernel continuing into fc2 and the next block's
/// norm1 + qkv) against the two kernels it joins, `attention_residual_norm_linear` and then
/// `residual_norm_linear`'s fc2 form, which this file and norm_linear.rs check against plain
/// steps: the same arithmetic in the same order, so the results must agree to the bit (rows past
/// the sequence included). On the CPU it must refuse.
#[test]
fn block_matches_the_two_kernels() {
    let dev = device();
    let expected = cluster_kernels_expected(&dev);
    let mut rng = StdRng::seed_from_u64(66);
    let scale = (HEAD_DIM as f64).powf(-0.5);
    let (dtypes, cases) = under_test(&[
        (1, 1),
        (17, 17),
        (65, 65),
        (138, 138),
        (197, 197),
        (352, 352),
        (197, 190),
        (70, 64),
    ]);
    for &dtype in dtypes {
        let w = weights(&dev, &mut rng, dtype, 4 * C);
        let fc2 = fc2_layer(&dev, &mut rng, dtype);
        let next = weights(&dev, &mut rng, dtype, 3 * C);
        let tail = BlockTail {
            proj: &w.proj,
            norm2: &w.norm,
            fc1: &w.fc1,
            fc2: &fc2,
            next_norm1: &next.norm,
            next_qkv: &next.fc1,
        };
        for &(rows, len) in cases {
            let (_, qkv_t, r_t, cu) = sequence(&dev, &mut rng, dtype, rows, len, C);
            let what = format!("{dtype:?} rows {rows} len {len}");
            let applies = attention_block_applies(&qkv_t, &cu, HEADS, &r_t, &tail);
            expect_applies(expected, applies, &what);
            poison(&dev, rows * (C + 3 * C), dtype);
            let got = attention_block(&qkv_t, &cu, HEADS, scale, &r_t, &tail);
            let Some((x2, next_qkv)) = fused_or_refused(got, applies, &what) else {
                let with_norms = attention_block_with_norms(&qkv_t, &cu, HEADS, scale, &r_t, &tail);
                fused_or_refused(with_norms, false, &format!("{what}, with norms"));
                continue;
            };
            assert_eq!(x2.dims(), &[rows, C]);
            assert_eq!(next_qkv.dims(), &[rows, 3 * C]);
            let (x1, hidden) = attention_residual_norm_linear(
                &qkv_t, &cu, HEADS, scale, &r_t, &w.proj, &w.norm, &w.fc1, true,
            )
            .unwrap();
            let (want_x2, want_qkv) =
                residual_norm_linear(&hidden, &x1, &fc2, &next.norm, &next.fc1, false).unwrap();
            assert_same_bits(&what, (&x2, &next_qkv), (&want_x2, &want_qkv));
            check_row_norms(
                &dev,
                &qkv_t,
                &cu,
                scale,
                &r_t,
                &tail,
                (&x2, &next_qkv),
                &what,
            );
        }
    }
}

/// `attention_block_with_norms` (lever 77): the same x2 and next qkv as `attention_block`, and
/// x2's row L2 norms, which must be the bits candle-ragged's select kernel computes for a
/// Threshold-L2 step (a step ranking the given norms keeps the same tokens). Checked through
/// `select_top_k_by` with a weighted-sum fused row and one token kept: the fused row sums every
/// other row times its score, so the outputs from the kernel's own norms (`RowL2Norm`) and from
/// these (`Given`) are equal to the bit only if every norm is. Also within 1e-5 of a host
/// `sqrt(Σ x²)` over the stored values.
#[allow(clippy::too_many_arguments)]
fn check_row_norms(
    dev: &Device,
    qkv: &Tensor,
    cu: &Tensor,
    scale: f64,
    r: &Tensor,
    tail: &BlockTail,
    plain: (&Tensor, &Tensor),
    what: &str,
) {
    use candle_ragged::{select_top_k_by, DroppedFusion};
    let rows = r.dim(0).unwrap();
    poison(dev, rows * (C + 3 * C) + rows, r.dtype());
    let (x2, next_qkv, norms) = attention_block_with_norms(qkv, cu, HEADS, scale, r, tail).unwrap();
    assert_same_bits(&format!("{what}, with norms"), (&x2, &next_qkv), plain);
    assert_eq!(norms.dims(), &[rows]);
    assert_eq!(norms.dtype(), DType::F32);
    let got = norms.to_vec1::<f32>().unwrap();
    let x = host(&x2);
    for (i, g) in got.iter().enumerate() {
        let want = x[i * C..(i + 1) * C]
            .iter()
            .map(|&v| (v as f64) * (v as f64))
            .sum::<f64>()
            .sqrt();
        assert!(
            g.is_finite() && ((*g as f64) - want).abs() <= 1e-5 * want.max(1e-3),
            "{what}: row {i} norm {g}, host {want}"
        );
    }
    if rows < 3 {
        return; // no token to drop besides the one kept
    }
    let select = |scores| {
        let fused = Some(DroppedFusion::WeightedSum);
        let (out, _) = select_top_k_by(&x2, 1, scores, 1, 1, fused).unwrap();
        host(&out)
    };
    let given = norms.reshape((1, rows)).unwrap();
    let from_norms = select(TokenScores::Given(&given));
    let own = select(TokenScores::RowL2Norm);
    for (i, (g, e)) in from_norms.iter().zip(own.iter()).enumerate() {
        assert!(
            g.to_bits() == e.to_bits(),
            "{what}: select from the block's norms gives {g} at element {i}, from its own {e}"
        );
    }
}

/// `mlp_block` (lever 72: norm2 → fc1 → GELU → fc2 + residual → the next norm1 → qkv, one
/// launch) gives exactly what `norm_linear` (with the GELU) and then `residual_norm_linear`'s fc2
/// form give, at row counts from 1 to 352 (partial row tiles included), outputs poisoned before
/// the call; elsewhere it does not apply and calling it is a clear error.
#[test]
fn mlp_block_matches_the_two_kernels() {
    let dev = device();
    let expected = cluster_kernels_expected(&dev);
    let mut rng = StdRng::seed_from_u64(72);
    let (dtypes, _) = under_test(&[]);
    let rows_under_test: &[usize] = if dtypes.len() == 1 {
        &[139]
    } else {
        &[1, 2, 17, 64, 65, 139, 197, 352]
    };
    for &dtype in dtypes {
        let mlp = MlpWeights::new(&dev, &mut rng, dtype);
        let tail = mlp.tail();
        for &rows in rows_under_test {
            let what = format!("{dtype:?} rows {rows}");
            let x1 = tensor(&dev, &randn(&mut rng, rows * C, 3.0), &[rows, C], dtype);
            let applies = mlp_block_applies(&x1, &tail);
            expect_applies(expected, applies, &what);
            poison(&dev, rows * (C + 3 * C), dtype);
            let got = mlp_block(&x1, &tail);
            let Some((x2, next_qkv)) = fused_or_refused(got, applies, &what) else {
                continue;
            };
            assert_eq!(x2.dims(), &[rows, C]);
            assert_eq!(next_qkv.dims(), &[rows, 3 * C]);
            // The reference is the two fused kernels (the same arithmetic in the same order).
            assert!(
                norm_linear_applies(&x1, tail.norm2, tail.fc1, true),
                "{what}"
            );
            let hidden = norm_linear(&x1, tail.norm2, tail.fc1, true).unwrap();
            let (want_x2, want_qkv) = residual_norm_linear(
                &hidden,
                &x1,
                tail.fc2,
                tail.next_norm1,
                tail.next_qkv,
                false,
            )
            .unwrap();
            assert_same_bits(&what, (&x2, &next_qkv), (&want_x2, &want_qkv));
        }
    }
}

/// `attention_residual` (lever 86: the attention kernel stopping at x1, for a step right after
/// the attention) gives x1 bit for bit as `attention_residual_norm_linear` does (the same
/// kernel and arithmetic up to x1), over the cases of the block test (rows past the sequence
/// included), outputs poisoned first; on the CPU it does not apply and calling it is a clear
/// error; and it refuses what it does not take (two sequences, heads of another width, the
/// one-wave limit, a projection without its bias).
#[test]
fn attention_residual_is_the_fused_kernels_x1() {
    let dev = device();
    let expected = cluster_kernels_expected(&dev);
    let mut rng = StdRng::seed_from_u64(86);
    let scale = (HEAD_DIM as f64).powf(-0.5);
    let (dtypes, cases) = under_test(&[
        (1, 1),
        (2, 2),
        (17, 17),
        (63, 63),
        (64, 64),
        (65, 65),
        (138, 138),
        (197, 197),
        (352, 352),
        (197, 190),
        (70, 64),
    ]);
    for &dtype in dtypes {
        let w = weights(&dev, &mut rng, dtype, 4 * C);
        for &(rows, len) in cases {
            let (_, qkv_t, r_t, cu) = sequence(&dev, &mut rng, dtype, rows, len, C);
            let what = format!("{dtype:?} rows {rows} len {len}");
            let applies = attention_residual_applies(&qkv_t, &cu, HEADS, &r_t, &w.proj);
            expect_applies(expected, applies, &what);
            poison(&dev, rows * C, dtype);
            let got = attention_residual(&qkv_t, &cu, HEADS, scale, &r_t, &w.proj);
            let Some(x1) = fused_or_refused(got, applies, &what) else {
                continue;
            };
            assert_eq!(x1.dims(), &[rows, C]);
            let (want, _) = attention_residual_norm_linear(
                &qkv_t, &cu, HEADS, scale, &r_t, &w.proj, &w.norm, &w.fc1, true,
            )
            .unwrap();
            for (i, (g, e)) in host(&x1).iter().zip(host(&want).iter()).enumerate() {
                assert!(
                    g.is_finite() && g.to_bits() == e.to_bits(),
                    "{what}: x1 element {i} is {g}, attention_residual_norm_linear gives {e}"
                );
            }
        }
    }
    let dtype = DType::F16;
    let w = weights(&dev, &mut rng, dtype, 4 * C);
    let (_, qkv, r, cu) = sequence(&dev, &mut rng, dtype, 8, 8, C);
    let two = Tensor::from_slice(&[0u32, 4, 8], 3, &dev).unwrap();
    let no_bias = FusedLinear::new(w.proj.weight().clone(), None).unwrap();
    let (_, qkv_big, r_big, cu_big) = sequence(&dev, &mut rng, dtype, 577, 577, C);
    for (what, qkv, cu, heads, r, proj) in [
        ("two sequences", &qkv, &two, HEADS, &r, &w.proj),
        ("heads of 32", &qkv, &cu, 6, &r, &w.proj),
        ("577 rows", &qkv_big, &cu_big, HEADS, &r_big, &w.proj),
        ("no proj bias", &qkv, &cu, HEADS, &r, &no_bias),
    ] {
        assert!(
            !attention_residual_applies(qkv, cu, heads, r, proj),
            "{what}"
        );
        let got = attention_residual(qkv, cu, heads, scale, r, proj);
        fused_or_refused(got, false, what);
    }
}

/// `select_mlp_block` (lever 87: a fixed-count step's selection at the head of `mlp_block`)
/// gives exactly what candle-ragged's `select_top_k_by` and then `mlp_block` on its output give:
/// class-attention (EViT), significance (ATS) and given scores (with ties, negatives and a NaN),
/// fused rows by weighted mean and sum and none, keep from one token to all of them, sequences
/// of 2 to 352 tokens, outputs poisoned before the call. On the CPU it does not apply and
/// calling it is a clear error; bad steps and scores of another sequence are errors.
#[test]
fn select_mlp_block_matches_select_then_mlp_block() {
    use candle_ragged::{select_top_k_by, DroppedFusion};
    let dev = device();
    let expected = cluster_kernels_expected(&dev);
    let mut rng = StdRng::seed_from_u64(87);
    let scale = (HEAD_DIM as f32).powf(-0.5);
    // Quick (racecheck): 197 tokens, keep 0.7, class attention and given scores, fused by mean
    // or not.
    let (dtypes, _) = under_test(&[]);
    let quick = dtypes.len() == 1;
    let lens: &[usize] = if quick {
        &[197]
    } else {
        &[2, 17, 64, 65, 138, 197, 352]
    };
    for &dtype in dtypes {
        let mlp = MlpWeights::new(&dev, &mut rng, dtype);
        let tail = mlp.tail();
        for &len in lens {
            let x1 = tensor(&dev, &randn(&mut rng, len * C, 3.0), &[len, C], dtype);
            let qkv = tensor(
                &dev,
                &randn(&mut rng, len * 3 * C, 1.0),
                &[len, 3 * C],
                dtype,
            );
            let (given, keeps) = step_case(&dev, &mut rng, len, quick);
            for (name, scores) in [
                (
                    "cls attention",
                    TokenScores::ClsAttention {
                        qkv: &qkv,
                        heads: HEADS,
                        scale,
                    },
                ),
                (
                    "significance",
                    TokenScores::Significance {
                        qkv: &qkv,
                        heads: HEADS,
                        scale,
                    },
                ),
                ("given", TokenScores::Given(&given)),
            ] {
                if quick && name == "significance" {
                    continue;
                }
                let step = step_scores(&x1, 1, scores).unwrap();
                let applies = select_mlp_block_applies(&x1, &tail);
                expect_applies(expected, applies, &format!("{dtype:?} len {len}"));
                for &keep in &keeps {
                    for fusion in [
                        None,
                        Some(DroppedFusion::WeightedMean),
                        Some(DroppedFusion::WeightedSum),
                    ] {
                        if quick && fusion == Some(DroppedFusion::WeightedSum) {
                            continue;
                        }
                        let what = format!("{dtype:?} len {len} {name} keep {keep} {fusion:?}");
                        let (kept, out_len) =
                            select_top_k_by(&x1, 1, scores, 1, keep, fusion).unwrap();
                        poison(&dev, out_len * (C + 3 * C), dtype);
                        let got = select_mlp_block(&x1, &step, 1, keep, fusion, &tail);
                        let Some((x2, next_qkv)) = fused_or_refused(got, applies, &what) else {
                            continue;
                        };
                        assert_eq!(x2.dims(), &[out_len, C], "{what}");
                        assert_eq!(next_qkv.dims(), &[out_len, 3 * C], "{what}");
                        let (want_x2, want_qkv) = mlp_block(&kept, &tail).unwrap();
                        assert_same_bits(&what, (&x2, &next_qkv), (&want_x2, &want_qkv));
                    }
                }
            }
        }
    }
    // Bad steps (prefix past the tokens, keep 0 or more than the patches), and scores of another
    // sequence (other length, two sequences).
    let dtype = DType::F16;
    let mlp = MlpWeights::new(&dev, &mut rng, dtype);
    let tail = mlp.tail();
    let x1 = tensor(&dev, &randn(&mut rng, 20 * C, 1.0), &[20, C], dtype);
    let (step, wrong) = step_scores_and_wrong_ones(&dev, &mut rng, &x1);
    for (prefix, keep) in [(20, 1), (1, 0), (1, 20)] {
        let got = select_mlp_block(&x1, &step, prefix, keep, None, &tail);
        assert!(got.is_err(), "prefix {prefix} keep {keep}: {got:?}");
    }
    for (what, s) in &wrong {
        let got = select_mlp_block(&x1, s, 1, 5, None, &tail);
        assert!(
            matches!(got, Err(FastpathError::NotApplicable { .. })),
            "{what}: {got:?}"
        );
    }
    // Over the kernel's 512 tokens: not applicable.
    let x_long = tensor(&dev, &randn(&mut rng, 513 * C, 1.0), &[513, C], dtype);
    assert!(!select_mlp_block_applies(&x_long, &tail));
}

/// `attention_residual_with_cls_probs` (lever 88: the class token's attention scores computed
/// beside the attention by its idle warps): x1 bit for bit `attention_residual`'s, and the
/// scores bit for bit candle-ragged's `step_scores` rows (`cls_probs`) for class attention
/// with the same scale — each head's probabilities and the value rows' sums of squares — over
/// the sequence's tokens, 0 past them in a longer buffer; outputs poisoned first. On the CPU it
/// does not apply and calling it is a clear error.
#[test]
fn attention_cls_probs_are_step_scores_bits() {
    let dev = device();
    let expected = cluster_kernels_expected(&dev);
    let mut rng = StdRng::seed_from_u64(88);
    let scale = (HEAD_DIM as f64).powf(-0.5);
    let (dtypes, cases) = under_test(&[
        (1, 1),
        (2, 2),
        (17, 17),
        (64, 64),
        (65, 65),
        (138, 138),
        (197, 197),
        (352, 352),
        (70, 64),
    ]);
    for &dtype in dtypes {
        let w = weights(&dev, &mut rng, dtype, 4 * C);
        for &(rows, len) in cases {
            let (_, qkv_t, r_t, cu) = sequence(&dev, &mut rng, dtype, rows, len, C);
            let what = format!("{dtype:?} rows {rows} len {len}");
            // The same kernel as attention_residual's, with the probabilities beside it.
            let applies = attention_residual_applies(&qkv_t, &cu, HEADS, &r_t, &w.proj);
            expect_applies(expected, applies, &what);
            poison(&dev, rows * C + (HEADS + 1) * rows, dtype);
            let got = attention_residual_with_cls_probs(&qkv_t, &cu, HEADS, scale, &r_t, &w.proj);
            let Some((x1, probs)) = fused_or_refused(got, applies, &what) else {
                continue;
            };
            assert_eq!(probs.dims(), &[1, HEADS + 1, rows], "{what}");
            let plain = attention_residual(&qkv_t, &cu, HEADS, scale, &r_t, &w.proj).unwrap();
            for (i, (g, e)) in host(&x1).iter().zip(host(&plain).iter()).enumerate() {
                assert!(
                    g.to_bits() == e.to_bits(),
                    "{what}: x1 element {i} is {g}, attention_residual gives {e}"
                );
            }
            // The reference: cls_probs over the sequence's own rows.
            let (qkv_seq, x_seq) = (
                qkv_t.narrow(0, 0, len).unwrap(),
                r_t.narrow(0, 0, len).unwrap(),
            );
            let scores = TokenScores::Significance {
                qkv: &qkv_seq,
                heads: HEADS,
                scale: scale as f32,
            };
            let want = host(step_scores(&x_seq, 1, scores).unwrap().tensor());
            let got = host(&probs);
            for h in 0..=HEADS {
                for j in 0..rows {
                    let g = got[h * rows + j];
                    if j >= len {
                        assert_eq!(g, 0.0, "{what}: row {h} entry {j} past the sequence");
                        continue;
                    }
                    let e = want[h * len + j];
                    assert!(
                        g.to_bits() == e.to_bits(),
                        "{what}: row {h} entry {j} is {g}, cls_probs gives {e}"
                    );
                }
            }
        }
    }
}

/// `select_attention_block` (lever 90: a fixed-count step before a block, ranked at the head of
/// the block's kernel, its kept rows read in place): x2, the next qkv and (with norms) x2's row
/// norms bit for bit what candle-ragged's `select_top_k_gathering` and then `attention_block`
/// over the gathered rows give. Given scores (with a NaN and a tie, as Threshold-L2's norms and
/// DynamicViT's keep scores arrive) and class-attention scores; keep from 1 to every patch;
/// 2 to 352 tokens; f16 and bf16; outputs poisoned. Bad steps are errors, other sequences'
/// scores and inputs over 512 tokens are not taken, and on the CPU it does not apply.
#[test]
fn select_attention_block_matches_select_then_attention_block() {
    use candle_ragged::select_top_k_gathering;
    let dev = device();
    let expected = cluster_kernels_expected(&dev);
    let mut rng = StdRng::seed_from_u64(90);
    let scale = (HEAD_DIM as f64).powf(-0.5);
    let (dtypes, _) = under_test(&[]);
    let quick = dtypes.len() == 1;
    let lens: &[usize] = if quick {
        &[197]
    } else {
        &[2, 17, 64, 65, 138, 197, 352]
    };
    for &dtype in dtypes {
        let mlp = MlpWeights::new(&dev, &mut rng, dtype);
        let proj = weights(&dev, &mut rng, dtype, C).proj;
        let tail = mlp.block_tail(&proj);
        for &len in lens {
            let x = tensor(&dev, &randn(&mut rng, len * C, 3.0), &[len, C], dtype);
            let qkv = tensor(
                &dev,
                &randn(&mut rng, len * 3 * C, 1.0),
                &[len, 3 * C],
                dtype,
            );
            let (given, keeps) = step_case(&dev, &mut rng, len, quick);
            for (name, scores) in [
                ("given", TokenScores::Given(&given)),
                (
                    "cls attention",
                    TokenScores::ClsAttention {
                        qkv: &qkv,
                        heads: HEADS,
                        scale: scale as f32,
                    },
                ),
            ] {
                if quick && name != "given" {
                    continue;
                }
                let step = step_scores(&x, 1, scores).unwrap();
                for &keep in &keeps {
                    let what = format!("{dtype:?} len {len} {name} keep {keep}");
                    let applies = select_attention_block_applies(&qkv, HEADS, &x, &tail, 1 + keep);
                    expect_applies(expected, applies, &what);
                    poison(&dev, (1 + keep) * (C + 3 * C), dtype);
                    let got = select_attention_block(&qkv, &x, &step, 1, keep, HEADS, scale, &tail);
                    let Some((x2, next_qkv)) = fused_or_refused(got, applies, &what) else {
                        let with_norms = select_attention_block_with_norms(
                            &qkv, &x, &step, 1, keep, HEADS, scale, &tail,
                        );
                        fused_or_refused(with_norms, false, &format!("{what}, with norms"));
                        continue;
                    };
                    let (kept_x, kept_qkv, out_len) =
                        select_top_k_gathering(&x, &qkv, 1, scores, 1, keep).unwrap();
                    assert_eq!(out_len, 1 + keep, "{what}");
                    assert_eq!(x2.dims(), &[out_len, C], "{what}");
                    assert_eq!(next_qkv.dims(), &[out_len, 3 * C], "{what}");
                    let cu = Tensor::from_slice(&[0u32, out_len as u32], 2, &dev).unwrap();
                    let (want_x2, want_qkv, want_norms) =
                        attention_block_with_norms(&kept_qkv, &cu, HEADS, scale, &kept_x, &tail)
                            .unwrap();
                    assert_same_bits(&what, (&x2, &next_qkv), (&want_x2, &want_qkv));
                    let (x2n, qkvn, norms) = select_attention_block_with_norms(
                        &qkv, &x, &step, 1, keep, HEADS, scale, &tail,
                    )
                    .unwrap();
                    assert_same_bits(
                        &format!("{what}, with norms"),
                        (&x2n, &qkvn),
                        (&x2, &next_qkv),
                    );
                    let (got_n, want_n) = (host(&norms), host(&want_norms));
                    assert_eq!(got_n.len(), out_len, "{what}: norms");
                    for (i, (g, e)) in got_n.iter().zip(want_n.iter()).enumerate() {
                        assert!(
                            g.is_finite() && g.to_bits() == e.to_bits(),
                            "{what}: norm {i} is {g}, attention_block gives {e}"
                        );
                    }
                }
            }
        }
    }
    // Bad steps (prefix past the tokens, keep 0 or more than the patches), and scores of another
    // sequence (other length, two sequences).
    let dtype = DType::F16;
    let mlp = MlpWeights::new(&dev, &mut rng, dtype);
    let proj = weights(&dev, &mut rng, dtype, C).proj;
    let tail = mlp.block_tail(&proj);
    let x = tensor(&dev, &randn(&mut rng, 20 * C, 1.0), &[20, C], dtype);
    let qkv = tensor(&dev, &randn(&mut rng, 20 * 3 * C, 1.0), &[20, 3 * C], dtype);
    let (step, wrong) = step_scores_and_wrong_ones(&dev, &mut rng, &x);
    for (prefix, keep) in [(20, 1), (1, 0), (1, 20), (0, 21)] {
        let got = select_attention_block(&qkv, &x, &step, prefix, keep, HEADS, scale, &tail);
        assert!(got.is_err(), "prefix {prefix} keep {keep}: {got:?}");
    }
    for (what, s) in &wrong {
        let got = select_attention_block(&qkv, &x, s, 1, 5, HEADS, scale, &tail);
        assert!(
            matches!(got, Err(FastpathError::NotApplicable { .. })),
            "{what}: {got:?}"
        );
    }
    // Over the kernel's 512 tokens: not applicable.
    let x_long = tensor(&dev, &randn(&mut rng, 513 * C, 1.0), &[513, C], dtype);
    let qkv_long = tensor(
        &dev,
        &randn(&mut rng, 513 * 3 * C, 1.0),
        &[513, 3 * C],
        dtype,
    );
    assert!(!select_attention_block_applies(
        &qkv_long, HEADS, &x_long, &tail, 300
    ));
}
