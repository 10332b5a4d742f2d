//! `attention_linear_residual_norm` (one sequence's attention from its fused qkv projection, then
//! the output projection with its residual and norm2, one cluster kernel at DeiT-S's width on
//! compute capability 9.0; lever 119) against the steps it replaces: a plain host attention (f64,
//! over the rows as rounded to the storage type), its output rounded to the storage type as the
//! attention kernel stores it, then `linear_residual_norm` (lever 98's kernel where it applies,
//! else the projection with its residual and the LayerNorm). Fresh random inputs, f16 and bf16,
//! sequence lengths 1, 2, 15-17, 63-65, 138, 197 and 256 (the one-wave limit on the H100),
//! buffers of more rows than the sequence (their tail NaN), and the output memory poisoned (NaN)
//! before each call. Built with `cuda` on a GPU with clusters the kernel must apply to all of
//! them; elsewhere (CI's CPU) it must not, and calling it is a clear error.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_fastpath::{
    attention_linear_residual_norm, attention_linear_residual_norm_applies, linear_residual_norm,
    FusedLinear, LayerNorm,
};
use common::attention::{
    assert_rows_close, attention_host, expect_applies, fused_or_refused, sequence, sequence_cases,
    under_test, RefusalInputs, HEAD_DIM,
};
use common::layers::{random_layer_norm, random_linear};
use common::{cluster_kernels_expected, device, host, poison};
use rand::{rngs::StdRng, SeedableRng};

const C: usize = 384;
const HEADS: usize = 6;

/// The attention projection (with a bias unless `bias` is false) and norm2, random.
fn layers(dev: &Device, rng: &mut StdRng, dtype: DType, bias: bool) -> (FusedLinear, LayerNorm) {
    let w_std = 1.0 / (C as f32).sqrt();
    let proj = random_linear(dev, rng, dtype, (C, C), w_std, bias.then_some(0.5));
    (proj, random_layer_norm(dev, rng, dtype, C))
}

#[test]
fn matches_attention_then_the_projection_step() {
    let dev = device();
    let expected = cluster_kernels_expected(&dev);
    let mut rng = StdRng::seed_from_u64(119);
    let scale = (HEAD_DIM as f64).powf(-0.5);
    let full = sequence_cases(256);
    let (dtypes, cases) = under_test(&full);
    for &dtype in dtypes {
        let (proj, norm) = layers(&dev, &mut rng, dtype, true);
        for &(rows, len) in cases {
            let (qkv, qkv_t, r_t, cu) = sequence(&dev, &mut rng, dtype, rows, len, C);
            let o = attention_host(&dev, &qkv, len, C, HEADS, scale, dtype);
            let (want_x1, want_z) =
                linear_residual_norm(&o, &r_t.narrow(0, 0, len).unwrap(), &proj, &norm).unwrap();
            let (want_x1, want_z) = (host(&want_x1), host(&want_z));

            let applies =
                attention_linear_residual_norm_applies(&qkv_t, &cu, HEADS, &r_t, &proj, &norm);
            let what = format!("{dtype:?} rows {rows} len {len}");
            expect_applies(expected, applies, &what);
            poison(&dev, 2 * rows * C, dtype);
            let got = attention_linear_residual_norm(&qkv_t, &cu, HEADS, scale, &r_t, &proj, &norm);
            let Some((x1, z)) = fused_or_refused(got, applies, &what) else {
                continue;
            };
            assert_eq!(x1.dims(), &[rows, C]);
            assert_eq!(z.dims(), &[rows, C]);
            // The attention output may land one rounding of the storage type away (another
            // summation order), which the projection spreads over x1 and the LayerNorm over z.
            let (tol_x1, tol_z) = match dtype {
                DType::F16 => (2e-3, 8e-3),
                _ => (1.6e-2, 6e-2),
            };
            let (x1, z) = (host(&x1), host(&z));
            assert_rows_close(&what, "x1", (&x1, &want_x1), len, C, tol_x1);
            assert_rows_close(&what, "z", (&z, &want_z), len, C, tol_z);
        }
    }
}

#[test]
fn inputs_it_does_not_take_are_refused() {
    let dev = device();
    let mut rng = StdRng::seed_from_u64(120);
    let (proj, norm) = layers(&dev, &mut rng, DType::F16, true);
    let refusals = RefusalInputs::new(&dev, &mut rng, C);
    let refused = |qkv: &Tensor, cu: &Tensor, heads: usize, r: &Tensor, proj: &FusedLinear| {
        assert!(!attention_linear_residual_norm_applies(
            qkv, cu, heads, r, proj, &norm
        ));
        let got = attention_linear_residual_norm(qkv, cu, heads, 0.125, r, proj, &norm);
        fused_or_refused(got, false, "attention_linear_residual_norm");
    };
    refusals.each_common_refusal(HEADS, C, |qkv, cu, heads, r| {
        refused(qkv, cu, heads, r, &proj)
    });
    // And a projection without its bias.
    let (no_bias, _) = layers(&dev, &mut rng, DType::F16, false);
    refused(&refusals.qkv, &refusals.one, HEADS, &refusals.r, &no_bias);
}
