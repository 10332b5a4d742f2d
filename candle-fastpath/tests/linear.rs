//! FusedLinear against an f64 reference on fresh random inputs: every epilogue, with and without
//! bias, f32/f16/bf16, odd and ViT-sized shapes, row counts 1..577, inputs at unaligned offsets.
//! On CPU this checks the layer's semantics; built with `cuda` on a GPU machine it checks the
//! cuBLASLt path and the GELU kernel, with the output memory poisoned (NaN) before each call.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_fastpath::{Epilogue, FastpathError, FusedLinear};
use common::{device, host, poison, quantize, randn};
use rand::{rngs::StdRng, SeedableRng};

fn gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + libm::erf(x / std::f64::consts::SQRT_2))
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    Plain,
    Gelu,
    Residual,
    ResidualGelu,
}

#[allow(clippy::too_many_arguments)]
fn check(
    dev: &Device,
    rng: &mut StdRng,
    dtype: DType,
    m: usize,
    k: usize,
    n: usize,
    bias: bool,
    kind: Kind,
    offset_rows: usize,
    // x is then the last k columns of a [.., extra_cols + k] buffer: strided rows.
    extra_cols: usize,
) -> bool {
    let w = quantize(&randn(rng, n * k, 1.0 / (k as f32).sqrt()), dtype);
    let b = quantize(&randn(rng, n, 0.5), dtype);
    // x is a view starting `offset_rows` rows into a larger buffer (unaligned when odd).
    let width = extra_cols + k;
    let x_all = quantize(&randn(rng, (m + offset_rows) * width, 1.0), dtype);
    let r = quantize(&randn(rng, m * n, 1.0), dtype);
    let to = |v: &[f32], shape: &[usize]| {
        Tensor::from_slice(v, shape, dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    };
    let layer = FusedLinear::new(to(&w, &[n, k]), bias.then(|| to(&b, &[n]))).unwrap();
    let x = to(&x_all, &[m + offset_rows, width])
        .narrow(0, offset_rows, m)
        .unwrap()
        .narrow(1, extra_cols, k)
        .unwrap();
    let res = to(&r, &[m, n]);
    poison(dev, m * n, dtype);
    let epilogue = match kind {
        Kind::Plain => Epilogue::Plain,
        Kind::Gelu => Epilogue::Gelu,
        Kind::Residual => Epilogue::Residual(&res),
        Kind::ResidualGelu => Epilogue::ResidualGelu(&res),
    };
    let thin = layer.thin_gemm_applies(&x, epilogue);
    let got = host(&layer.forward_with(&x, epilogue).unwrap());
    assert_eq!(got.len(), m * n);
    // Both paths round once to `dtype` (the candle-ops fallback, CANDLE_FASTPATH_CPU_LINEAR=0,
    // rounds the product, the biased sum and the residual sum in turn): allow a few roundings of
    // the largest term.
    let tol = match dtype {
        DType::F32 => 1e-5,
        DType::F16 => 3e-3,
        _ => 2e-2,
    };
    let x = &x_all[offset_rows * width..];
    for i in 0..m {
        for j in 0..n {
            let mut acc = if bias { b[j] as f64 } else { 0.0 };
            for t in 0..k {
                acc += x[i * width + extra_cols + t] as f64 * w[j * k + t] as f64;
            }
            let want = match kind {
                Kind::Plain => acc,
                Kind::Gelu => gelu(acc),
                Kind::Residual => acc + r[i * n + j] as f64,
                Kind::ResidualGelu => gelu(acc + r[i * n + j] as f64),
            };
            let g = got[i * n + j] as f64;
            let scale = 1.0
                + acc.abs()
                + matches!(kind, Kind::Residual | Kind::ResidualGelu) as u8 as f64
                    * r[i * n + j].abs() as f64;
            assert!(
                (g - want).abs() <= tol * scale,
                "{dtype:?} m={m} k={k} n={n} bias={bias} {kind:?} offset={offset_rows} \
                 extra_cols={extra_cols}: [{i}, {j}] got {g}, want {want}"
            );
        }
    }
    thin
}

/// The thin GEMM (levers 100 and 130): DeiT-S's fc1 (N = 1536) and qkv (N = 1152), DeiT-B's fc1
/// (N = 3072), qkv (N = 2304) and head (N = 1000: a last column tile mostly past N) at batch-1
/// row counts, tile edges (64-row tiles) and the first row counts past one wave, plain and GELU,
/// inputs at row offsets into a larger buffer. Built with `cuda` on an H100 / H200 it asserts
/// where the kernel runs (f16 / bf16 with a bias, unless `CANDLE_FASTPATH_THIN_GEMM` turns it
/// off, or, for the GELU, `CANDLE_FASTPATH_GELU=erf`; K = 768 for at most 320 rows unless
/// `CANDLE_FASTPATH_THIN_GEMM_WIDE=0`) and where it does not.
#[test]
fn thin_gemm_matches_reference_at_batch_one_rows() {
    let dev = device();
    let mut rng = StdRng::seed_from_u64(99);
    let mode = candle_fastpath::thin_gemm_mode();
    for dtype in [DType::F16, DType::BF16, DType::F32] {
        // (K, N, rows).
        let shapes: &[(usize, usize, &[usize])] = if dtype == DType::F32 {
            &[(384, 1536, &[1, 65]), (768, 3072, &[1, 65])]
        } else {
            &[
                (384, 1536, &[1, 2, 63, 64, 65, 138, 197, 320, 321]),
                (384, 1152, &[17, 129, 448, 449]),
                (768, 3072, &[1, 2, 65, 138, 197, 320, 321]),
                (768, 2304, &[63, 197, 448, 449]),
                (768, 1000, &[1, 8]),
            ]
        };
        for &(k, n, ms) in shapes {
            for &m in ms {
                for kind in [Kind::Plain, Kind::Gelu] {
                    let thin = check(&dev, &mut rng, dtype, m, k, n, true, kind, m % 3, 0);
                    // One wave of 64-row tiles on an H100 / H200 (132 SMs): 64 columns a tile at
                    // K = 384, 128 at 768.
                    let tile_n = if k == 768 { 128 } else { 64 };
                    let one_wave = m.div_ceil(64) * n.div_ceil(tile_n) <= 132;
                    // The GELU epilogue only in the default x·Φ(x) form (not under
                    // CANDLE_FASTPATH_GELU=erf).
                    let allowed = match kind {
                        Kind::Plain => mode == candle_fastpath::ThinGemmMode::On,
                        _ => {
                            mode != candle_fastpath::ThinGemmMode::Off
                                && candle_fastpath::gelu_phi_form()
                        }
                    };
                    // K = 768 for at most 320 rows (batch-1 row counts).
                    let wide_ok = k == 384 || (candle_fastpath::thin_gemm_wide() && m <= 320);
                    let want =
                        dev.is_cuda() && dtype != DType::F32 && one_wave && allowed && wide_ok;
                    assert_eq!(thin, want, "{dtype:?} m={m} k={k} n={n} {kind:?}");
                }
            }
        }
        // Without a bias, or a strided view of wider rows, the other path runs.
        for (bias, extra) in [(false, 0), (true, 8)] {
            let thin = check(
                &dev,
                &mut rng,
                dtype,
                197,
                384,
                1536,
                bias,
                Kind::Gelu,
                0,
                extra,
            );
            assert!(!thin, "{dtype:?} bias={bias} extra_cols={extra}");
        }
    }
}

/// On the CPU the product runs on the weight's panels wherever the CPU has AVX2 and FMA (so the
/// reference tests here check that kernel in CI), unless switched off; a layer's later calls,
/// which use the panels its first call packed, and its clones' give the first call's bits, in
/// every dtype.
#[test]
fn cpu_panels_apply_and_give_the_same_bits_every_call() {
    #[cfg(target_arch = "x86_64")]
    let fma =
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma");
    #[cfg(not(target_arch = "x86_64"))]
    let fma = false;
    let off = matches!(
        std::env::var("CANDLE_FASTPATH_CPU_PACKED").as_deref(),
        Ok("0") | Ok("off")
    );
    assert_eq!(candle_fastpath::cpu_packed(), fma && !off);
    let mut rng = StdRng::seed_from_u64(5);
    let (m, k, n) = (70, 300, 40);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let to = |v: Vec<f32>, shape: &[usize]| {
            Tensor::from_vec(v, shape, &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
        };
        let layer = FusedLinear::new(
            to(randn(&mut rng, n * k, 0.1), &[n, k]),
            Some(to(randn(&mut rng, n, 0.5), &[n])),
        )
        .unwrap();
        let x = to(randn(&mut rng, m * k, 1.0), &[m, k]);
        let first = host(&layer.forward_with(&x, Epilogue::Gelu).unwrap());
        let again = host(&layer.forward_with(&x, Epilogue::Gelu).unwrap());
        let clone = host(&layer.clone().forward_with(&x, Epilogue::Gelu).unwrap());
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&first), bits(&again), "{dtype:?}: second call");
        assert_eq!(bits(&first), bits(&clone), "{dtype:?}: clone");
    }
}

