//! The `gelu_phi` formula of `kernels/gelu_phi.cuh`, replayed on the CPU operation for operation
//! (its constants parsed from that file, so the test and the kernels cannot drift apart), against
//! x·Φ(x) in f64: over every finite f16 and every finite bf16 input, and with the two hardware
//! approximations it uses (`rcp.approx`, `ex2.approx`) pushed to their error bounds.
//!
//! The claim it checks: rounded to f16 / bf16, `gelu_phi` gives the correctly rounded GELU at
//! least as often as `0.5·x·(1 + erf(x/√2))` with an f32 erf (the formula the kernels used
//! before, and CUTLASS's GELU), and its relative error stays within a few f32 ulps wherever the
//! result is an f16 normal number.

use half::{bf16, f16};

const HEADER: &str = include_str!("../kernels/gelu_phi.cuh");

/// `constexpr float NAME = VALUE;` from the header.
fn constant(name: &str) -> f32 {
    let needle = format!("constexpr float {name} = ");
    let start = HEADER
        .find(&needle)
        .unwrap_or_else(|| panic!("{name} not in gelu_phi.cuh"))
        + needle.len();
    let end = start + HEADER[start..].find(';').unwrap();
    HEADER[start..end]
        .trim()
        .trim_end_matches('f')
        .parse()
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

struct Coefficients {
    p: f32,
    c: [f32; 6],
    neg_half_log2e: f32,
}

fn coefficients() -> Coefficients {
    Coefficients {
        p: constant("kGeluPhiP"),
        c: [
            "kGeluPhiC1",
            "kGeluPhiC2",
            "kGeluPhiC3",
            "kGeluPhiC4",
            "kGeluPhiC5",
            "kGeluPhiC6",
        ]
        .map(constant),
        neg_half_log2e: constant("kGeluPhiNegHalfLog2e"),
    }
}

/// One f32 ulp step of `v` towards `dir` (+1 / -1), `n` times: the approximate instructions'
/// results anywhere within their documented error.
fn nudge(mut v: f32, dir: i32, n: u32) -> f32 {
    for _ in 0..n {
        if v == 0.0 || !v.is_finite() {
            break;
        }
        let bits = v.to_bits();
        v = f32::from_bits(if (dir > 0) == (v > 0.0) {
            bits + 1
        } else {
            bits - 1
        });
    }
    v
}

/// gelu_phi as the kernel computes it: `fmaf` as `mul_add`, `rcp.approx` as a division nudged by
/// `rcp_err` ulps, `ex2.approx.ftz` as `exp2` nudged by `ex2_err` ulps and flushed below the
/// smallest normal.
fn gelu_phi(k: &Coefficients, x: f32, rcp_err: i32, ex2_err: i32) -> f32 {
    let a = x.abs();
    let t = nudge(
        1.0 / k.p.mul_add(a, 1.0),
        rcp_err.signum(),
        rcp_err.unsigned_abs(),
    );
    let mut s = k.c[5];
    for &c in k.c[..5].iter().rev() {
        s = s.mul_add(t, c);
    }
    s *= t;
    let mut e = nudge(
        (a * k.neg_half_log2e * a).exp2(),
        ex2_err.signum(),
        ex2_err.unsigned_abs(),
    );
    if e < f32::MIN_POSITIVE {
        e = 0.0;
    }
    let phi = if x >= 0.0 {
        (-e).mul_add(s, 1.0)
    } else {
        e * s
    };
    x * phi
}

fn gelu_erf_f32(x: f32) -> f32 {
    0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2))
}

fn gelu_exact(x: f64) -> f64 {
    x * 0.5 * libm::erfc(-x * std::f64::consts::FRAC_1_SQRT_2)
}

struct Stats {
    mismatches: usize,
    max_rel_normal: f64,
}

/// Over `inputs`: how often `f` rounded by `round` differs from the exact value rounded, and the
/// largest relative error where the exact result is at least `normal` in magnitude.
fn stats(inputs: &[f32], f: impl Fn(f32) -> f32, round: impl Fn(f64) -> f64, normal: f64) -> Stats {
    let mut s = Stats {
        mismatches: 0,
        max_rel_normal: 0.0,
    };
    for &x in inputs {
        let want = gelu_exact(x as f64);
        let got = f(x);
        if round(got as f64) != round(want) {
            s.mismatches += 1;
        }
        if want.abs() >= normal {
            s.max_rel_normal = s.max_rel_normal.max((got as f64 - want).abs() / want.abs());
        }
    }
    s
}

