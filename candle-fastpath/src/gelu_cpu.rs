//! The exact (erf) GELU on the CPU, branch-free so that it vectorises: `gelu(x) = x·Φ(x) =
//! ½·x·erfc(−x/√2)`.
//!
//! Why: candle's `gelu_erf` calls libm's scalar `erff` per element, ~4–6.5 ns each on the build
//! machine: DeiT-S's fc1 GELU at batch 1 (197 × 1536 values) took 1.3–2.0 ms there, more than
//! the fc1 matmul itself (1.2 ms), ~10–16 % of a CPU forward (a standalone timing program, not
//! in the tree; the knob A/B in docs/BENCHMARKS.md's CPU section is the reproducible figure). It is also inexact where the formula
//! cancels: `1 + erf(x/√2)` for negative x loses the digits that `erfc` keeps (up to ~100 ulps
//! of the result at x ∈ [−3, 0), and it is 0 or NaN in the far tail, −inf giving NaN).
//!
//! How: `erfc(a)`, `a = |x|/√2`, as `t·exp(−a²)·P(t)` with `t = 1/(1 + p·a)` (the form of
//! Abramowitz & Stegun 7.1.26, whose p this keeps) and `P` a degree-9 polynomial fitted for this
//! module over `a ∈ [0, 10.7]` (relative error 5.5e-9 in exact arithmetic; in a shifted variable
//! so that its Horner sums stay small). Then `x ≥ 0`: `x·(1 − ½·erfc(a))`; `x < 0`:
//! `½·x·erfc(a)`, so both sides keep their relative accuracy. `a² = x²/2` is formed from a
//! 12-bit split of |x| so that `exp` sees it to full precision (a rounded `a` alone costs ~8 ulps
//! at |x| ≈ 3), and `exp` is a Cody–Waite reduction with a degree-7 polynomial, its power of two
//! made from the integer bits. Measured over 2.2 M points of [−15, 15] against `f64` `erfc`
//! (a numpy model of these exact f32 steps, and the unit tests below): at most ~8 ulps, ~1 on
//! average. Inputs under −9.4 give −0 (|gelu| < 2.6e-20 there; candle's formula gives 0 from
//! about −5.4, where `1 + erf` rounds to 0): no intermediate is subnormal, nor is any product of
//! an output with a weight over 1e-18 in the matmul after it (subnormals cost the CPU a slow
//! assist each).
//! f16 / bf16 go through f32 (exact) and round once to their type.
//!
//! No FMA: the AVX2 build rounds every step as the baseline build does (unit test), so results
//! do not depend on the CPU.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use candle_ragged::half_cpu::HalfSlice;
use std::mem::MaybeUninit;

use crate::cpu_pieces::for_pieces;
use crate::switches::on_unless_off;
use crate::Result;
use std::sync::OnceLock;

/// `p` of Abramowitz & Stegun 7.1.26.
const P: f32 = 0.327_591_1;
/// `t` maps `a ∈ [0, 10.7]` onto `[T_MIN, 1]`; the polynomial runs in `s = (t − T_MID) / T_HALF`.
const T_MID: f32 = 0.610_982_25;
const T_INV_HALF: f32 = 2.570_577;
/// `P(s)`, lowest power first (fitted by reweighted least squares on the relative error).
const COEFFS: [f32; 10] = [
    0.428_087_53,
    0.308_811_9,
    0.170_670_97,
    0.070_359_93,
    0.019_874_887,
    0.002_769_819_4,
    -0.000_366_868_33,
    -0.000_216_660_23,
    -2.848_793_7e-6,
    1.132_152_3e-5,
];
/// |x| is clamped to this before the tail is computed (`erfc` there is 5.5e-21); inputs under
/// −FLUSH give −0, positive ones past it `x` (see the module's documentation).
const FLUSH: f32 = 9.4;

/// `exp(hi + lo)` for `hi ∈ [−44.2, 0]` (`−x²/2` with |x| ≤ [`FLUSH`], so `2^n` stays a normal
/// number) and a small `lo` (the rounding rest of `hi`).
#[inline(always)]
fn exp_split(hi: f32, lo: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // 1.5 · 2^23: adding it rounds to an integer, held in the low mantissa bits.
    const MAGIC: f32 = 12_582_912.0;
    const LN2_HI: f32 = 0.693_145_75; // ln 2 with its low 12 bits zero: n · LN2_HI is exact
    const LN2_LO: f32 = 1.428_606_8e-6;
    let shifted = hi * LOG2E + MAGIC;
    let n = shifted - MAGIC;
    let r = hi - n * LN2_HI - n * LN2_LO + lo;
    let mut q = 1.0 / 5040.0;
    for c in [
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ] {
        q = q * r + c;
    }
    // n is the low bits of `shifted` (two's complement around 0x4B40_0000); 2^n from them.
    let n_int = shifted.to_bits().wrapping_sub(0x4B40_0000);
    q * f32::from_bits(n_int.wrapping_add(127) << 23)
}

