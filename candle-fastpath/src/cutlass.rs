//! fc1 (`nn.Linear` + exact GELU) on CUTLASS's Hopper GEMM (`kernels/cutlass_linear.cu`, built
//! by build.rs when the CUTLASS headers are there), with bias and GELU applied before the one
//! store.
//!
//! Why: cuBLASLt's GELU epilogue is the tanh approximation, so with cuBLASLt the exact GELU is a
//! second pass over fc1's `[M, 4C]` output.
//!
//! Which problems come here: on a compute capability 9.0 GPU (the kernel is sm_90a code, which
//! later architectures do not run; the caller checks), f16 / bf16 with a bias, 16-byte aligned,
//! and an output of at least
//! [`MIN_OUTPUT`] elements. Below that cuBLASLt's GEMM plus the GELU pass was as fast or faster
//! on the H100 (docs/LEVERS.md, lever 18: DeiT-T at batch 64, 12,608 × 768 outputs, was 2–5 %
//! slower through CUTLASS; DeiT-S at batch 64, 12,608 × 1,536, 2 % faster). `CANDLE_FASTPATH_CUTLASS`
//! overrides the size rule: `0` never, `1` every eligible problem (how the tests reach the kernel
//! with small shapes).

use std::ffi::c_void;
use std::sync::OnceLock;

use candle_core::DType;

use crate::error::FastpathError;
use crate::gelu_form::GeluForm;

extern "C" {
    fn fastpath_cutlass_linear_gelu_f16(
        phi: i32,
        epi32: i32,
        x: *const c_void,
        ldx: i64,
        w: *const c_void,
        bias: *const c_void,
        y: *mut c_void,
        m: i32,
        n: i32,
        k: i32,
        sm_count: i32,
        stream: *mut c_void,
    ) -> i32;
    fn fastpath_cutlass_linear_gelu_bf16(
        phi: i32,
        epi32: i32,
        x: *const c_void,
        ldx: i64,
        w: *const c_void,
        bias: *const c_void,
        y: *mut c_void,
        m: i32,
        n: i32,
        k: i32,
        sm_count: i32,
        stream: *mut c_void,
    ) -> i32;
}

/// Smallest `m · n` output that goes through CUTLASS by default: 2²⁴ elements, about four waves
/// of 128 × 256 tiles on 132 SMs.
pub(crate) const MIN_OUTPUT: usize = 1 << 24;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Policy {
    Never,
    Always,
    Large,
}

/// `CANDLE_FASTPATH_CUTLASS_TILE=epi32`: the Φ GELU on lever 18's 128 × 32 epilogue subtiles
/// instead of lever 26's 128 × 64 (kernels/cutlass_linear.cu; an A/B switch).
fn epi32() -> bool {
    static EPI32: OnceLock<bool> = OnceLock::new();
    crate::switches::read_once(&EPI32, "CANDLE_FASTPATH_CUTLASS_TILE", |v| {
        v == Some("epi32")
    })
}

fn policy() -> Policy {
    static POLICY: OnceLock<Policy> = OnceLock::new();
    crate::switches::read_once(&POLICY, "CANDLE_FASTPATH_CUTLASS", |v| match v {
        Some("0") => Policy::Never,
        Some("1") => Policy::Always,
        _ => Policy::Large,
    })
}

/// Whether this bias + GELU problem goes through CUTLASS: f16 / bf16, large enough (see the
/// module doc), 16-byte aligned operands and row strides (TMA's requirement), and sizes that fit
/// its 32-bit problem shape.
pub(crate) fn takes(
    dtype: DType,
    (m, n, k, ldx): (usize, usize, usize, usize),
    align: u32,
) -> bool {
    let wanted = match policy() {
        Policy::Never => false,
        Policy::Always => true,
        Policy::Large => m.saturating_mul(n) >= MIN_OUTPUT,
    };
    wanted
        && matches!(dtype, DType::F16 | DType::BF16)
        && align >= 16
        && n % 8 == 0
        && k % 8 == 0
        && ldx % 8 == 0
        && [m, n, k].iter().all(|&d| d > 0 && d <= i32::MAX as usize)
}

/// Runs `y[M, N] = gelu(x[M, K] · W[N, K]ᵀ + b[N])` on `stream`, the GELU in the given form. Pointers are device
/// addresses of buffers of the sizes the shapes give (`x` rows `ldx` elements apart). `Ok(false)`:
/// CUTLASS refused the problem before launching anything (`can_implement`, or it would need a
/// workspace), so the caller runs it another way.
///
/// # Safety
/// The pointers must be valid device buffers of `dtype` on the stream's device, large enough
/// for the shapes, and [`takes`] must have accepted the problem.
pub(crate) unsafe fn linear_gelu(
    dtype: DType,
    form: GeluForm,
    (x, w, bias, y): (u64, u64, u64, u64),
    (m, n, k, ldx): (usize, usize, usize, usize),
    sm_count: usize,
    stream: *mut c_void,
) -> Result<bool, FastpathError> {
    let f = match dtype {
        DType::F16 => fastpath_cutlass_linear_gelu_f16,
        DType::BF16 => fastpath_cutlass_linear_gelu_bf16,
        dtype => {
            return Err(FastpathError::UnsupportedDType {
                op: "fused_linear (CUTLASS)",
                dtype,
            })
        }
    };
    let status = f(
        i32::from(form == GeluForm::Phi),
        i32::from(epi32()),
        x as *const c_void,
        ldx as i64,
        w as *const c_void,
        bias as *const c_void,
        y as *mut c_void,
        m as i32,
        n as i32,
        k as i32,
        sm_count as i32,
        stream,
    );
    let what = match status {
        0 => return Ok(true),
        1 | 2 => return Ok(false),
        3 => "initialize failed",
        4 => "launch failed",
        _ => "unknown status",
    };
    Err(FastpathError::Cutlass {
        status: format!("{what} (status {status}, problem {m} x {n} x {k}, ldx {ldx})"),
    })
}
