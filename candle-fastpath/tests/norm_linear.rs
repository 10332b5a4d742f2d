//! `norm_linear` (a LayerNorm, the Linear after it and optionally the GELU) against the two steps
//! it replaces, `FusedLinear` on `LayerNorm`'s output: on fresh random inputs, every dtype, row
//! counts 1..352 (batch-1 DeiT-T token counts and the tile edges around them), DeiT-T's qkv and
//! fc1 widths, the output memory poisoned (NaN) before each call. On the CPU (CI) the two must
//! be identical; built with `cuda` on a GPU machine the f16 / bf16 calls take the fused kernel
//! (asserted where the rule must take it) and may differ from the two steps only by the GEMM's
//! summation order, within a rounding of the result. `residual_norm_linear` (the output
//! projection and residual in front of norm_linear, a thread-block cluster per row tile on
//! compute capability 9.0) is checked the same way against `FusedLinear::forward_residual`
//! followed by the two steps. `linear_residual_norm` (the same residual add and the LayerNorm
//! after it, at DeiT-S's width: a cluster per row tile) against `forward_residual` and the
//! LayerNorm, and `residual_norm_linear` at that width (which runs it, then the Linear).

mod common;

use candle_core::{DType, Device, Tensor};
use candle_fastpath::{
    linear_residual_norm, linear_residual_norm_applies, norm_linear, norm_linear_applies,
    norm_linear_mode, norm_linear_tile_rows, residual_norm_linear, residual_norm_linear_applies,
    Epilogue, FastpathError, FusedLinear, LayerNorm, NormLinearMode,
};
use common::layers::{random_layer_norm, random_linear};
use common::{
    cluster_kernels_expected, device, full_shared_memory, has_clusters, host, poison, randn,
};
use rand::{rngs::StdRng, SeedableRng};

struct Weights {
    norm: LayerNorm,
    linear: FusedLinear,
}

fn weights(dev: &Device, rng: &mut StdRng, dtype: DType, c: usize, n: usize) -> Weights {
    let norm = random_layer_norm(dev, rng, dtype, c);
    let w_std = 1.0 / (c as f32).sqrt();
    let linear = random_linear(dev, rng, dtype, (n, c), w_std, Some(0.5));
    Weights { norm, linear }
}