/// The exact GELU of one value (see the module's documentation for its accuracy).
#[inline(always)]
pub(crate) fn gelu(x: f32) -> f32 {
    let ax = x.abs();
    let ax = if ax > FLUSH { FLUSH } else { ax };
    let t = 1.0 / (1.0 + P * (ax * std::f32::consts::FRAC_1_SQRT_2));
    let s = (t - T_MID) * T_INV_HALF;
    let mut poly = COEFFS[9];
    for &c in COEFFS[..9].iter().rev() {
        poly = poly * s + c;
    }
    // −x²/2 to full precision: |x| = hi + lo with hi's low 12 mantissa bits zero, so hi² is exact.
    let hi = f32::from_bits(ax.to_bits() & 0xFFFF_F000);
    let lo = ax - hi;
    let erfc = t * exp_split(-0.5 * (hi * hi), -0.5 * (lo * (ax + hi))) * poly;
    let y = if x >= 0.0 {
        x * (1.0 - 0.5 * erfc)
    } else {
        0.5 * x * erfc
    };
    if x < -FLUSH {
        -0.0
    } else {
        y
    }
}

#[inline(always)]
fn gelu_slice(src: &[f32], dst: &mut [MaybeUninit<f32>]) {
    for (d, &x) in dst.iter_mut().zip(src) {
        d.write(gelu(x));
    }
}

/// [`gelu_slice`] compiled for AVX-512F (16 lanes) or AVX2 (8 lanes and 256-bit integer ops for
/// the power of two) when the CPU has it; no FMA, so the bits are the baseline build's.
fn gelu_slice_dispatch(src: &[f32], dst: &mut [MaybeUninit<f32>]) {
    #[cfg(target_arch = "x86_64")]
    if wide_gelu() {
        #[target_feature(enable = "avx512f")]
        unsafe fn avx512(src: &[f32], dst: &mut [MaybeUninit<f32>]) {
            gelu_slice(src, dst)
        }
        // SAFETY: the CPU reports AVX-512F.
        return unsafe { avx512(src, dst) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        #[target_feature(enable = "avx2")]
        unsafe fn avx2(src: &[f32], dst: &mut [MaybeUninit<f32>]) {
            gelu_slice(src, dst)
        }
        // SAFETY: the CPU reports AVX2.
        return unsafe { avx2(src, dst) };
    }
    gelu_slice(src, dst)
}

#[inline(always)]
fn gelu_slice_in_place(v: &mut [f32]) {
    for x in v {
        *x = gelu(*x);
    }
}

/// Whether the GELU runs in AVX-512 vectors: the CPU has AVX-512F and
/// `CANDLE_FASTPATH_CPU_GELU_512=0` is not set (read once; for A/B runs). The same bits either
/// way. On a 16-core Intel host the AVX2 form took ~3.4 ns a value a core (a third of DeiT-S's
/// fc1 time at batch 1), its 70-odd vector operations for 8 values the bound.
#[cfg(target_arch = "x86_64")]
fn wide_gelu() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::env::var("CANDLE_FASTPATH_CPU_GELU_512").as_deref() != Ok("0")
    })
}

