//! fc1 with the exact GELU in the GEMM's epilogue: CUTLASS's Hopper GEMM from
//! `kernels/cutlass_linear.cu` (built by build.rs when the CUTLASS headers are there).
//!
//! cuBLASLt's GELU epilogue is the tanh approximation, so with cuBLASLt the exact GELU is a
//! second pass over the `[M, N]` output. This path writes `gelu_erf(x · Wᵀ + b)` once.
//! Used for f16 / bf16 problems with a bias and no residual from `CANDLE_FASTPATH_CUTLASS_ROWS`
//! rows up (unset: never, until its A/B against cuBLASLt + the GELU kernel is measured).

use std::ffi::c_void;
use std::sync::OnceLock;

use candle_core::DType;

use crate::error::FastpathError;

extern "C" {
    fn fastpath_cutlass_linear_gelu_f16(
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

/// Smallest row count that takes this path (`CANDLE_FASTPATH_CUTLASS_ROWS`; unset or not a
/// number: none does).
fn min_rows() -> usize {
    static ROWS: OnceLock<usize> = OnceLock::new();
    *ROWS.get_or_init(|| {
        std::env::var("CANDLE_FASTPATH_CUTLASS_ROWS")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(usize::MAX)
    })
}

/// Whether `gelu(x · Wᵀ + b)` of this shape goes through the CUTLASS kernel: f16 / bf16,
/// `m` past the threshold, 16-byte aligned operands and row strides (TMA's requirement), and
/// sizes that fit its 32-bit problem shape.
pub(crate) fn takes(
    dtype: DType,
    (m, n, k, ldx): (usize, usize, usize, usize),
    align: u32,
) -> bool {
    matches!(dtype, DType::F16 | DType::BF16)
        && m >= min_rows()
        && align >= 16
        && n % 8 == 0
        && k % 8 == 0
        && ldx % 8 == 0
        && [m, n, k].iter().all(|&d| d > 0 && d <= i32::MAX as usize)
}

/// Runs `y[M, N] = gelu_erf(x[M, K] · W[N, K]ᵀ + b[N])` on `stream`. Pointers are device
/// addresses of buffers of the sizes the shapes give (`x` rows `ldx` elements apart).
///
/// # Safety
/// The pointers must be valid device buffers of `dtype` on the stream's device, large enough
/// for the shapes, and [`takes`] must have accepted the problem.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn linear_gelu(
    dtype: DType,
    (x, w, bias, y): (u64, u64, u64, u64),
    (m, n, k, ldx): (usize, usize, usize, usize),
    sm_count: usize,
    stream: *mut c_void,
) -> Result<(), FastpathError> {
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
        0 => return Ok(()),
        1 => "the kernel cannot take this problem (can_implement)",
        2 => "the kernel asks for a workspace",
        3 => "initialize failed",
        4 => "launch failed",
        _ => "unknown status",
    };
    Err(FastpathError::Cutlass {
        status: format!("{what} (status {status}, problem {m} x {n} x {k}, ldx {ldx})"),
    })
}
