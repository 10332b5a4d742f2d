//! fc1 (`nn.Linear` + exact GELU) on CUTLASS's Hopper GEMM (`kernels/cutlass_linear.cu`, built
//! by build.rs when the CUTLASS headers are there), with bias and GELU applied before the one
//! store.
//!
//! Why: cuBLASLt's GELU epilogue is the tanh approximation, so with cuBLASLt the exact GELU is a
//! second pass over fc1's `[M, 4C]` output.
//!
//! Which problems come here: on a compute capability 9.0 GPU (the kernel is sm_90a code, which
//! later architectures do not run; the caller checks), f16 / bf16 with a bias, 16-byte aligned.
//! Outputs of at least [`MIN_OUTPUT`] elements go to the 128 × 256 kernel; below that cuBLASLt's
//! GEMM plus the GELU pass was as fast or faster than that kernel on the H100 (docs/BENCHMARKS.md,
//! lever 18: DeiT-T at batch 64, 12,608 × 768 outputs, was 2–5 % slower through it; DeiT-S at
//! batch 64, 12,608 × 1,536, 2 % faster), so small problems get a kernel of their own with
//! 64-row tiles (lever 27; `CANDLE_FASTPATH_CUTLASS_SMALL`). `CANDLE_FASTPATH_CUTLASS` overrides
//! the size rule: `0` never, `1` every eligible problem (how the tests reach the large kernel
//! with small shapes, together with `CANDLE_FASTPATH_CUTLASS_SMALL=off`).

use std::ffi::c_void;
use std::sync::OnceLock;

use candle_core::DType;

use crate::error::FastpathError;
use crate::gelu_form::GeluForm;

extern "C" {
    fn fastpath_cutlass_linear_gelu_f16(
        phi: i32,
        tile: i32,
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
        tile: i32,
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

/// Which of the CUTLASS kernels runs a problem (the `tile` code of kernels/cutlass_linear.cu).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Kernel {
    /// 128 × 256 cooperative tiles, 128 × 64 epilogue subtiles (lever 26): large problems.
    Large = 0,
    /// The same with lever 18's 128 × 32 subtiles (`CANDLE_FASTPATH_CUTLASS_TILE=epi32`).
    LargeEpi32 = 1,
    /// 64 × 64 tiles, one consumer warpgroup, one tile per CTA (lever 27): small problems.
    Small64x64 = 2,
    /// 64 × 128 tiles, otherwise as `Small64x64`.
    Small64x128 = 3,
}

/// `CANDLE_FASTPATH_CUTLASS_TILE=epi32`: the Φ GELU on lever 18's 128 × 32 epilogue subtiles
/// instead of lever 26's 128 × 64 (kernels/cutlass_linear.cu; an A/B switch).
fn epi32() -> bool {
    static EPI32: OnceLock<bool> = OnceLock::new();
    crate::switches::read_once(&EPI32, "CANDLE_FASTPATH_CUTLASS_TILE", |v| {
        v == Some("epi32")
    })
}

/// `CANDLE_FASTPATH_CUTLASS_SMALL`: the kernel for problems under [`MIN_OUTPUT`] (lever 27):
/// `off` (cuBLASLt and the GELU pass, as before it), `64x64` or `64x128` (the default).
fn small_kernel() -> Option<Kernel> {
    static SMALL: OnceLock<Option<Kernel>> = OnceLock::new();
    crate::switches::read_once(&SMALL, "CANDLE_FASTPATH_CUTLASS_SMALL", |v| match v {
        Some("off") => None,
        Some("64x64") => Some(Kernel::Small64x64),
        _ => Some(Kernel::Small64x128),
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

/// Which CUTLASS kernel takes this bias + GELU problem, if any: f16 / bf16, 16-byte aligned
/// operands and row strides (TMA's requirement), sizes that fit its 32-bit problem shape; then
/// by size (see the module doc): the large kernel from [`MIN_OUTPUT`] elements up, the small one
/// below (Φ GELU only; the erf form has the large kernel alone, and its small problems stay on
/// cuBLASLt). `CANDLE_FASTPATH_CUTLASS=1` sends small problems to the large kernel when the small
/// one is off, so the tests can reach either.
pub(crate) fn choose(
    dtype: DType,
    form: GeluForm,
    (m, n, k, ldx): (usize, usize, usize, usize),
    align: u32,
) -> Option<Kernel> {
    let eligible = matches!(dtype, DType::F16 | DType::BF16)
        && align >= 16
        && n % 8 == 0
        && k % 8 == 0
        && ldx % 8 == 0
        && [m, n, k].iter().all(|&d| d > 0 && d <= i32::MAX as usize);
    let large = if form == GeluForm::Phi && epi32() {
        Kernel::LargeEpi32
    } else {
        Kernel::Large
    };
    let small = small_kernel().filter(|_| form == GeluForm::Phi);
    let kernel = match (policy(), m.saturating_mul(n) >= MIN_OUTPUT) {
        (Policy::Never, _) => None,
        (_, true) => Some(large),
        (Policy::Large, false) => small,
        (Policy::Always, false) => Some(small.unwrap_or(large)),
    };
    kernel.filter(|_| eligible)
}

/// Runs `y[M, N] = gelu(x[M, K] · W[N, K]ᵀ + b[N])` on `stream`, the GELU in the given form. Pointers are device
/// addresses of buffers of the sizes the shapes give (`x` rows `ldx` elements apart). `Ok(false)`:
/// CUTLASS refused the problem before launching anything (`can_implement`, or it would need a
/// workspace), so the caller runs it another way.
///
/// # Safety
/// The pointers must be valid device buffers of `dtype` on the stream's device, large enough
/// for the shapes, and [`choose`] must have picked `kernel` for the problem.
pub(crate) unsafe fn linear_gelu(
    kernel: Kernel,
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
        kernel as i32,
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