/// The GELU of each value of `v`, in place (the CPU linear's epilogue), compiled for AVX-512F
/// or AVX2 when the CPU has it, as [`gelu_slice_dispatch`]: the same bits as [`gelu_erf`].
pub(crate) fn gelu_in_place(v: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if wide_gelu() {
        #[target_feature(enable = "avx512f")]
        unsafe fn avx512(v: &mut [f32]) {
            gelu_slice_in_place(v)
        }
        // SAFETY: the CPU reports AVX-512F.
        return unsafe { avx512(v) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        #[target_feature(enable = "avx2")]
        unsafe fn avx2(v: &mut [f32]) {
            gelu_slice_in_place(v)
        }
        // SAFETY: the CPU reports AVX2.
        return unsafe { avx2(v) };
    }
    gelu_slice_in_place(v)
}

/// The GELU of `src` as a new vector, each element written once (no zeroing pass first, as
/// candle's own unary ops allocate theirs).
fn gelu_vec(src: &[f32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(src.len());
    // In pieces over rayon's pool: the matmuls around it run there, and their workers otherwise
    // spin on the other cores while the GELU runs alone (on the 2-core build machine the serial
    // kernel's gain at batch 8 vanished: DeiT-T dense 0.97× against candle's op, 1.24× split;
    // DeiT-S 1.02× and 1.12×, in a build with a switch for it, not kept).
    for_pieces(&mut out.spare_capacity_mut()[..src.len()], 64, |at, d| {
        gelu_slice_dispatch(&src[at..at + d.len()], d)
    });
    // SAFETY: `gelu_slice` wrote each of the first `src.len()` elements.
    unsafe { out.set_len(src.len()) };
    out
}

/// f16 / bf16 values through f32 in chunks ([`candle_ragged::half_cpu`]'s conversions), one rounding
/// to the type at the end.
fn gelu_half<T: HalfSlice>(src: &[T]) -> Vec<T> {
    const CHUNK: usize = 1024;
    let mut wide = [0f32; CHUNK];
    let mut out = vec![T::default(); src.len()];
    for (chunk, out_chunk) in src.chunks(CHUNK).zip(out.chunks_mut(CHUNK)) {
        let wide = &mut wide[..chunk.len()];
        T::widen(chunk, wide);
        gelu_in_place(wide);
        T::narrow(wide, out_chunk);
    }
    out
}

struct GeluErfCpu;

impl CustomOp1 for GeluErfCpu {
    fn name(&self) -> &'static str {
        "fastpath-gelu-erf-cpu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let Some((start, end)) = l.contiguous_offsets() else {
            candle_core::bail!("gelu_erf: the CPU kernel takes contiguous inputs")
        };
        let out = match s {
            CpuStorage::F32(v) => CpuStorage::F32(gelu_vec(&v[start..end])),
            CpuStorage::F16(v) => CpuStorage::F16(gelu_half(&v[start..end])),
            CpuStorage::BF16(v) => CpuStorage::BF16(gelu_half(&v[start..end])),
            other => candle_core::bail!("gelu_erf: no CPU kernel for {:?}", other.dtype()),
        };
        Ok((out, l.shape().clone()))
    }
}

