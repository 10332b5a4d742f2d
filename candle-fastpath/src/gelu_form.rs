//! Which of the two exact-GELU formulas the CUDA kernels evaluate, from `CANDLE_FASTPATH_GELU`
//! (read once per process):
//! - `phi` (the default, lever 19): `x·Φ(x)` through the normal tail (`kernels/gelu_phi.cuh`),
//!   fewer instructions and more accurate for negative x (`tests/gelu_phi.rs` checks every f16
//!   and bf16 input);
//! - `erf`: `0.5·x·(1 + erf(x/√2))` with CUDA's `erff`, the form before (for A/B runs).
//!
//! It applies to f16 / bf16 outputs: the GELU kernel after cuBLASLt's fc1 and the CUTLASS fc1's
//! epilogue. f32 outputs keep `erff` (relative error ~1e-7 for x > 0, where the Φ form's ~2e-6
//! would show in f32 but not in a 16-bit result). The CPU path uses `gelu_cpu`'s
//! vectorised kernel (`crate::gelu_erf`).

use crate::switches::read_once;
use std::sync::OnceLock;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum GeluForm {
    Erf,
    Phi,
}

pub(crate) fn gelu_form() -> GeluForm {
    static FORM: OnceLock<GeluForm> = OnceLock::new();
    read_once(&FORM, "CANDLE_FASTPATH_GELU", |v| match v {
        Some("erf") => GeluForm::Erf,
        _ => GeluForm::Phi,
    })
}

/// Whether the CUDA kernels evaluate the exact GELU in its x·Φ(x) form (the default; `false`
/// under `CANDLE_FASTPATH_GELU=erf`). The thin GEMM's GELU epilogue (lever 100) is built for that
/// form only, so with `erf` fc1 takes cuBLASLt and the GELU pass: what tests asserting where a
/// kernel runs need to know.
pub fn gelu_phi_form() -> bool {
    gelu_form() == GeluForm::Phi
}
