//! patchify against an independent host loop over the conv's index map: f32/f16/bf16 output,
//! 1-4 channels, square and non-square images, patch sizes 1, 2, 4, 6, 8, 16 (4, 8 and 16 with
//! widths divisible by 4 take the CUDA kernel's 4-pixel path, 1, 2 and 6 its per-pixel one);
//! with and without zero leading rows per image; pixels in f32, f16 or bf16 (16-bit pixels of the
//! output's type take the kernel's copy path, lever 114; other pairs the candle-ops path); output
//! memory poisoned.

mod common;

use candle_core::{DType, Tensor};
use candle_fastpath::{patchify, patchify_after_zero_rows};
use common::{device, host, poison, quantize};

#[test]
fn matches_the_conv_index_map() {
    let dev = device();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for &shape in &[
            (2, 3, 32, 48, 16),
            (1, 1, 4, 4, 1),
            (3, 4, 8, 12, 4),
            (2, 3, 224, 224, 16),
            (1, 3, 16, 24, 8),
            (2, 1, 24, 40, 8),
            (2, 3, 6, 10, 2),
            (1, 2, 12, 12, 6),
        ] {
            for px_dtype in [DType::F32, DType::F16, DType::BF16] {
                // lead 0 is `patchify`; 1 and 2 put zero rows (the class / distillation slots)
                // in front of each image's patch rows.
                for lead in [0, 1, 2] {
                    check_patch_rows(&dev, shape, px_dtype, dtype, lead);
                }
            }
        }
    }
}

/// `[b, c, h, w]` pixels (`px_dtype`) cut into `p × p` patches as `dtype` rows after `lead` zero
/// rows per image, against the conv's index map on the host.
fn check_patch_rows(
    dev: &candle_core::Device,
    (b, c, h, w, p): (usize, usize, usize, usize, usize),
    px_dtype: DType,
    dtype: DType,
    lead: usize,
) {
    let n = b * c * h * w;
    let px: Vec<f32> = (0..n)
        .map(|i| ((i * 7919) % 1000) as f32 / 97.0 - 5.0)
        .collect();
    let t = Tensor::from_slice(&px, (b, c, h, w), dev)
        .unwrap()
        .to_dtype(px_dtype)
        .unwrap();
    let (gh, gw) = (h / p, w / p);
    let cols = c * p * p;
    poison(dev, n + b * lead * cols, dtype);
    let out = if lead == 0 {
        patchify(&t, p, dtype).unwrap()
    } else {
        patchify_after_zero_rows(&t, p, dtype, lead).unwrap()
    };
    let image_rows = lead + gh * gw;
    assert_eq!(out.dims(), &[b * image_rows, cols]);
    assert_eq!(out.dtype(), dtype);
    let got = host(&out);
    // The pixels as their own dtype holds them, then as the op's output dtype does.
    let rounded = quantize(&quantize(&px, px_dtype), dtype);
    for bi in 0..b {
        for r in 0..lead {
            let row = bi * image_rows + r;
            assert!(
                got[row * cols..(row + 1) * cols].iter().all(|&v| v == 0.0),
                "{dtype:?} {b}x{c}x{h}x{w}/{p} lead {lead}: row {row} not zero"
            );
        }
        for gy in 0..gh {
            for gx in 0..gw {
                let row = bi * image_rows + lead + gy * gw + gx;
                for ch in 0..c {
                    for y in 0..p {
                        for x in 0..p {
                            let col = (ch * p + y) * p + x;
                            let want = rounded[((bi * c + ch) * h + gy * p + y) * w + gx * p + x];
                            assert_eq!(
                                got[row * cols + col],
                                want,
                                "{px_dtype:?} → {dtype:?} {b}x{c}x{h}x{w}/{p} lead {lead} row {row} col {col}"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn bad_inputs_are_clear_errors() {
    let dev = device();
    let t = Tensor::zeros((1, 3, 10, 16), DType::F32, &dev).unwrap();
    assert!(patchify(&t, 4, DType::F32)
        .unwrap_err()
        .to_string()
        .contains("do not split into 4×4 patches"));
    assert!(patchify(&t.flatten_all().unwrap(), 2, DType::F32)
        .unwrap_err()
        .to_string()
        .contains("pixels must have rank 4"));
    assert!(patchify(&t, 2, DType::U32)
        .unwrap_err()
        .to_string()
        .contains("unsupported dtype U32"));
}
