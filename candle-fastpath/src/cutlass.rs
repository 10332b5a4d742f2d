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
//! on the H100 (docs/BENCHMARKS.md, lever 18: DeiT-T at batch 64, 12,608 × 768 outputs, was 2–5 %
//! slower through CUTLASS; DeiT-S at batch 64, 12,608 × 1,536, 2 % faster). `CANDLE_FASTPATH_CUTLASS`
//! overrides the size rule: `0` never, `1` every eligible problem (how the tests reach the kernel
//! with small shapes).
//!
//! A/B candidates for lever 23 (read once per process; defaults = lever 18's kernel):
//! `CANDLE_FASTPATH_CUTLASS_CLUSTER` = `1x1` (default), `2x1` (the weight tile multicast to two
//! M tiles), `1x2` (the activation tile to two N tiles) or `2x2`, for the Φ GELU (the erf form
//! stays 1 × 1); `CANDLE_FASTPATH_CUTLASS_RASTER` = `m` or `n` (default: CUTLASS's heuristic,
//! along N for every fc1 here); `CANDLE_FASTPATH_CUTLASS_SWIZZLE` = `2`, `4` or `8` (default 1).
//!
//! Lever 25's A/B candidate, the other Linears on the same kernels (bias, or bias + residual
//! through CUTLASS's C operand; same size rule, cluster 1x1 / 2x1 / 2x2 from the switch above,
//! 1x2 runs 1x1): `CANDLE_FASTPATH_CUTLASS_PLAIN` = `bias` (Linears with a bias only: qkv),
//! `residual` (bias + residual: proj, fc2) or `both`; default none (cuBLASLt).

use std::ffi::c_void;
use std::sync::OnceLock;

use candle_core::DType;

use crate::error::FastpathError;
use crate::gelu_form::GeluForm;

extern "C" {
    fn fastpath_cutlass_linear_gelu_f16(
        phi: i32,
        cluster: i32,
        raster: i32,
        swizzle: i32,
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
        cluster: i32,
        raster: i32,
        swizzle: i32,
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
    fn fastpath_cutlass_linear_bias_f16(
        cluster: i32,
        raster: i32,
        swizzle: i32,
        x: *const c_void,
        ldx: i64,
        w: *const c_void,
        bias: *const c_void,
        c: *const c_void,
        y: *mut c_void,
        m: i32,
        n: i32,
        k: i32,
        sm_count: i32,
        stream: *mut c_void,
    ) -> i32;
    fn fastpath_cutlass_linear_bias_bf16(
        cluster: i32,
        raster: i32,
        swizzle: i32,
        x: *const c_void,
        ldx: i64,
        w: *const c_void,
        bias: *const c_void,
        c: *const c_void,
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

fn policy() -> Policy {
    static POLICY: OnceLock<Policy> = OnceLock::new();
    crate::switches::read_once(&POLICY, "CANDLE_FASTPATH_CUTLASS", |v| match v {
        Some("0") => Policy::Never,
        Some("1") => Policy::Always,
        _ => Policy::Large,
    })
}

/// The kernel's cluster shape and tile order (see the module doc), as the C entry points take
/// them: (cluster 0..=3 for 1x1 / 2x1 / 1x2 / 2x2, raster 0 heuristic / 1 along M / 2 along N,
/// swizzle 1 / 2 / 4 / 8).
fn schedule() -> (i32, i32, i32) {
    static CLUSTER: OnceLock<i32> = OnceLock::new();
    static RASTER: OnceLock<i32> = OnceLock::new();
    static SWIZZLE: OnceLock<i32> = OnceLock::new();
    let cluster =
        crate::switches::read_once(&CLUSTER, "CANDLE_FASTPATH_CUTLASS_CLUSTER", |v| match v {
            Some("2x1") => 1,
            Some("1x2") => 2,
            Some("2x2") => 3,
            _ => 0,
        });
    let raster =
        crate::switches::read_once(&RASTER, "CANDLE_FASTPATH_CUTLASS_RASTER", |v| match v {
            Some("m") => 1,
            Some("n") => 2,
            _ => 0,
        });
    let swizzle =
        crate::switches::read_once(&SWIZZLE, "CANDLE_FASTPATH_CUTLASS_SWIZZLE", |v| match v {
            Some("2") => 2,
            Some("4") => 4,
            Some("8") => 8,
            _ => 1,
        });
    (cluster, raster, swizzle)
}

/// Whether a Linear without GELU goes through CUTLASS (lever 25's switch; the size and layout
/// rule of [`takes`] applies on top).
pub(crate) fn plain_wanted(residual: bool) -> bool {
    static PLAIN: OnceLock<(bool, bool)> = OnceLock::new();
    let (bias, res) =
        crate::switches::read_once(&PLAIN, "CANDLE_FASTPATH_CUTLASS_PLAIN", |v| match v {
            Some("bias") => (true, false),
            Some("residual") => (false, true),
            Some("both") => (true, true),
            _ => (false, false),
        });
    if residual {
        res
    } else {
        bias
    }
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
    let (cluster, raster, swizzle) = schedule();
    let status = f(
        i32::from(form == GeluForm::Phi),
        cluster,
        raster,
        swizzle,
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
    outcome(status, (m, n, k, ldx))
}

/// `Ok(true)`: it ran; `Ok(false)`: refused before any launch; else the failure, named.
fn outcome(
    status: i32,
    (m, n, k, ldx): (usize, usize, usize, usize),
) -> Result<bool, FastpathError> {
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

/// Runs `y[M, N] = x[M, K] · W[N, K]ᵀ + b[N] (+ r[M, N])` on `stream` (lever 25's candidate);
/// `residual` is `r`'s device address, contiguous `[M, N]`. Same contract as [`linear_gelu`].
///
/// # Safety
/// As for [`linear_gelu`], and `residual`, when given, a valid `[M, N]` buffer of `dtype`.
pub(crate) unsafe fn linear_bias(
    dtype: DType,
    (x, w, bias, residual, y): (u64, u64, u64, Option<u64>, u64),
    (m, n, k, ldx): (usize, usize, usize, usize),
    sm_count: usize,
    stream: *mut c_void,
) -> Result<bool, FastpathError> {
    let f = match dtype {
        DType::F16 => fastpath_cutlass_linear_bias_f16,
        DType::BF16 => fastpath_cutlass_linear_bias_bf16,
        dtype => {
            return Err(FastpathError::UnsupportedDType {
                op: "fused_linear (CUTLASS)",
                dtype,
            })
        }
    };
    let (cluster, raster, swizzle) = schedule();
    let status = f(
        cluster,
        raster,
        swizzle,
        x as *const c_void,
        ldx as i64,
        w as *const c_void,
        bias as *const c_void,
        residual.map_or(std::ptr::null(), |r| r as *const c_void),
        y as *mut c_void,
        m as i32,
        n as i32,
        k as i32,
        sm_count as i32,
        stream,
    );
    outcome(status, (m, n, k, ldx))
}