/// A CPU layer that holds only its panels gives its weight back bit for bit (unpacked on
/// request), in every dtype and with a partial last panel, and answers the dims and dtype /
/// device checks as the tensor would.
#[test]
fn cpu_layer_gives_its_weight_back() {
    let mut rng = StdRng::seed_from_u64(6);
    let (k, n) = (37, 21);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let w = Tensor::from_vec(randn(&mut rng, n * k, 1.0), (n, k), &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let layer = FusedLinear::new(w.clone(), None).unwrap();
        assert_eq!((layer.out_dim(), layer.in_dim()), (n, k));
        assert_eq!(layer.weight().dtype(), dtype);
        assert_eq!(layer.weight().dims(), &[n, k]);
        let bits = |t: &Tensor| {
            t.to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>()
        };
        assert_eq!(bits(layer.weight()), bits(&w), "{dtype:?}");
        let other = if dtype == DType::F32 {
            DType::F16
        } else {
            DType::F32
        };
        let x = Tensor::zeros((2, k), other, &Device::Cpu).unwrap();
        assert!(matches!(
            layer.forward_with(&x, Epilogue::Plain),
            Err(FastpathError::DTypeMismatch { .. })
        ));
    }
}

#[test]
fn matches_reference_every_epilogue_dtype_and_shape() {
    let dev = device();
    let mut rng = StdRng::seed_from_u64(11);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for &(k, n) in &[(64, 192), (7, 5), (40, 24), (300, 40), (384, 1152)] {
            for &m in &[1, 2, 63, 64, 65, 197, 577] {
                for kind in [Kind::Plain, Kind::Gelu, Kind::Residual, Kind::ResidualGelu] {
                    let bias = m % 2 == 1 || matches!(kind, Kind::Gelu);
                    check(&dev, &mut rng, dtype, m, k, n, bias, kind, m % 3, 0);
                }
            }
        }
        // DeiT-B's MLP and a large row count (a packed batch of 256 pruned images).
        check(
            &dev,
            &mut rng,
            dtype,
            1031,
            768,
            3072,
            true,
            Kind::Gelu,
            0,
            0,
        );
        check(
            &dev,
            &mut rng,
            dtype,
            1031,
            3072,
            768,
            true,
            Kind::Residual,
            1,
            0,
        );
        // Enough 128 x 128 output tiles to fill an H100 (132 SMs) in the plain and the residual
        // epilogue too, so the large-tile GEMMs (cuBLASLt's, and CUTLASS's when switched on) are
        // checked there.
        check(
            &dev,
            &mut rng,
            dtype,
            2113,
            384,
            1152,
            true,
            Kind::Plain,
            0,
            0,
        );
        check(
            &dev,
            &mut rng,
            dtype,
            5651,
            256,
            384,
            true,
            Kind::Residual,
            3,
            0,
        );
    }
}