/// The exact (erf) GELU of every element, as candle's `Tensor::gelu_erf` computes it: on the
/// CPU in f32 / f16 / bf16 with this module's vectorised kernel (more accurate than candle's for
/// negative inputs, ~8 ulps at most in f32); other devices and dtypes take candle's op.
/// `CANDLE_FASTPATH_CPU_GELU=0` gives candle's op on the CPU too (A/B knob).
pub fn gelu_erf(x: &Tensor) -> Result<Tensor> {
    static ON: OnceLock<bool> = OnceLock::new();
    if !x.device().is_cpu()
        || !matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)
        || !on_unless_off(&ON, "CANDLE_FASTPATH_CPU_GELU")
    {
        return Ok(x.gelu_erf()?);
    }
    Ok(x.contiguous()?.apply_op1_no_bwd(&GeluErfCpu)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use half::{bf16, f16};

    /// `x·Φ(x)` in f64 from libm's `erfc` (accurate to a few f64 ulps).
    fn exact(x: f32) -> f64 {
        let x = x as f64;
        0.5 * x * libm::erfc(-x / std::f64::consts::SQRT_2)
    }

    /// Distance from `got` to the exact value in units of f32's spacing at that value.
    fn ulps(got: f32, want: f64) -> f64 {
        let w = want as f32;
        let spacing = (f32::from_bits(w.abs().to_bits() + 1) - w.abs()) as f64;
        (got as f64 - want).abs() / spacing
    }

    #[test]
    fn f32_within_ten_ulps_over_the_range() {
        // A dense sweep of [−15, 15] and a finer one around 0, as the module's numpy model.
        let mut worst = (0f64, 0f32);
        let mut sum = 0f64;
        let n = 600_001;
        let sweep = (0..n)
            .map(|i| -15.0 + 30.0 * i as f64 / (n - 1) as f64)
            .chain((0..20_001).map(|i| -1e-3 + 2e-3 * i as f64 / 20_000.0));
        let mut count = 0;
        for x in sweep {
            let x = x as f32;
            let want = exact(x);
            if x < -FLUSH {
                assert_eq!(gelu(x), 0.0);
                assert!(want.abs() < 3e-20);
                continue;
            }
            let e = ulps(gelu(x), want);
            sum += e;
            count += 1;
            if e > worst.0 {
                worst = (e, x);
            }
        }
        assert!(worst.0 <= 10.0, "{} ulps at x = {}", worst.0, worst.1);
        assert!(
            sum / (count as f64) < 2.0,
            "mean {} ulps",
            sum / count as f64
        );
    }

    #[test]
    fn special_values() {
        assert_eq!(gelu(0.0).to_bits(), 0f32.to_bits());
        assert_eq!(gelu(-0.0), 0.0);
        assert_eq!(gelu(f32::INFINITY), f32::INFINITY);
        assert_eq!(gelu(f32::NEG_INFINITY), 0.0);
        assert!(gelu(f32::NAN).is_nan());
        assert_eq!(gelu(100.0), 100.0);
        assert_eq!(gelu(-100.0), 0.0);
        assert_eq!(gelu(f32::MAX), f32::MAX);
        // Subnormal inputs: x·Φ(x) ≈ x/2.
        let tiny = f32::from_bits(1000);
        assert_eq!(gelu(tiny), tiny * 0.5);
        // Just inside the flush bound the tail is still within a few ulps.
        let want = exact(-9.39);
        assert!(ulps(gelu(-9.39), want) <= 10.0, "{} {}", gelu(-9.39), want);
        assert_eq!(gelu(-9.41), 0.0);
    }

    /// The spacing of a format with `mantissa` stored bits and smallest normal exponent
    /// `min_exp` at the value `v`.
    fn spacing(v: f64, mantissa: i32, min_exp: i32) -> f64 {
        let e = if v == 0.0 {
            min_exp
        } else {
            (v.abs().log2().floor() as i32).max(min_exp)
        };
        2f64.powi(e - mantissa)
    }

    #[test]
    fn half_types_within_one_unit_of_the_exact_value() {
        // Every finite f16 and bf16 input: one rounding of an f32 result that is itself within
        // a few f32 ulps, so within one unit of the type of the exact value.
        for bits in 0..=u16::MAX {
            let h = f16::from_bits(bits);
            if h.is_finite() {
                let got = gelu_half(&[h])[0].to_f64();
                let want = exact(h.to_f32());
                assert!(
                    (got - want).abs() <= spacing(want, 10, -14),
                    "f16 x = {h}: {got} against {want}"
                );
            }
            let b = bf16::from_bits(bits);
            if b.is_finite() {
                let got = gelu_half(&[b])[0].to_f64();
                let want = exact(b.to_f32());
                if b.to_f32() < -FLUSH {
                    // Flushed to −0 (module documentation).
                    assert!(got == 0.0 && want.abs() < 3e-20, "bf16 x = {b}: {got}");
                    continue;
                }
                assert!(
                    (got - want).abs() <= spacing(want, 7, -126),
                    "bf16 x = {b}: {got} against {want}"
                );
            }
        }
    }

    #[test]
    fn wide_build_rounds_like_the_baseline() {
        let xs: Vec<f32> = (0..100_003)
            .map(|i| -14.0 + 28.0 * (i as f32) / 100_003.0)
            .collect();
        // The tensor op's pass and the linear's in-place epilogue, each in the widest vectors
        // this CPU has (AVX-512F, AVX2 or the baseline's).
        let wide = gelu_vec(&xs);
        let mut in_place = xs.clone();
        gelu_in_place(&mut in_place);
        for ((&x, &w), &p) in xs.iter().zip(&wide).zip(&in_place) {
            assert_eq!(gelu(x).to_bits(), w.to_bits(), "x = {x}");
            assert_eq!(gelu(x).to_bits(), p.to_bits(), "x = {x} (in place)");
        }
    }

    #[test]
    fn tensor_op_matches_the_scalar_and_takes_views() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 3.0, (7, 33), &dev)?;
        let y = gelu_erf(&x)?.to_vec2::<f32>()?;
        for (row_x, row_y) in x.to_vec2::<f32>()?.iter().zip(&y) {
            for (&a, &b) in row_x.iter().zip(row_y) {
                assert_eq!(gelu(a).to_bits(), b.to_bits());
            }
        }
        // A transposed view (not contiguous) and a narrowed one (an offset).
        let t = gelu_erf(&x.t()?)?.t()?.to_vec2::<f32>()?;
        assert_eq!(t, y);
        let n = gelu_erf(&x.narrow(0, 2, 3)?)?.to_vec2::<f32>()?;
        assert_eq!(n, y[2..5].to_vec());
        // Against candle's op, within candle's own error for negative inputs.
        let c = x.gelu_erf()?.to_vec2::<f32>()?;
        for (row_c, row_y) in c.iter().zip(&y) {
            for (&a, &b) in row_c.iter().zip(row_y) {
                assert!((a - b).abs() <= 1e-6 * a.abs().max(1.0), "{a} {b}");
            }
        }
        // f64 takes candle's op.
        let d = x.to_dtype(DType::F64)?;
        assert_eq!(
            gelu_erf(&d)?.to_vec2::<f64>()?,
            d.gelu_erf()?.to_vec2::<f64>()?
        );
        Ok(())
    }
}
