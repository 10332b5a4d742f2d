//! `nn.Linear` on CUTLASS's Hopper GEMM (`kernels/cutlass_linear.cu`, built by build.rs when the
//! CUTLASS headers are there), with the epilogue fused: bias, bias + exact GELU, or bias +
//! residual.
//!
//! Why: cuBLASLt's GELU epilogue is the tanh approximation, so with cuBLASLt the exact GELU is a
//! second pass over fc1's `[M, 4C]` output; here it is applied before the one store. And CUTLASS's
//! kernels take part in programmatic dependent launch (`CANDLE_PDL=1`, see
//! `candle_ragged::launch`), which cuBLASLt's do not.
//!
//! Which problems come here (f16 / bf16 with a bias, 16-byte aligned, `m` rows):
//! - bias + GELU from `CANDLE_FASTPATH_CUTLASS_ROWS` rows up (unset: never);
//! - also bias and bias + residual when `CANDLE_FASTPATH_CUTLASS_ALL=1`.
//!
//! Both stay off by default until their A/B against cuBLASLt is measured.

use std::ffi::c_void;
use std::sync::OnceLock;

use candle_core::DType;

use crate::error::FastpathError;

extern "C" {
    fn fastpath_cutlass_linear_f16(
        epilogue: i32,
        x: *const c_void,
        ldx: i64,
        w: *const c_void,
        bias: *const c_void,
        residual: *const c_void,
        y: *mut c_void,
        m: i32,
        n: i32,
        k: i32,
        sm_count: i32,
        pdl: i32,
        stream: *mut c_void,
    ) -> i32;
    fn fastpath_cutlass_linear_bf16(
        epilogue: i32,
        x: *const c_void,
        ldx: i64,
        w: *const c_void,
        bias: *const c_void,
        residual: *const c_void,
        y: *mut c_void,
        m: i32,
        n: i32,
        k: i32,
        sm_count: i32,
        pdl: i32,
        stream: *mut c_void,
    ) -> i32;
}

/// The fused epilogue (`epilogue` codes of `kernels/cutlass_linear.cu`).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Epilogue {
    Bias = 0,
    BiasGelu = 1,
    BiasResidual = 2,
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

fn all_linears() -> bool {
    static ALL: OnceLock<bool> = OnceLock::new();
    *ALL.get_or_init(|| std::env::var("CANDLE_FASTPATH_CUTLASS_ALL").as_deref() == Ok("1"))
}

/// Whether this problem goes through CUTLASS: f16 / bf16, `m` past the threshold, the epilogue
/// enabled, 16-byte aligned operands and row strides (TMA's requirement), and sizes that fit its
/// 32-bit problem shape.
pub(crate) fn takes(
    dtype: DType,
    epilogue: Epilogue,
    (m, n, k, ldx): (usize, usize, usize, usize),
    align: u32,
) -> bool {
    matches!(dtype, DType::F16 | DType::BF16)
        && (matches!(epilogue, Epilogue::BiasGelu) || all_linears())
        && m >= min_rows()
        && align >= 16
        && n % 8 == 0
        && k % 8 == 0
        && ldx % 8 == 0
        && [m, n, k].iter().all(|&d| d > 0 && d <= i32::MAX as usize)
}

/// Runs `y[M, N] = epilogue(x[M, K] · W[N, K]ᵀ + b[N] (+ r[M, N]))` on `stream`. Pointers are
/// device addresses of buffers of the sizes the shapes give (`x` rows `ldx` elements apart;
/// `residual` 0 unless the epilogue has one). `Ok(false)`: CUTLASS refused the problem before
/// launching anything (`can_implement`, or it would need a workspace), so the caller runs it
/// another way.
///
/// # Safety
/// The pointers must be valid device buffers of `dtype` on the stream's device, large enough
/// for the shapes, and [`takes`] must have accepted the problem.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn linear(
    dtype: DType,
    epilogue: Epilogue,
    (x, w, bias, residual, y): (u64, u64, u64, u64, u64),
    (m, n, k, ldx): (usize, usize, usize, usize),
    sm_count: usize,
    pdl: bool,
    stream: *mut c_void,
) -> Result<bool, FastpathError> {
    let f = match dtype {
        DType::F16 => fastpath_cutlass_linear_f16,
        DType::BF16 => fastpath_cutlass_linear_bf16,
        dtype => {
            return Err(FastpathError::UnsupportedDType {
                op: "fused_linear (CUTLASS)",
                dtype,
            })
        }
    };
    let status = f(
        epilogue as i32,
        x as *const c_void,
        ldx as i64,
        w as *const c_void,
        bias as *const c_void,
        residual as *const c_void,
        y as *mut c_void,
        m as i32,
        n as i32,
        k as i32,
        sm_count as i32,
        i32::from(pdl),
        stream,
    );
    let what = match status {
        0 => return Ok(true),
        1 | 2 => return Ok(false),
        3 => "initialize failed",
        4 => "launch failed",
        5 => "unknown epilogue",
        _ => "unknown status",
    };
    Err(FastpathError::Cutlass {
        status: format!(
            "{what} (status {status}, {epilogue:?}, problem {m} x {n} x {k}, ldx {ldx})"
        ),
    })
}