#[test]
fn column_slices_are_read_in_place_with_every_epilogue() {
    // DynamicViT's predictor feeds the first half of a [rows, C] tensor to a Linear: rows strided
    // by C. Odd widths make the leading dimension unaligned too.
    let dev = device();
    let mut rng = StdRng::seed_from_u64(12);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for &(k, n, extra) in &[(192, 192, 192), (48, 48, 48), (7, 5, 3), (64, 24, 1)] {
            for &m in &[1, 2, 65, 197] {
                for kind in [Kind::Plain, Kind::Gelu, Kind::Residual, Kind::ResidualGelu] {
                    check(
                        &dev,
                        &mut rng,
                        dtype,
                        m,
                        k,
                        n,
                        m % 2 == 1,
                        kind,
                        m % 3,
                        extra,
                    );
                }
            }
        }
    }
}

#[test]
fn leading_dims_are_kept() {
    let dev = device();
    let layer = FusedLinear::new(
        Tensor::ones((6, 4), DType::F32, &dev).unwrap(),
        Some(Tensor::zeros(6, DType::F32, &dev).unwrap()),
    )
    .unwrap();
    let x = Tensor::ones((2, 3, 4), DType::F32, &dev).unwrap();
    let y = layer.forward_with(&x, Epilogue::Plain).unwrap();
    assert_eq!(y.dims(), &[2, 3, 6]);
    let v = y.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert!(v.iter().all(|&e| e == 4.0), "{v:?}");
    // A transposed (strided) input is made contiguous first, with the same result.
    let xt = Tensor::ones((4, 5), DType::F32, &dev).unwrap().t().unwrap();
    assert_eq!(
        layer.forward_with(&xt, Epilogue::Plain).unwrap().dims(),
        &[5, 6]
    );
}

