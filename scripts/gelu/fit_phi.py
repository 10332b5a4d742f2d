#!/usr/bin/env python3
"""Fits the coefficients of candle-fastpath's `gelu_phi` (kernels/gelu_phi.cuh).

GELU(x) = x * Phi(x), with the normal tail q = Phi(-|x|) = exp(-x^2/2) * P(t), t = 1 / (1 + p|x|),
P(t) = c1 t + ... + c6 t^6 (the Abramowitz-Stegun 26.2.17 form, refitted), and Phi(x) = 1 - q for
x >= 0, q for x < 0. Computing the tail directly keeps the relative accuracy for negative x, where
0.5 * x * (1 + erf(x / sqrt 2)) cancels (1 + erf(z) near 0).

The fit is minimax of the relative error of P against Phi(-a) exp(a^2 / 2) for a in [0, 13],
weighted 1 on [0, 4] (f16's normal range of GELU for negative x ends near x = -3.9) and 0.01
beyond (bf16, and f16 subnormals, need far less there), by linear programming for each p on a
grid, p rounded to f32 and the coefficients refitted for it. Needs numpy and scipy.

    python3 scripts/gelu/fit_phi.py      # prints p and c1..c6 as f32 literals
"""
import numpy as np
from scipy.optimize import linprog
from scipy.special import log_ndtr

A = 13.0
a = np.concatenate([np.linspace(0, 4, 4000), np.linspace(4, A, 3000)[1:]])
target = np.exp(log_ndtr(-a) + a * a / 2)  # Phi(-a) * exp(a^2 / 2)
weight = np.where(a <= 4.0, 1.0, 0.01)
N = 6


def fit(p):
    t = 1 / (1 + p * a)
    v = np.stack([t ** (k + 1) for k in range(N)], 1) / target[:, None] * weight[:, None]
    cost = np.zeros(N + 1)
    cost[-1] = 1
    ones = np.ones((len(a), 1))
    res = linprog(
        cost,
        A_ub=np.vstack([np.hstack([v, -ones]), np.hstack([-v, -ones])]),
        b_ub=np.concatenate([weight, -weight]),
        bounds=[(None, None)] * N + [(0, None)],
        method="highs",
    )
    return res.x[:-1], res.x[-1]


best = min((fit(p)[1], p) for p in np.linspace(0.25, 0.35, 201))
p = float(np.float32(best[1]))
coef, err = fit(p)
print(f"// weighted max relative error of P: {err:.3e}")
print(f"p = {float(np.float32(p))!r}f")
for i, c in enumerate(coef.astype(np.float32), 1):
    print(f"c{i} = {float(c)!r}f")