/// Every finite value of a 16-bit format, from its bit patterns.
fn all_16bit(from_bits: impl Fn(u16) -> f32) -> Vec<f32> {
    (0..=u16::MAX)
        .map(from_bits)
        .filter(|v| v.is_finite())
        .collect()
}

fn round_f16(v: f64) -> f64 {
    f16::from_f64(v).to_f64()
}

fn round_bf16(v: f64) -> f64 {
    bf16::from_f64(v).to_f64()
}

/// Over every input `xs` of a 16-bit `format` (results rounded by `round`; relative errors taken
/// where the exact GELU is at least `normal`), with the kernel's `rcp.approx` / `ex2.approx`
/// pushed to each (rcp, ex2) ulp error of `errs`: gelu_phi misrounds no more inputs than the erf
/// formula, and its relative error stays below `max_rel`. Returns the erf formula's stats.
fn rounds_as_well_as_erf(
    format: &str,
    xs: &[f32],
    round: fn(f64) -> f64,
    normal: f64,
    errs: &[(i32, i32)],
    max_rel: f64,
) -> Stats {
    let k = coefficients();
    let erf = stats(xs, gelu_erf_f32, round, normal);
    for &(rcp_err, ex2_err) in errs {
        let phi = stats(xs, |x| gelu_phi(&k, x, rcp_err, ex2_err), round, normal);
        eprintln!(
            "{format}, rcp {rcp_err:+} ulp, ex2 {ex2_err:+} ulp: misrounded {} (erf formula {}), \
             max relative error {:.2e} (erf formula {:.2e})",
            phi.mismatches, erf.mismatches, phi.max_rel_normal, erf.max_rel_normal
        );
        assert!(
            phi.mismatches <= erf.mismatches,
            "rcp {rcp_err} ulp, ex2 {ex2_err} ulp: gelu_phi misrounds {} {format} inputs, the \
             erf formula {}",
            phi.mismatches,
            erf.mismatches
        );
        assert!(
            phi.max_rel_normal < max_rel,
            "rcp {rcp_err} ulp, ex2 {ex2_err} ulp: relative error {:.3e} where GELU is a \
             {format} normal",
            phi.max_rel_normal
        );
    }
    erf
}

#[test]
fn every_f16_input_rounds_as_well_as_the_erf_formula() {
    let xs = all_16bit(|b| f16::from_bits(b).to_f32());
    let errs = [(0, 0), (1, 2), (-1, -2), (1, -2), (-1, 2)];
    let erf = rounds_as_well_as_erf("f16", &xs, round_f16, 6.1e-5, &errs, 4e-6);
    // The erf formula cancels for negative x (1 + erf(z) near 0): that is what gelu_phi avoids.
    assert!(erf.max_rel_normal > 1e-4, "{:.3e}", erf.max_rel_normal);
}

#[test]
fn every_bf16_input_rounds_as_well_as_the_erf_formula() {
    let xs = all_16bit(|b| bf16::from_bits(b).to_f32());
    // Weighted looser past |x| = 4 (bf16 keeps 8 bits): still far below bf16's 3.9e-3.
    rounds_as_well_as_erf(
        "bf16",
        &xs,
        round_bf16,
        1e-30,
        &[(0, 0), (1, 2), (-1, -2)],
        2e-4,
    );
}

#[test]
fn special_values_and_a_dense_sweep() {
    let k = coefficients();
    assert_eq!(gelu_phi(&k, 0.0, 0, 0), 0.0);
    assert_eq!(gelu_phi(&k, f32::INFINITY, 0, 0), f32::INFINITY);
    assert!(gelu_phi(&k, f32::NAN, 0, 0).is_nan());
    assert_eq!(gelu_phi(&k, -30.0, 0, 0), 0.0);
    assert_eq!(gelu_phi(&k, 30.0, 0, 0), 30.0);
    // f32 inputs between the 16-bit grids: relative error within a few f32 ulps where the
    // result is above f16's smallest normal, absolute error below 1e-6 everywhere.
    let mut worst_rel: f64 = 0.0;
    let mut worst_abs: f64 = 0.0;
    let n = 2_000_000;
    for i in 0..=n {
        let x = -12.0 + 24.0 * i as f32 / n as f32;
        let want = gelu_exact(x as f64);
        let got = gelu_phi(&k, x, 0, 0) as f64;
        worst_abs = worst_abs.max((got - want).abs());
        if want.abs() >= 6.1e-5 {
            worst_rel = worst_rel.max((got - want).abs() / want.abs());
        }
    }
    assert!(worst_rel < 4e-6, "relative {worst_rel:.3e}");
    assert!(worst_abs < 1e-6, "absolute {worst_abs:.3e}");
}
