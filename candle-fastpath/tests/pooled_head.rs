//! PooledMlpHead (DynamicViT's `out_conv` over packed rows) against an f64 reference with the
//! op's rounding points, on fresh random inputs: every dtype, DeiT-T / S / B widths, one to 32
//! images of 2 to 197 rows (partial row tiles, a single patch after the prefix), one or two
//! prefix rows, 60 images (more row tiles than a persistent tail CTA count: tiles in turn),
//! 1,100 short images (more offsets than the tail stages in shared memory),
//! memory poisoned before each call. On CUDA the two-kernel path is asserted to run for f16 /
//! bf16 at DeiT-T / S widths and compared with the composed ops as well; bad inputs are clear
//! errors.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_fastpath::PooledMlpHead;
use candle_ragged::RaggedBatch;
use common::{column_major, device, full_shared_memory, host, poison, quantize, randn};
use rand::{rngs::StdRng, Rng, SeedableRng};

fn gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + libm::erf(x / std::f64::consts::SQRT_2))
}

/// Rounds each value to `dtype` (f64 → f32 → dtype).
fn round(v: Vec<f64>, dtype: DType) -> Vec<f64> {
    let f: Vec<f32> = v.iter().map(|&x| x as f32).collect();
    quantize(&f, dtype).iter().map(|&x| x as f64).collect()
}

struct Layers {
    w0: Vec<f32>,
    b0: Vec<f32>,
    w1: Vec<f32>,
    b1: Vec<f32>,
    w2: Vec<f32>,
    b2: Vec<f32>,
}

/// `n × k` weights (rows of k), each row `out · k` with `w`.
fn matvec(w: &[f32], x: &[f64], k: usize, n: usize, ld: usize, off: usize) -> Vec<f64> {
    (0..n)
        .map(|j| {
            (0..k)
                .map(|i| w[j * ld + off + i] as f64 * x[i])
                .sum::<f64>()
        })
        .collect()
}

/// The head in f64, rounded to `dtype` where the op rounds (the pooled mean, each layer's
/// output before and after its GELU, the logits).
fn reference(
    h: &[f32],
    c: usize,
    offsets: &[usize],
    skip: usize,
    l: &Layers,
    class: usize,
    dtype: DType,
) -> Vec<f64> {
    let (half, q, k) = (c / 2, c / 4, l.b2.len());
    let mut out = Vec::new();
    for win in offsets.windows(2) {
        let (start, end) = (win[0], win[1]);
        let mean: Vec<f64> = (0..half)
            .map(|j| {
                (start + skip..end)
                    .map(|r| h[r * c + half + j] as f64)
                    .sum::<f64>()
                    / (end - start - skip) as f64
            })
            .collect();
        let mean = round(mean, dtype);
        let g: Vec<f64> = matvec(&l.w0, &mean, half, half, c, half)
            .iter()
            .zip(&l.b0)
            .map(|(v, b)| v + *b as f64)
            .collect();
        let g = round(g, dtype);
        for r in start..end {
            let local: Vec<f64> = (0..half).map(|j| h[r * c + j] as f64).collect();
            let y0: Vec<f64> = matvec(&l.w0, &local, half, half, c, 0)
                .iter()
                .zip(&g)
                .map(|(v, g)| v + g)
                .collect();
            let y0 = round(round(y0, dtype).into_iter().map(gelu).collect(), dtype);
            let y1: Vec<f64> = matvec(&l.w1, &y0, half, q, half, 0)
                .iter()
                .zip(&l.b1)
                .map(|(v, b)| v + *b as f64)
                .collect();
            let y1 = round(round(y1, dtype).into_iter().map(gelu).collect(), dtype);
            let z: Vec<f64> = matvec(&l.w2, &y1, q, k, q, 0)
                .iter()
                .zip(&l.b2)
                .map(|(v, b)| v + *b as f64)
                .collect();
            let z = round(z, dtype);
            let m = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let s: f64 = z.iter().map(|v| (v - m).exp()).sum();
            out.push(z[class] - m - s.ln());
        }
    }
    out
}

