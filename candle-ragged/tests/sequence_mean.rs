//! sequence_mean: each sequence's mean row after its leading `skip` rows, against an f64
//! reference on odd lengths in every dtype, on strided column slices, bit-identical between the
//! device under test and the CPU; clear errors on bad input.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_ragged::{sequence_mean, RaggedBatch, RaggedError};
use common::*;

/// f64 means of every sequence's rows `skip..`, columns `col0..col0 + d` of `x` `[total, width]`.
fn reference_means(
    x: &[f32],
    width: usize,
    col0: usize,
    d: usize,
    lengths: &[usize],
    skip: usize,
) -> Vec<f64> {
    let mut out = Vec::new();
    let mut start = 0;
    for &len in lengths {
        for c in 0..d {
            let sum: f64 = (start + skip..start + len)
                .map(|r| x[r * width + col0 + c] as f64)
                .sum();
            out.push(sum / (len - skip) as f64);
        }
        start += len;
    }
    out
}

/// One value's rounding in `dtype` plus f32 summation error, relative to the largest mean.
fn mean_tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        _ => 1e-2,
    }
}

#[test]
fn means_match_the_reference_on_odd_lengths_in_every_dtype() {
    let dev = device();
    let lengths = [1usize, 2, 63, 64, 65, 197, 577, 9];
    let total: usize = lengths.iter().sum();
    let batch = RaggedBatch::from_lengths(&lengths, &dev).unwrap();
    let mut r = rng(7);
    for dtype in DTYPES {
        for d in [1usize, 3, 33, 192, 384] {
            // Mean 0.5 so that a mean of zeros or a missing division is visibly wrong.
            let v: Vec<f32> = randn(&mut r, total * d, 1.0)
                .iter()
                .map(|x| x + 0.5)
                .collect();
            let v = quantize(&v, dtype);
            let x = Tensor::from_slice(&v, (total, d), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            {
                let skip = 0;
                poison(&dev, lengths.len() * d, dtype);
                let got = sequence_mean(&x, &batch, skip).unwrap();
                assert_eq!(got.dims(), &[lengths.len(), d]);
                assert_eq!(got.dtype(), dtype);
                let want = reference_means(&v, d, 0, d, &lengths, skip);
                let err = max_rel_err(&host(&got), &want);
                assert!(
                    err <= mean_tolerance(dtype),
                    "{dtype:?} d={d} skip={skip}: {err}"
                );
            }
        }
    }
}

#[test]
fn skipped_rows_stay_out_and_strided_column_slices_are_read_in_place() {
    let dev = device();
    let lengths = [2usize, 197, 138, 3, 66];
    let total: usize = lengths.iter().sum();
    let batch = RaggedBatch::from_lengths(&lengths, &dev).unwrap();
    let (width, col0, d) = (384usize, 192usize, 192usize);
    let mut r = rng(11);
    for dtype in DTYPES {
        let mut v = quantize(&randn(&mut r, total * width, 1.0), dtype);
        // Huge values in every sequence's first row: a mean that includes a skipped row is far off.
        let mut start = 0;
        for &len in &lengths {
            v[start * width..(start + 1) * width].fill(1000.0);
            start += len;
        }
        let full = Tensor::from_slice(&v, (total, width), &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let x = full.narrow(1, col0, d).unwrap();
        assert!(!x.is_contiguous());
        for skip in [1usize, 2] {
            if lengths.iter().any(|&l| l <= skip) {
                assert!(sequence_mean(&x, &batch, skip).is_err());
                continue;
            }
            poison(&dev, lengths.len() * d, dtype);
            let got = sequence_mean(&x, &batch, skip).unwrap();
            let want = reference_means(&v, width, col0, d, &lengths, skip);
            let err = max_rel_err(&host(&got), &want);
            assert!(err <= mean_tolerance(dtype), "{dtype:?} skip={skip}: {err}");
            // The same slice made contiguous gives the same bits.
            let again = sequence_mean(&x.contiguous().unwrap(), &batch, skip).unwrap();
            assert_eq!(host(&got), host(&again), "{dtype:?} skip={skip}");
        }
    }
}

#[test]
fn device_and_cpu_give_identical_bits() {
    let dev = device();
    let lengths = [197usize, 138, 1, 97, 577];
    let total: usize = lengths.iter().sum();
    let d = 96;
    let mut r = rng(13);
    for dtype in DTYPES {
        let v = quantize(&randn(&mut r, total * d, 3.0), dtype);
        let on = |device: &Device| {
            let batch = RaggedBatch::from_lengths(&lengths, device).unwrap();
            let x = Tensor::from_slice(&v, (total, d), device)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            host(&sequence_mean(&x, &batch, 0).unwrap())
        };
        assert_eq!(on(&dev), on(&Device::Cpu), "{dtype:?}");
    }
}

#[test]
fn bad_input_is_a_clear_error() {
    let dev = device();
    let batch = RaggedBatch::from_lengths(&[3, 2], &dev).unwrap();
    let x = Tensor::zeros((5, 4), DType::F32, &dev).unwrap();
    // Nothing left after the skip.
    let e = sequence_mean(&x, &batch, 2).unwrap_err().to_string();
    assert!(e.contains("sequence 1 has 2 rows"), "{e}");
    // Wrong total.
    let e = sequence_mean(&x.narrow(0, 0, 4).unwrap(), &batch, 0).unwrap_err();
    assert!(matches!(e, RaggedError::TotalMismatch { .. }), "{e}");
    // Wrong rank.
    let e = sequence_mean(&x.reshape((5, 2, 2)).unwrap(), &batch, 0).unwrap_err();
    assert!(matches!(e, RaggedError::Rank { .. }), "{e}");
    // Wrong dtype.
    let e = sequence_mean(&x.to_dtype(DType::U32).unwrap(), &batch, 0).unwrap_err();
    assert!(matches!(e, RaggedError::UnsupportedDType { .. }), "{e}");
    // Another device.
    if !dev.is_cpu() {
        let e = sequence_mean(&x.to_device(&Device::Cpu).unwrap(), &batch, 0).unwrap_err();
        assert!(matches!(e, RaggedError::DeviceMismatch { .. }), "{e}");
    }
}