fn expect_err<T: std::fmt::Debug>(r: candle_fastpath::Result<T>, needle: &str) -> FastpathError {
    let e = r.expect_err("expected an error");
    let msg = e.to_string();
    assert!(
        msg.contains(needle),
        "error `{msg}` does not mention `{needle}`"
    );
    e
}

#[test]
fn bad_inputs_are_clear_errors() {
    let dev = device();
    let w = Tensor::zeros((6, 4), DType::F32, &dev).unwrap();
    let b = Tensor::zeros(6, DType::F32, &dev).unwrap();
    expect_err(
        FusedLinear::new(Tensor::zeros(4, DType::F32, &dev).unwrap(), None),
        "weight must have rank 2",
    );
    expect_err(
        FusedLinear::new(w.clone(), Some(Tensor::zeros(5, DType::F32, &dev).unwrap())),
        "bias has shape [5], expected [6]",
    );
    expect_err(
        FusedLinear::new(w.clone(), Some(Tensor::zeros(6, DType::F16, &dev).unwrap())),
        "dtype mismatch, bias is F16",
    );
    expect_err(
        FusedLinear::new(Tensor::zeros((6, 4), DType::U32, &dev).unwrap(), None),
        "unsupported dtype U32",
    );
    let layer = FusedLinear::new(w, Some(b)).unwrap();
    expect_err(
        layer.forward_with(
            &Tensor::zeros((3, 5), DType::F32, &dev).unwrap(),
            Epilogue::Plain,
        ),
        "x must have rank at least 1",
    );
    expect_err(
        layer.forward_with(
            &Tensor::zeros((0, 4), DType::F32, &dev).unwrap(),
            Epilogue::Plain,
        ),
        "x has no elements",
    );
    expect_err(
        layer.forward_with(
            &Tensor::zeros((3, 4), DType::F16, &dev).unwrap(),
            Epilogue::Gelu,
        ),
        "dtype mismatch, x is F16",
    );
    let x = Tensor::zeros((3, 4), DType::F32, &dev).unwrap();
    let bad_res = Tensor::zeros((3, 5), DType::F32, &dev).unwrap();
    expect_err(
        layer.forward_with(&x, Epilogue::Residual(&bad_res)),
        "residual has shape [3, 5], expected [3, 6]",
    );
    if dev.is_cuda() {
        let cpu_x = Tensor::zeros((3, 4), DType::F32, &Device::Cpu).unwrap();
        expect_err(layer.forward_with(&cpu_x, Epilogue::Plain), "x is on Cpu");
    }
}