fn tensor(v: &[f32], dims: &[usize], dtype: DType, dev: &Device) -> Tensor {
    Tensor::from_slice(v, dims, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
        .to_device(dev)
        .unwrap()
}

fn random_layers(rng: &mut StdRng, c: usize, k: usize, dtype: DType) -> Layers {
    let (half, q) = (c / 2, c / 4);
    let mut w =
        |n: usize, fan_in: usize| quantize(&randn(rng, n, 1.0 / (fan_in as f32).sqrt()), dtype);
    Layers {
        w0: w(half * c, c),
        b0: w(half, 16),
        w1: w(q * half, half),
        b1: w(q, 16),
        w2: w(k * q, q),
        b2: w(k, 16),
    }
}

fn head(l: &Layers, c: usize, dtype: DType, dev: &Device) -> PooledMlpHead {
    let (half, q, k) = (c / 2, c / 4, l.b2.len());
    PooledMlpHead::new(
        tensor(&l.w0, &[half, c], dtype, dev),
        tensor(&l.b0, &[half], dtype, dev),
        tensor(&l.w1, &[q, half], dtype, dev),
        tensor(&l.b1, &[q], dtype, dev),
        tensor(&l.w2, &[k, q], dtype, dev),
        tensor(&l.b2, &[k], dtype, dev),
    )
    .unwrap()
}

#[test]
fn matches_the_reference_and_the_composed_ops() {
    let dev = device();
    let mut rng = StdRng::seed_from_u64(80);
    let mut batches: Vec<Vec<usize>> = vec![
        vec![197],
        vec![2],
        vec![3, 63, 64, 65, 2],
        vec![138, 97, 68, 197, 150, 120, 3, 2],
    ];
    batches.push((0..32).map(|_| rng.random_range(3..=197)).collect());
    batches.push((0..60).map(|_| rng.random_range(150..=197)).collect());
    // More images than the tail stages offsets for (1,024): it searches them in global memory.
    batches.push((0..1100).map(|_| rng.random_range(3..=5)).collect());
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        // The log-probability moves by what one rounding of a logit moves it, and a flipped
        // rounding of an intermediate (a different summation order) a little more.
        let tol = match dtype {
            DType::F32 => 1e-5,
            DType::F16 => 5e-3,
            _ => 3e-2,
        };
        for c in [192usize, 384, 768] {
            for (bi, lengths) in batches.iter().enumerate() {
                let skip = 1 + bi % 2;
                let lengths: Vec<usize> = lengths.iter().map(|&l| l.max(skip + 1)).collect();
                let k = 2 + bi % 2;
                let class = bi % k;
                let l = random_layers(&mut rng, c, k, dtype);
                let hd = head(&l, c, dtype, &dev);
                let rows: usize = lengths.iter().sum();
                let hv = quantize(&randn(&mut rng, rows * c, 1.0), dtype);
                let h = tensor(&hv, &[rows, c], dtype, &dev);
                let batch = RaggedBatch::from_lengths(&lengths, &dev).unwrap();
                let mut offsets = vec![0usize];
                for len in &lengths {
                    offsets.push(offsets.last().unwrap() + len);
                }
                let want = reference(&hv, c, &offsets, skip, &l, class, dtype);
                // On the H100 the widths up to DeiT-S's; with less shared memory (the tail of
                // DeiT-S's 192-wide head needs 140 KB) whatever its applies check says.
                let fused = dev.is_cuda() && dtype != DType::F32 && c <= 384;
                if full_shared_memory(&dev) || !fused {
                    assert_eq!(hd.fused_applies(&h), fused, "{dtype:?} C {c}");
                }
                poison(&dev, rows + lengths.len() * c, dtype);
                let got = host(&hd.forward(&h, &batch, skip, class).unwrap());
                poison(&dev, rows * c * 2, dtype);
                let composed = host(&hd.forward_composed(&h, &batch, skip, class).unwrap());
                assert_eq!(got.len(), rows);
                let mut worst = (0f64, 0f64, 0f64);
                for r in 0..rows {
                    let e = (got[r] as f64 - want[r]).abs();
                    let ec = (composed[r] as f64 - want[r]).abs();
                    assert!(
                        got[r].is_finite() && e <= tol && ec <= tol,
                        "{dtype:?} C {c} batch {bi} row {r}: op {} composed {} reference {}",
                        got[r],
                        composed[r],
                        want[r]
                    );
                    worst = (
                        worst.0.max(e),
                        worst.1.max(ec),
                        worst.2.max((got[r] - composed[r]).abs() as f64),
                    );
                }
                eprintln!(
                    "{dtype:?} C {c} batch {bi} ({rows} rows, skip {skip}, {k} classes): worst |op - ref| {:.2e}, |composed - ref| {:.2e}, |op - composed| {:.2e}",
                    worst.0, worst.1, worst.2
                );
            }
        }
    }
}

