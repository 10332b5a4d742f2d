//! pack / unpack: gather by lengths, by kept indices and by mask, exact round trips in every dtype,
//! zeros where nothing was kept, and clear errors on bad input; leading_rows against a host loop
//! (its one-sequence view included).

mod common;

use candle_core::{DType, Device, Tensor};
use candle_ragged::{leading_rows, pack, unpack, RaggedBatch, RaggedError};
use common::*;
use rand::Rng;

fn image_tensor(
    dev: &Device,
    b: usize,
    n: usize,
    c: usize,
    dtype: DType,
    seed: u64,
) -> (Vec<f32>, Tensor) {
    let mut r = rng(seed);
    let v = quantize(&randn(&mut r, b * n * c, 1.0), dtype);
    let t = Tensor::from_slice(&v, (b, n, c), dev)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    (v, t)
}

#[test]
fn pack_by_keep_indices_then_unpack_restores_kept_positions() {
    let dev = device();
    let (b, n) = (6, 197);
    let mut r = rng(1);
    for dtype in DTYPES {
        for c in [1usize, 3, 64, 384] {
            let (x, xt) = image_tensor(&dev, b, n, c, dtype, c as u64);
            let keep: Vec<Vec<u32>> = (0..b)
                .map(|i| {
                    let mut idx: Vec<u32> = (0..n as u32).filter(|_| r.random_bool(0.6)).collect();
                    if idx.is_empty() || i == 0 {
                        idx = vec![0]; // a sequence of one token
                    }
                    idx
                })
                .collect();
            let batch = RaggedBatch::from_keep_indices(&keep, n, &dev).unwrap();
            poison(&dev, batch.total_tokens() * c, dtype);
            let packed = pack(&xt, &batch).unwrap();
            assert_eq!(packed.dims(), &[batch.total_tokens(), c]);
            let want: Vec<f32> = keep
                .iter()
                .enumerate()
                .flat_map(|(bi, idx)| {
                    idx.iter()
                        .flat_map(move |&p| (0..c).map(move |ci| (bi, p as usize, ci)))
                })
                .map(|(bi, p, ci)| x[(bi * n + p) * c + ci])
                .collect();
            assert_eq!(host(&packed), want, "pack {dtype:?} c={c}");

            poison(&dev, b * n * c, dtype);
            let back = unpack(&packed, &batch, n).unwrap();
            assert_eq!(back.dims(), &[b, n, c]);
            let got = host(&back);
            for (bi, kept_positions) in keep.iter().enumerate() {
                for p in 0..n {
                    let kept = kept_positions.binary_search(&(p as u32)).is_ok();
                    for ci in 0..c {
                        let i = (bi * n + p) * c + ci;
                        let expect = if kept { x[i] } else { 0.0 };
                        assert_eq!(got[i], expect, "unpack {dtype:?} c={c} image {bi} pos {p}");
                    }
                }
            }
        }
    }
}

#[test]
fn lengths_batch_is_left_aligned_padding() {
    let dev = device();
    let (x, xt) = image_tensor(&dev, 3, 10, 8, DType::F32, 7);
    let batch = RaggedBatch::from_lengths(&[10, 1, 4], &dev).unwrap();
    let packed = pack(&xt, &batch).unwrap();
    assert_eq!(packed.dims(), &[15, 8]);
    // Unpack into a longer image: padding rows are zero, kept rows sit at the front.
    let back = host(&unpack(&packed, &batch, 12).unwrap());
    for (bi, len) in [10usize, 1, 4].iter().enumerate() {
        for p in 0..12 {
            for ci in 0..8 {
                let got = back[(bi * 12 + p) * 8 + ci];
                let want = if p < *len {
                    x[(bi * 10 + p) * 8 + ci]
                } else {
                    0.0
                };
                assert_eq!(got, want);
            }
        }
    }
}

#[test]
fn mask_and_indices_pack_the_same_rows() {
    let dev = device();
    let (_, xt) = image_tensor(&dev, 2, 5, 4, DType::BF16, 9);
    let mask = Tensor::new(&[[1u8, 0, 0, 1, 1], [0, 0, 1, 0, 0]], &dev).unwrap();
    let a = pack(&xt, &RaggedBatch::from_keep_mask(&mask).unwrap()).unwrap();
    let b = pack(
        &xt,
        &RaggedBatch::from_keep_indices(&[vec![0, 3, 4], vec![2]], 5, &dev).unwrap(),
    )
    .unwrap();
    assert_eq!(host(&a), host(&b));
}

#[test]
fn strided_inputs_are_read_in_place() {
    let dev = device();
    // A [B, N, C] view with a non-unit token stride (every other token of a longer tensor).
    let (x, xt) = image_tensor(&dev, 2, 8, 16, DType::F16, 11);
    let view = xt
        .reshape((2, 4, 2, 16))
        .unwrap()
        .narrow(2, 1, 1)
        .unwrap()
        .squeeze(2)
        .unwrap();
    assert!(!view.is_contiguous());
    let batch = RaggedBatch::from_keep_indices(&[vec![1, 3], vec![0]], 4, &dev).unwrap();
    let got = host(&pack(&view, &batch).unwrap());
    let row = |b: usize, p: usize| x[(b * 8 + 2 * p + 1) * 16..(b * 8 + 2 * p + 2) * 16].to_vec();
    let want: Vec<f32> = [row(0, 1), row(0, 3), row(1, 0)].concat();
    assert_eq!(got, want);
}

