//! Random layers for the fused-kernel tests: a Linear and a LayerNorm built the same way in
//! every test that needs one (weights drawn in one fixed order from the test's seeded generator,
//! then rounded to the dtype under test).

use candle_core::{DType, Device};
use candle_fastpath::{FusedLinear, LayerNorm};
use rand::rngs::StdRng;

use super::attention::tensor;
use super::randn;

/// A Linear `[out, inp]`: weights drawn with standard deviation `w_std`, then the bias (when
/// `bias_std` is given) with that deviation.
pub fn random_linear(
    dev: &Device,
    rng: &mut StdRng,
    dtype: DType,
    (out, inp): (usize, usize),
    w_std: f32,
    bias_std: Option<f32>,
) -> FusedLinear {
    let w = tensor(dev, &randn(rng, out * inp, w_std), &[out, inp], dtype);
    let b = bias_std.map(|std| tensor(dev, &randn(rng, out, std), &[out], dtype));
    FusedLinear::new(w, b).unwrap()
}

/// A LayerNorm over `c` features (eps 1e-6): gains near one (1 + N(0, 0.3²)), then offsets from
/// N(0, 0.2²).
pub fn random_layer_norm(dev: &Device, rng: &mut StdRng, dtype: DType, c: usize) -> LayerNorm {
    let gamma: Vec<f32> = randn(rng, c, 0.3).iter().map(|g| 1.0 + g).collect();
    LayerNorm::new(
        tensor(dev, &gamma, &[c], dtype),
        tensor(dev, &randn(rng, c, 0.2), &[c], dtype),
        1e-6,
    )
    .unwrap()
}