#[test]
fn bad_inputs_are_clear_errors() {
    let dev = device();
    let mut rng = StdRng::seed_from_u64(81);
    let (c, dtype) = (192usize, DType::F16);
    let l = random_layers(&mut rng, c, 2, dtype);
    let hd = head(&l, c, dtype, &dev);
    let batch = RaggedBatch::from_lengths(&[5, 3], &dev).unwrap();
    let h = tensor(&randn(&mut rng, 8 * c, 1.0), &[8, c], dtype, &dev);
    let err = |r: candle_fastpath::Result<Tensor>| r.unwrap_err().to_string();
    // Rows that are not the batch's.
    let short = h.narrow(0, 0, 7).unwrap();
    assert!(err(hd.forward(&short, &batch, 1, 0)).contains("h (packed rows"));
    // Another width.
    let wide = tensor(&randn(&mut rng, 8 * 384, 1.0), &[8, 384], dtype, &dev);
    assert!(err(hd.forward(&wide, &batch, 1, 0)).contains("h (packed rows"));
    // Another dtype.
    let h32 = h.to_dtype(DType::F32).unwrap();
    assert!(err(hd.forward(&h32, &batch, 1, 0)).contains("dtype"));
    // A class past the classifier's.
    assert!(err(hd.forward(&h, &batch, 1, 2)).contains("class 2 of 2"));
    // An image with nothing after its prefix rows.
    assert!(err(hd.forward(&h, &batch, 3, 0)).contains("none after its 3 prefix rows"));
    // Layers that do not chain.
    let t = |n: &[usize]| tensor(&vec![0.0; n.iter().product()], n, dtype, &dev);
    let bad = PooledMlpHead::new(
        t(&[96, 192]),
        t(&[96]),
        t(&[48, 95]),
        t(&[48]),
        t(&[2, 48]),
        t(&[2]),
    );
    assert!(bad.unwrap_err().to_string().contains("W1 [Q, H]"));
    let one_class = PooledMlpHead::new(
        t(&[96, 192]),
        t(&[96]),
        t(&[48, 96]),
        t(&[48]),
        t(&[1, 48]),
        t(&[1]),
    );
    assert!(one_class.is_err());
}

/// Weights handed over as views (here W0 as the transpose of its transpose) give the same bits
/// as contiguous ones: the head copies them once.
#[test]
fn strided_weights_give_the_same_result() {
    let dev = device();
    let mut rng = StdRng::seed_from_u64(82);
    let (c, dtype) = (192usize, DType::F16);
    let (half, q) = (c / 2, c / 4);
    let l = random_layers(&mut rng, c, 2, dtype);
    let dense = head(&l, c, dtype, &dev);
    let w0t = column_major(&tensor(&l.w0, &[half, c], dtype, &dev));
    assert!(!w0t.is_contiguous());
    let strided = PooledMlpHead::new(
        w0t,
        tensor(&l.b0, &[half], dtype, &dev),
        tensor(&l.w1, &[q, half], dtype, &dev),
        tensor(&l.b1, &[q], dtype, &dev),
        tensor(&l.w2, &[2, q], dtype, &dev),
        tensor(&l.b2, &[2], dtype, &dev),
    )
    .unwrap();
    let lengths = [197usize, 64, 3];
    let rows: usize = lengths.iter().sum();
    let h = tensor(&randn(&mut rng, rows * c, 1.0), &[rows, c], dtype, &dev);
    let batch = RaggedBatch::from_lengths(&lengths, &dev).unwrap();
    let a = host(&dense.forward(&h, &batch, 1, 0).unwrap());
    let b = host(&strided.forward(&h, &batch, 1, 0).unwrap());
    assert_eq!(a, b);
}