/// Rows of a DeiT residual stream: an offset per row and a spread, so the LayerNorm's mean and
/// variance both matter.
fn input(dev: &Device, rng: &mut StdRng, dtype: DType, rows: usize, c: usize) -> Tensor {
    let offsets = randn(rng, rows, 2.0);
    let v: Vec<f32> = randn(rng, rows * c, 3.0)
        .iter()
        .enumerate()
        .map(|(i, x)| x + offsets[i / c])
        .collect();
    Tensor::from_slice(&v, (rows, c), dev)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

fn two_steps(x: &Tensor, w: &Weights, gelu: bool) -> Tensor {
    let h = w.norm.forward_checked(x).unwrap();
    let epilogue = if gelu {
        Epilogue::Gelu
    } else {
        Epilogue::Plain
    };
    w.linear.forward_with(&h, epilogue).unwrap()
}

#[test]
fn matches_the_two_steps() {
    let dev = device();
    let mut rng = StdRng::seed_from_u64(58);
    let c = 192;
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        // DeiT-T's qkv (3C) and fc1 (4C) widths, and one whose last 128-column tile is partial.
        for n in [3 * c, 4 * c, 136] {
            let w = weights(&dev, &mut rng, dtype, c, n);
            // 1,100 and 1,576 rows (DeiT-T at batch 8) take the 64-row tiles of lever 81.
            for rows in [1, 2, 15, 16, 17, 63, 64, 65, 138, 197, 352, 1100, 1576] {
                let x = input(&dev, &mut rng, dtype, rows, c);
                for gelu in [false, true] {
                    let want = host(&two_steps(&x, &w, gelu));
                    let fused_here = norm_linear_applies(&x, &w.norm, &w.linear, gelu);
                    let tile_rows = norm_linear_tile_rows(&x, &w.norm, &w.linear, gelu);
                    assert_eq!(fused_here, tile_rows.is_some());
                    if dev.is_cuda()
                        && dtype != DType::F32
                        && rows.div_ceil(16) * n.div_ceil(128) <= 24
                    {
                        // Two dozen tiles fit one wave on any GPU this runs on.
                        assert!(
                            fused_here,
                            "{dtype:?} rows {rows} n {n}: fused kernel expected"
                        );
                    }
                    if dev.is_cuda()
                        && dtype != DType::F32
                        && rows >= 1100
                        && n > c
                        && norm_linear_mode() == NormLinearMode::OneWave
                    {
                        // Past one wave of 16-row tiles, within one of 64-row tiles at two
                        // CTAs per SM, on any GPU of 75 to 340 SMs (the H100 has 132).
                        assert_eq!(tile_rows, Some(64), "{dtype:?} rows {rows} n {n}");
                    }
                    if !dev.is_cuda() || dtype == DType::F32 {
                        assert!(!fused_here, "{dtype:?} on {dev:?}: no fused kernel there");
                    }
                    poison(&dev, rows * n, dtype);
                    let mut y = norm_linear(&x, &w.norm, &w.linear, gelu).unwrap();
                    if matches!(tile_rows, Some(t) if t != 16) {
                        // A shape's first call with 64-row tiles runs the two steps (so that
                        // its GEMM plan is timed eagerly); the second runs the kernel.
                        assert_eq!(host(&y), want, "{dtype:?} rows {rows} n {n}: first call");
                        poison(&dev, rows * n, dtype);
                        y = norm_linear(&x, &w.norm, &w.linear, gelu).unwrap();
                    }
                    assert_eq!(y.dims(), &[rows, n]);
                    let got = host(&y);
                    // The fused kernel normalises exactly as the LayerNorm kernel does and rounds
                    // where the two steps round; its GEMM sums in another order, which can move
                    // a result across one rounding boundary of the storage type.
                    let tol = match (fused_here, dtype) {
                        (false, _) => 0.0,
                        (true, DType::F16) => 1e-3,
                        (true, _) => 8e-3,
                    };
                    for (i, (g, r)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            g.is_finite() && (g - r).abs() <= tol * (1.0 + r.abs()),
                            "{dtype:?} rows {rows} n {n} gelu {gelu} fused {fused_here}: \
                             element {i} is {g}, two steps give {r}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn keeps_leading_dims_and_reads_views() {
    let dev = device();
    let mut rng = StdRng::seed_from_u64(59);
    let c = 192;
    for dtype in [DType::F32, DType::F16] {
        let w = weights(&dev, &mut rng, dtype, c, 4 * c);
        // [B, N, C] as the dense path holds tokens, and the same rows as an unaligned view (one
        // row in, then a narrowing of the columns: not contiguous, so never the fused kernel).
        let x = input(&dev, &mut rng, dtype, 2 * 197, c)
            .reshape((2, 197, c))
            .unwrap();
        let y = norm_linear(&x, &w.norm, &w.linear, true).unwrap();
        assert_eq!(y.dims(), &[2, 197, 4 * c]);
        let flat = two_steps(&x.reshape((2 * 197, c)).unwrap(), &w, true);
        let tol = if dtype == DType::F32 { 0.0 } else { 1e-3 };
        for (g, r) in host(&y).iter().zip(host(&flat).iter()) {
            assert!((g - r).abs() <= tol * (1.0 + r.abs()), "{g} vs {r}");
        }
        let wide = input(&dev, &mut rng, dtype, 66, c + 8);
        let view = wide.narrow(0, 1, 65).unwrap().narrow(1, 8, c).unwrap();
        assert!(!norm_linear_applies(&view, &w.norm, &w.linear, false));
        let y = norm_linear(&view, &w.norm, &w.linear, false).unwrap();
        let want = two_steps(&view.contiguous().unwrap(), &w, false);
        assert_eq!(host(&y), host(&want));
    }
}

#[test]
fn bad_inputs_are_clear_errors() {
    let dev = device();
    let mut rng = StdRng::seed_from_u64(60);
    let w = weights(&dev, &mut rng, DType::F16, 192, 576);
    // The Linear's in dim is not the norm's width.
    let other = weights(&dev, &mut rng, DType::F16, 384, 576);
    let x = input(&dev, &mut rng, DType::F16, 4, 192);
    match norm_linear(&x, &w.norm, &other.linear, false) {
        Err(FastpathError::ShapeMismatch { op, .. }) => assert_eq!(op, "norm_linear"),
        other => panic!("expected a shape mismatch, got {other:?}"),
    }
    // x of another width, another dtype, or no rows.
    let x384 = input(&dev, &mut rng, DType::F16, 4, 384);
    assert!(norm_linear(&x384, &w.norm, &w.linear, false).is_err());
    let x32 = input(&dev, &mut rng, DType::F32, 4, 192);
    assert!(norm_linear(&x32, &w.norm, &w.linear, true).is_err());
    let empty = Tensor::zeros((0, 192), DType::F16, &dev).unwrap();
    assert!(norm_linear(&empty, &w.norm, &w.linear, false).is_err());
}

#[test]
fn residual_norm_linear_matches_the_steps() {
    let dev = device();
    let mut rng = StdRng::seed_from_u64(61);
    let c = 192;
    // NORM_LINEAR_TEST_QUICK=1 (for racecheck, which runs each launch thousands of times
    // slower): f16, DeiT-T's two fused shapes, two row counts.
    let quick = std::env::var_os("NORM_LINEAR_TEST_QUICK").is_some();
    let dtypes: &[DType] = if quick {
        &[DType::F16]
    } else {
        &[DType::F32, DType::F16, DType::BF16]
    };
    // (the front Linear's K, the back Linear's N): proj (K = C) into fc1 (4C), the same with a
    // partial last tile (still six 128-column tiles: fused), into qkv's 3C (never: five tiles);
    // fc2 (K = 4C) into qkv (3C: six 96-column tiles, fused without the GELU), the same with a
    // partial tile, into 4C (never: eight tiles).
    let shapes: &[(usize, usize)] = if quick {
        &[(c, 4 * c), (4 * c, 3 * c)]
    } else {
        &[
            (c, 4 * c),
            (c, 4 * c - 32),
            (c, 3 * c),
            (4 * c, 3 * c),
            (4 * c, 3 * c - 32),
            (4 * c, 4 * c),
        ]
    };
    let row_counts: &[usize] = if quick {
        &[17, 197]
    } else {
        &[1, 2, 15, 16, 17, 63, 64, 65, 138, 197, 352]
    };
    for &dtype in dtypes {
        for &(k, n) in shapes {
            let proj = weights(&dev, &mut rng, dtype, k, c).linear;
            let w = weights(&dev, &mut rng, dtype, c, n);
            let kernel_shape =
                (k == c && n.div_ceil(128) == 6) || (k == 4 * c && n.div_ceil(96) == 6);
            for &rows in row_counts {
                // The front Linear's input (the attention's output, or fc1's GELU output; unit
                // scale) and the residual stream.
                let o = input(&dev, &mut rng, dtype, rows, k)
                    .affine(0.3, 0.0)
                    .unwrap();
                let r = input(&dev, &mut rng, dtype, rows, c);
                for gelu in [false, true] {
                    let want_x1 = proj.forward_residual(&o, &r).unwrap();
                    let want_y = host(&two_steps(&want_x1, &w, gelu));
                    let want_x1 = host(&want_x1);
                    let fused_here =
                        residual_norm_linear_applies(&o, &r, &proj, &w.norm, &w.linear, gelu);
                    let shape_ok = kernel_shape && !(k == 4 * c && gelu);
                    // The proj form (K = C, 89 KB) fits every GPU with clusters, the fc2 form
                    // (144 KB) only those with the H100's shared memory.
                    if has_clusters(&dev)
                        && dtype != DType::F32
                        && shape_ok
                        && (k == c || full_shared_memory(&dev))
                        && rows.div_ceil(16) * 6 <= 24
                    {
                        assert!(
                            fused_here,
                            "{dtype:?} rows {rows} k {k} n {n} gelu {gelu}: fused kernel expected"
                        );
                    }
                    if !dev.is_cuda() || dtype == DType::F32 || !shape_ok {
                        assert!(
                            !fused_here,
                            "{dtype:?} k {k} n {n} gelu {gelu} on {dev:?}: no fused kernel"
                        );
                    }
                    poison(&dev, rows * (c + n), dtype);
                    let (x1, y) =
                        residual_norm_linear(&o, &r, &proj, &w.norm, &w.linear, gelu).unwrap();
                    assert_eq!(x1.dims(), &[rows, c]);
                    assert_eq!(y.dims(), &[rows, n]);
                    assert!(x1.is_contiguous() && y.is_contiguous());
                    // x1: the projection's summation order may move it by one rounding; y then
                    // sees that through the LayerNorm (a rounding of x1 is ~1e-3 of the row's
                    // spread in f16), and its own GEMM's order.
                    let (tol_x1, tol_y) = match (fused_here, dtype) {
                        (false, _) => (0.0, 0.0),
                        (true, DType::F16) => (1e-3, 4e-3),
                        (true, _) => (8e-3, 3e-2),
                    };
                    for (what, got, want, tol) in [
                        ("x1", host(&x1), &want_x1, tol_x1),
                        ("y", host(&y), &want_y, tol_y),
                    ] {
                        for (i, (g, e)) in got.iter().zip(want.iter()).enumerate() {
                            assert!(
                                g.is_finite() && (g - e).abs() <= tol * (1.0 + e.abs()),
                                "{dtype:?} rows {rows} k {k} n {n} gelu {gelu} fused {fused_here}: \
                                 {what} element {i} is {g}, the steps give {e}"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn residual_norm_linear_bad_inputs_are_clear_errors() {
    let dev = device();
    let mut rng = StdRng::seed_from_u64(62);
    let proj = weights(&dev, &mut rng, DType::F16, 192, 192).linear;
    let w = weights(&dev, &mut rng, DType::F16, 192, 768);
    let o = input(&dev, &mut rng, DType::F16, 4, 192);
    // A residual of another shape, or dtype; a projection of the wrong width.
    let r5 = input(&dev, &mut rng, DType::F16, 5, 192);
    assert!(residual_norm_linear(&o, &r5, &proj, &w.norm, &w.linear, true).is_err());
    let r32 = input(&dev, &mut rng, DType::F32, 4, 192);
    assert!(residual_norm_linear(&o, &r32, &proj, &w.norm, &w.linear, true).is_err());
    let wide = weights(&dev, &mut rng, DType::F16, 192, 384).linear;
    let r = input(&dev, &mut rng, DType::F16, 4, 192);
    assert!(residual_norm_linear(&o, &r, &wide, &w.norm, &w.linear, true).is_err());
    let empty = Tensor::zeros((0, 192), DType::F16, &dev).unwrap();
    assert!(residual_norm_linear(&empty, &empty, &proj, &w.norm, &w.linear, true).is_err());
}

#[test]
fn linear_residual_norm_matches_the_steps() {
    let dev = device();
    let mut rng = StdRng::seed_from_u64(98);
    let c = 384;
    // NORM_LINEAR_TEST_QUICK=1 (racecheck): f16, two row counts.
    let quick = std::env::var_os("NORM_LINEAR_TEST_QUICK").is_some();
    let dtypes: &[DType] = if quick {
        &[DType::F16]
    } else {
        &[DType::F32, DType::F16, DType::BF16]
    };
    let row_counts: &[usize] = if quick {
        &[17, 197]
    } else {
        // 257: 17 row tiles of eight CTAs, past one wave of the H100's 132 SMs (the steps); 448
        // and 513: seven and nine 64-row clusters of the fc2 kernel, within one wave and past
        // it.
        &[1, 2, 15, 16, 17, 63, 64, 65, 138, 197, 256, 257, 448, 513]
    };
    // The fc2 kernel's CTAs per 64 rows (lever 103), unless its switch is off.
    let fc2_ctas = candle_fastpath::thin_residual_norm_tiles().map(|t| match t {
        candle_fastpath::ThinResidualNormTiles::N96S4 => 16,
        candle_fastpath::ThinResidualNormTiles::N64S2 => 12,
    });
    for &dtype in dtypes {
        // proj (K = C: lever 98's kernel) and fc2 (K = 4C: lever 103's) in front; fc1 (4C,
        // GELU) or qkv (3C) behind.
        for (k, n, gelu) in [(c, 4 * c, true), (4 * c, 3 * c, false)] {
            let front = weights(&dev, &mut rng, dtype, k, c).linear;
            let w = weights(&dev, &mut rng, dtype, c, n);
            for &rows in row_counts {
                let o = input(&dev, &mut rng, dtype, rows, k)
                    .affine(0.3, 0.0)
                    .unwrap();
                let r = input(&dev, &mut rng, dtype, rows, c);
                let want_x1 = front.forward_residual(&o, &r).unwrap();
                let want_z = host(&w.norm.forward_checked(&want_x1).unwrap());
                let want_y = host(&two_steps(&want_x1, &w, gelu));
                let want_x1 = host(&want_x1);
                let fused = linear_residual_norm_applies(&o, &r, &front, &w.norm);
                let label = format!("{dtype:?} rows {rows} k {k}");
                // The kernels: proj (K = C) up to 256 rows (16 tiles of eight CTAs); fc2 (K =
                // 4C) up to one wave of its clusters on an H100 / H200 (132 SMs).
                let kernel_shape = (k == c && rows <= 256)
                    || (k == 4 * c && fc2_ctas.is_some_and(|n| rows.div_ceil(64) * n <= 132));
                if cluster_kernels_expected(&dev) == Some(true)
                    && dtype != DType::F32
                    && kernel_shape
                {
                    assert!(fused, "{label}: fused kernel expected");
                }
                if !dev.is_cuda() || dtype == DType::F32 || !kernel_shape {
                    assert!(!fused, "{label} on {dev:?}: no fused kernel");
                }
                poison(&dev, 2 * rows * c, dtype);
                let (x1, z) = linear_residual_norm(&o, &r, &front, &w.norm).unwrap();
                assert_eq!(x1.dims(), &[rows, c]);
                assert_eq!(z.dims(), &[rows, c]);
                assert!(x1.is_contiguous() && z.is_contiguous());
                // x1: the GEMM's summation order may move it by a rounding; z is the
                // LayerNorm's own output for that x1, bit for bit.
                let tol_x1 = match (fused, dtype) {
                    (false, _) => 0.0,
                    (true, DType::F16) => 1e-3,
                    (true, _) => 8e-3,
                };
                let got_x1 = host(&x1);
                for (i, (g, e)) in got_x1.iter().zip(&want_x1).enumerate() {
                    assert!(
                        g.is_finite() && (g - e).abs() <= tol_x1 * (1.0 + e.abs()),
                        "{label} fused {fused}: x1 element {i} is {g}, the steps give {e}"
                    );
                }
                let z_of_x1 = host(&w.norm.forward_checked(&x1).unwrap());
                let got_z = host(&z);
                assert!(got_z.iter().all(|v| v.is_finite()), "{label}: z not finite");
                assert_eq!(got_z, z_of_x1, "{label}: z is not the LayerNorm of x1");
                if !fused {
                    assert_eq!(got_z, want_z, "{label}: the steps' z");
                }
                // residual_norm_linear at this width runs it, then the Linear.
                poison(&dev, rows * (c + n), dtype);
                let (x1b, y) =
                    residual_norm_linear(&o, &r, &front, &w.norm, &w.linear, gelu).unwrap();
                assert_eq!(host(&x1b), got_x1, "{label}: residual_norm_linear's x1");
                let tol_y = match (fused, dtype) {
                    (false, _) => 0.0,
                    (true, DType::F16) => 4e-3,
                    (true, _) => 3e-2,
                };
                for (i, (g, e)) in host(&y).iter().zip(&want_y).enumerate() {
                    assert!(
                        g.is_finite() && (g - e).abs() <= tol_y * (1.0 + e.abs()),
                        "{label} fused {fused}: y element {i} is {g}, the steps give {e}"
                    );
                }
            }
        }
    }
}

#[test]
fn linear_residual_norm_bad_inputs_are_clear_errors() {
    let dev = device();
    let mut rng = StdRng::seed_from_u64(99);
    let c = 384;
    let front = weights(&dev, &mut rng, DType::F16, c, c).linear;
    let norm = weights(&dev, &mut rng, DType::F16, c, c).norm;
    let o = input(&dev, &mut rng, DType::F16, 4, c);
    // A residual of other rows, or dtype; a front Linear of the wrong width; no rows.
    let r5 = input(&dev, &mut rng, DType::F16, 5, c);
    assert!(!linear_residual_norm_applies(&o, &r5, &front, &norm));
    assert!(linear_residual_norm(&o, &r5, &front, &norm).is_err());
    let r32 = input(&dev, &mut rng, DType::F32, 4, c);
    assert!(!linear_residual_norm_applies(&o, &r32, &front, &norm));
    assert!(linear_residual_norm(&o, &r32, &front, &norm).is_err());
    let narrow = weights(&dev, &mut rng, DType::F16, c, 192).linear;
    let r = input(&dev, &mut rng, DType::F16, 4, c);
    assert!(!linear_residual_norm_applies(&o, &r, &narrow, &norm));
    assert!(linear_residual_norm(&o, &r, &narrow, &norm).is_err());
    let empty = Tensor::zeros((0, c), DType::F16, &dev).unwrap();
    assert!(!linear_residual_norm_applies(&empty, &empty, &front, &norm));
    assert!(linear_residual_norm(&empty, &empty, &front, &norm).is_err());
}