#[test]
fn u32_payloads_round_trip() {
    let dev = device();
    let x = Tensor::arange(0u32, 24, &dev)
        .unwrap()
        .reshape((2, 4, 3))
        .unwrap();
    let batch = RaggedBatch::from_lengths(&[2, 3], &dev).unwrap();
    let packed = pack(&x, &batch).unwrap();
    assert_eq!(
        packed.flatten_all().unwrap().to_vec1::<u32>().unwrap(),
        vec![0, 1, 2, 3, 4, 5, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    );
    let back = unpack(&packed, &batch, 4)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<u32>()
        .unwrap();
    assert_eq!(
        back,
        vec![0, 1, 2, 3, 4, 5, 0, 0, 0, 0, 0, 0, 12, 13, 14, 15, 16, 17, 18, 19, 20, 0, 0, 0]
    );
}

/// leading_rows against a host loop: the first `rows` rows of every sequence, zeros past a short
/// one; batches of one and of several, contiguous and column-sliced (strided) inputs, every
/// dtype, output memory poisoned.
#[test]
fn leading_rows_match_a_host_loop() {
    let dev = device();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for lengths in [
            vec![197usize],
            vec![1],
            vec![2],
            vec![3, 1, 70],
            vec![65, 64, 63],
        ] {
            let total: usize = lengths.iter().sum();
            let batch = RaggedBatch::from_lengths(&lengths, &dev).unwrap();
            for rows in [1usize, 2] {
                for sliced in [false, true] {
                    let c = 24;
                    let wide = if sliced { 2 * c } else { c };
                    let (v, t) = image_tensor(&dev, 1, total, wide, dtype, 7 + rows as u64);
                    let t = t.reshape((total, wide)).unwrap();
                    let packed = if sliced {
                        t.narrow(1, c, c).unwrap()
                    } else {
                        t
                    };
                    poison(&dev, lengths.len() * rows * c, dtype);
                    let got = leading_rows(&packed, &batch, rows).unwrap();
                    assert_eq!(got.dims(), &[lengths.len(), rows, c]);
                    assert!(got.is_contiguous());
                    let got = host(&got);
                    let mut start = 0;
                    for (b, &len) in lengths.iter().enumerate() {
                        for j in 0..rows {
                            for k in 0..c {
                                let want = if j < len {
                                    v[(start + j) * wide + if sliced { c } else { 0 } + k]
                                } else {
                                    0.0
                                };
                                assert_eq!(
                                    got[(b * rows + j) * c + k],
                                    want,
                                    "{dtype:?} lengths {lengths:?} rows {rows} sliced {sliced}: [{b}, {j}, {k}]"
                                );
                            }
                        }
                        start += len;
                    }
                }
            }
        }
    }
}

#[test]
fn bad_inputs_are_clear_errors() {
    let dev = device();
    let x = Tensor::zeros((2, 4, 3), DType::F32, &dev).unwrap();
    let batch = RaggedBatch::from_lengths(&[2, 3], &dev).unwrap();
    let e = pack(&x.flatten_all().unwrap(), &batch).unwrap_err();
    assert!(matches!(e, RaggedError::Rank { op: "pack", .. }), "{e}");
    let three = RaggedBatch::from_lengths(&[1, 1, 1], &dev).unwrap();
    assert!(matches!(
        pack(&x, &three).unwrap_err(),
        RaggedError::BatchMismatch {
            expected: 3,
            found: 2,
            ..
        }
    ));
    let long = RaggedBatch::from_lengths(&[5, 1], &dev).unwrap();
    assert!(matches!(
        pack(&x, &long).unwrap_err(),
        RaggedError::SequenceDoesNotFit {
            len: 5,
            tokens: 4,
            ..
        }
    ));
    let far = RaggedBatch::from_keep_indices(&[vec![0], vec![7]], 8, &dev).unwrap();
    assert!(matches!(
        pack(&x, &far).unwrap_err(),
        RaggedError::PositionOutOfRange {
            position: 7,
            tokens: 4,
            ..
        }
    ));
    let packed = pack(&x, &batch).unwrap();
    assert!(matches!(
        unpack(&packed, &batch, 2).unwrap_err(),
        RaggedError::SequenceDoesNotFit {
            len: 3,
            tokens: 2,
            ..
        }
    ));
    let wrong = Tensor::zeros((4, 3), DType::F32, &dev).unwrap();
    assert!(matches!(
        unpack(&wrong, &batch, 4).unwrap_err(),
        RaggedError::TotalMismatch {
            expected: 5,
            found: 4,
            ..
        }
    ));
    let x64 = Tensor::zeros((2, 4, 3), DType::F64, &dev).unwrap();
    assert!(matches!(
        pack(&x64, &batch).unwrap_err(),
        RaggedError::UnsupportedDType { .. }
    ));
}
