// GELU(x) = x · Φ(x) (the exact GELU timm's nn.GELU() computes), evaluated through the normal
// tail instead of erf:
//   q = Φ(−|x|) = exp(−x²/2) · (c1·t + c2·t² + … + c6·t⁶),  t = 1 / (1 + p·|x|)
//   Φ(x) = 1 − q for x ≥ 0, q for x < 0
// (the form of Abramowitz & Stegun 26.2.17, coefficients refitted by scripts/gelu/fit_phi.py for
// relative accuracy: ≤ 6.8e-7 relative error of the polynomial for |x| ≤ 4, ≤ 6.8e-5 beyond).
//
// Why not 0.5 · x · (1 + erff(x / √2)): for negative x that sum cancels (1 + erf(z) near 0), so
// its relative error reaches ~1e-3 where GELU is still an f16 normal number (x ≈ −3.9); here q is
// computed directly and the relative error stays within ~2e-6 there. It also costs fewer
// instructions: one reciprocal and one exp2 on the special-function unit, ~14 FMA-pipe
// instructions, where erff's two coefficient sets take eight selects on top of its polynomial.
// candle-fastpath/tests/gelu_phi.rs replays this function on the CPU over every f16 and bf16
// input (its constants are parsed from this file).
#pragma once

constexpr float kGeluPhiP = 0.2955f;
constexpr float kGeluPhiC1 = 0.11880810558795929f;
constexpr float kGeluPhiC2 = 0.10612059384584427f;
constexpr float kGeluPhiC3 = 0.166685551404953f;
constexpr float kGeluPhiC4 = -0.06301618367433548f;
constexpr float kGeluPhiC5 = 0.25743865966796875f;
constexpr float kGeluPhiC6 = -0.0860370546579361f;
constexpr float kGeluPhiNegHalfLog2e = -0.72134752044448170f;  // −log2(e) / 2

#if defined(__CUDACC__)
__device__ __forceinline__ float gelu_phi_rcp(float v) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
    return r;
}

__device__ __forceinline__ float gelu_phi_ex2(float v) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
    return r;
}

__device__ __forceinline__ float gelu_phi(float x) {
    const float a = fabsf(x);
    const float t = gelu_phi_rcp(fmaf(kGeluPhiP, a, 1.0f));
    float s = kGeluPhiC6;
    s = fmaf(s, t, kGeluPhiC5);
    s = fmaf(s, t, kGeluPhiC4);
    s = fmaf(s, t, kGeluPhiC3);
    s = fmaf(s, t, kGeluPhiC2);
    s = fmaf(s, t, kGeluPhiC1);
    s *= t;
    const float e = gelu_phi_ex2(a * kGeluPhiNegHalfLog2e * a);
    // Spelled out so that nvcc's FMA contraction cannot change it: 1 − e·s in one rounding for
    // x ≥ 0, the rounded product e·s for x < 0 (tests/gelu_phi.rs replays exactly this).
    const float phi = x >= 0.0f ? fmaf(-e, s, 1.0f) : __fmul_rn(e, s);
    return __fmul_rn(x, phi);
}
#endif
