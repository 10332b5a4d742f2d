//! ragged_attention against a naive f64 reference: odd lengths, big batches, every dtype and
//! supported head_dim, strided views of a fused qkv tensor, and every bad-input case.

mod common;

use candle_core::{DType, Device, IndexOp, Tensor};
use candle_ragged::{ragged_attention, RaggedBatch, RaggedError, MAX_SEQ_LEN, SUPPORTED_HEAD_DIMS};
use common::*;
use rand::Rng;

/// Runs the op on fresh random q/k/v laid out either as three tensors or as views of one fused
/// `[total, 3, heads, dim]` tensor, and compares with the reference.
fn check(
    lengths: &[usize],
    heads: usize,
    dim: usize,
    dtype: DType,
    fused: bool,
    scale: f32,
    seed: u64,
) {
    let dev = device();
    let mut rng = rng(seed);
    let total: usize = lengths.iter().sum();
    let n = total * heads * dim;
    let (q, k, v) = (
        randn(&mut rng, n, 1.0),
        randn(&mut rng, n, 1.0),
        randn(&mut rng, n, 1.0),
    );
    let (q, k, v) = (
        quantize(&q, dtype),
        quantize(&k, dtype),
        quantize(&v, dtype),
    );
    let batch = RaggedBatch::from_lengths(lengths, &dev).unwrap();
    let shape = (total, heads, dim);
    let (qt, kt, vt) = if fused {
        // Interleave into [total, 3, heads, dim] and take views: the op must read them in place.
        let mut qkv = Vec::with_capacity(3 * n);
        for t in 0..total {
            for src in [&q, &k, &v] {
                qkv.extend_from_slice(&src[t * heads * dim..(t + 1) * heads * dim]);
            }
        }
        let qkv = Tensor::from_vec(qkv, (total, 3, heads, dim), &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let (qt, kt, vt) = (
            qkv.i((.., 0)).unwrap(),
            qkv.i((.., 1)).unwrap(),
            qkv.i((.., 2)).unwrap(),
        );
        assert!(
            !qt.is_contiguous(),
            "the fused views must be strided for this test to mean anything"
        );
        (qt, kt, vt)
    } else {
        let mk = |x: &Vec<f32>| {
            Tensor::from_slice(x, shape, &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
        };
        (mk(&q), mk(&k), mk(&v))
    };
    poison(&dev, n, dtype);
    let out = ragged_attention(&qt, &kt, &vt, &batch, scale).unwrap();
    assert_eq!(out.dims(), &[total, heads, dim]);
    assert_eq!(out.dtype(), dtype);
    assert!(out.is_contiguous());
    let got = out
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let want = reference(&q, &k, &v, lengths, heads, dim, scale as f64);
    let err = max_rel_err(&got, &want);
    assert!(
        err <= tolerance(dtype),
        "lengths {lengths:?} heads {heads} dim {dim} {dtype:?} fused {fused}: max rel err {err:e} > {:e}",
        tolerance(dtype)
    );
}

#[test]
fn odd_lengths_every_dtype() {
    for (i, &len) in [1usize, 2, 63, 64, 65, 197].iter().enumerate() {
        for dtype in DTYPES {
            check(&[len], 3, 64, dtype, false, 0.125, 10 + i as u64);
        }
    }
}

/// The CPU path at pool sizes from one thread to more threads than the (sequence, head, block
/// of query rows) tasks (one DeiT-T image has twelve; 16 and 40 threads leave some idle), each
/// against the reference. (On CUDA the pool changes nothing.)
#[test]
fn any_pool_size_gives_the_reference() {
    let cases: [(&[usize], usize); 4] = [
        (&[197], 3),
        (&[1], 1),
        (&[2, 65, 197, 64], 6),
        (&[5, 63, 17, 1, 130, 40, 9, 77, 64, 12, 3, 101], 4),
    ];
    for threads in [1, 3, 16, 40] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        for (i, &(lengths, heads)) in cases.iter().enumerate() {
            // One row's views are contiguous: plain tensors there.
            let fused = lengths.iter().sum::<usize>() > 1;
            for dtype in DTYPES {
                pool.install(|| check(lengths, heads, 64, dtype, fused, 0.125, 900 + i as u64));
            }
        }
    }
}

/// Batches whose sequences all have one length: the kernels then take each sequence's span from
/// that length instead of cu_seqlens (lever 54). Every kernel family: resident (f16 / bf16,
/// head_dim <= 64, up to 256 tokens, with and without key parts), tiled (longer or head_dim 128),
/// f32; one-token sequences; the fused qkv views.
#[test]
fn equal_lengths_every_kernel() {
    let dev = device();
    for lengths in [
        vec![197; 8],
        vec![64; 3],
        vec![1; 5],
        vec![300; 2],
        vec![577; 2],
    ] {
        let batch = RaggedBatch::from_lengths(&lengths, &dev).unwrap();
        assert_eq!(batch.uniform_len(), Some(lengths[0]));
    }
    for (i, dtype) in [DType::F16, DType::BF16, DType::F32]
        .into_iter()
        .enumerate()
    {
        let seed = 100 + 10 * i as u64;
        check(&[197; 8], 6, 64, dtype, true, 0.125, seed);
        check(&[197], 12, 64, dtype, false, 0.125, seed + 1);
        check(&[64; 3], 3, 64, dtype, false, 0.125, seed + 2);
        check(&[1; 5], 2, 64, dtype, true, 0.125, seed + 3);
        check(&[300; 2], 2, 64, dtype, true, 0.125, seed + 4);
        check(&[65; 4], 2, 32, dtype, false, 0.125, seed + 5);
        check(&[130; 2], 2, 128, dtype, true, 0.125, seed + 6);
    }
}

#[test]
fn mixed_lengths_in_one_batch() {
    let lengths = [1, 2, 63, 64, 65, 197, 3, 130];
    for dtype in DTYPES {
        check(&lengths, 2, 64, dtype, false, 0.125, 20);
        check(&lengths, 2, 64, dtype, true, 0.125, 21);
    }
}

#[test]
fn vit_384_length() {
    for dtype in DTYPES {
        check(&[577, 5], 1, 64, dtype, true, 0.125, 30);
    }
}

#[test]
fn longest_supported_length() {
    check(&[1024, 1], 1, 64, DType::F16, false, 0.125, 31);
    check(&[1024], 1, 64, DType::F32, true, 0.125, 32);
}

/// Up to 256 tokens the resident kernel runs (K / V of a whole sequence in shared memory), past
/// it the tiled one: both sides of the boundary, and a single long-ish sequence split over
/// several blocks (batch 1).
#[test]
fn resident_and_tiled_kernels_meet_at_256() {
    for dtype in [DType::F16, DType::BF16, DType::F32] {
        check(&[256, 17, 1], 2, 64, dtype, true, 0.125, 70);
        check(&[257, 3], 2, 64, dtype, true, 0.125, 71);
        check(&[255], 12, 64, dtype, false, 0.125, 72);
        check(&[200, 40], 4, 32, dtype, true, 0.125, 73);
    }
}

/// Small batches (at most about one wave of warps) split each query tile's keys over 4 warps
/// and merge their softmax states: DeiT's batch-1 shapes (3, 6, 12 heads), lengths whose 16-key
/// tiles do not divide by 4 (129, 140), 4 images at 12 heads (too many warps: no parts), and
/// sequences shorter than the batch's longest, whose first parts see no key at all.
#[test]
fn key_parts_at_small_batches() {
    for dtype in [DType::F16, DType::BF16] {
        for heads in [3, 6, 12] {
            check(&[197], heads, 64, dtype, true, 0.125, 80 + heads as u64);
        }
        check(&[129], 3, 64, dtype, false, 0.125, 90);
        check(&[197, 180, 150, 100], 12, 64, dtype, true, 0.125, 91);
        check(&[197, 1, 17, 64, 65], 6, 64, dtype, true, 0.125, 92);
        check(&[140, 9], 4, 32, dtype, false, 0.125, 93);
    }
}

#[test]
fn every_head_dim() {
    for &dim in SUPPORTED_HEAD_DIMS {
        for dtype in DTYPES {
            let scale = 1.0 / (dim as f32).sqrt();
            check(&[65, 1, 130], 2, dim, dtype, true, scale, 40 + dim as u64);
        }
    }
}

#[test]
fn large_logits_stay_stable() {
    // scale 1.0 on unit-variance q, k: logits with std 8, so the max subtraction matters.
    for dtype in DTYPES {
        check(&[97, 33], 2, 64, dtype, false, 1.0, 50);
    }
    // At 4.0 (std 32) the softmax is nearly one-hot and the tensor-core kernels' running maxima
    // jump by tens of log2 units from key chunk to key chunk. Not f32: there
    // a logit's rounding error δ (~1e-5 after 64 f32 products of this size) moves the output by
    // ~δ relative, above f32's 1e-5 tolerance whatever the kernel does.
    for dtype in [DType::F16, DType::BF16] {
        check(&[197, 33, 256], 3, 64, dtype, true, 4.0, 51);
    }
}

/// Scores that step up by 7.5 and 8.5 log2 units in turn at every 64th key, so the online
/// softmax's running maxima move at chunk boundaries of the resident kernel's 32-key and the tiled
/// kernel's 64-key chunks, with and without key parts; head 1 sees the negated scores (the maximum
/// in the first chunk, never growing). The steps straddle 8 log2 units on purpose: the
/// 80-register resident kernel (`CANDLE_RAGGED_RESIDENT=r80` forces it everywhere) rescales O and
/// the row sums only when scores pass the running maximum by more than 8 log2 units (levers 37
/// and 38 in docs/BENCHMARKS.md), and this runs both of its branches.
#[test]
fn stepped_scores_across_chunks() {
    let (heads, dim) = (2, 64);
    // scale ln 2: a score of c in these units is c log2 units, exactly what the kernels compare.
    let scale = std::f32::consts::LN_2;
    for lengths in [vec![197usize], vec![300, 40], vec![197; 8]] {
        let total: usize = lengths.iter().sum();
        let mut rng = rng(200 + total as u64);
        let n = total * heads * dim;
        let mut q = vec![0f32; n];
        let mut k = vec![0f32; n];
        let v = randn(&mut rng, n, 1.0);
        let mut start = 0;
        for &len in &lengths {
            for j in 0..len {
                let block = j / 64;
                // 0, 7.5, 16, 23.5, 32, ...: steps of 7.5 and 8.5 in turn; jitter in multiples of
                // 1/8 below each level (exact in f16 and bf16 at these magnitudes).
                let level = (block / 2) as f32 * 16.0 + if block % 2 == 1 { 7.5 } else { 0.0 };
                let jitter = -((j * 7 % 5) as f32) / 8.0;
                for h in 0..heads {
                    let at = ((start + j) * heads + h) * dim;
                    q[at] = if h == 0 { 1.0 } else { -1.0 };
                    k[at] = level + jitter;
                }
            }
            start += len;
        }
        let want = reference(&q, &k, &v, &lengths, heads, dim, scale as f64);
        let dev = device();
        let batch = RaggedBatch::from_lengths(&lengths, &dev).unwrap();
        for dtype in DTYPES {
            let mk = |x: &Vec<f32>| {
                Tensor::from_slice(x, (total, heads, dim), &dev)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap()
            };
            let vq = quantize(&v, dtype);
            let want = if dtype == DType::F32 {
                want.clone()
            } else {
                reference(&q, &k, &vq, &lengths, heads, dim, scale as f64)
            };
            poison(&dev, n, dtype);
            let out = ragged_attention(&mk(&q), &mk(&k), &mk(&vq), &batch, scale).unwrap();
            let err = max_rel_err(&host(&out), &want);
            assert!(
                err <= tolerance(dtype),
                "lengths {lengths:?} {dtype:?}: max rel err {err:e} > {:e}",
                tolerance(dtype)
            );
        }
    }
}

/// Negative and zero scales are legal (the op checks only that the scale is finite): a negative
/// one flips which key is the row maximum, and a zero one is the uniform average of V, where a
/// masked key's score must still count as -inf (not -inf · 0 = NaN). Resident kernel (with and
/// without key parts), tiled one, head_dim 128.
#[test]
fn negative_and_zero_scales() {
    for dtype in DTYPES {
        for (i, scale) in [-0.125f32, 0.0, -1.0].into_iter().enumerate() {
            let seed = 100 + 4 * i as u64;
            check(&[197, 1, 65, 30], 3, 64, dtype, true, scale, seed);
            check(&[300, 2], 2, 64, dtype, false, scale, seed + 1);
            check(&[197], 6, 64, dtype, true, scale, seed + 2);
            check(&[130, 7], 2, 128, dtype, true, scale, seed + 3);
        }
    }
}

#[test]
fn random_batches_up_to_256() {
    let mut r = rng(60);
    for (i, &b) in [1usize, 7, 64, 256].iter().enumerate() {
        let lengths: Vec<usize> = (0..b).map(|_| r.random_range(1..=197)).collect();
        for dtype in DTYPES {
            check(&lengths, 3, 64, dtype, i % 2 == 1, 0.125, 61 + i as u64);
        }
    }
}

/// Large batches without key parts, where a warp has two query tiles: 744 (sequence, head)
/// pairs of up to 128 tokens (blocks of at most 4 warps, more than the SMs hold at once) take
/// lever 135's paired kernel (both tiles at once), up to 256 (8 warps) lever 136's form of it,
/// Q staged in shared memory, as 1,104 pairs (past 8 a SM on the H100's 132) do at any length
/// (`CANDLE_RAGGED_PAIR_WARPS=8` pairs every unsplit block in lever 135's form, `=0` none;
/// `CANDLE_RAGGED_PAIRQ_PAIRS=0` stages Q in every one, `CANDLE_RAGGED_PAIRQ_WARPS=9` with
/// `CANDLE_RAGGED_PAIRQ_PAIRS=100000` in none). Odd and even tile counts (the last
/// warp of an odd count has one tile), both resident head sizes, every dtype.
#[test]
fn two_tiles_a_warp_at_large_batches() {
    let mut r = rng(140);
    for (i, (heads, sequences, head_dim, longest)) in [
        (3, 240, 32usize, 128usize),
        (3, 240, 64, 128),
        (3, 240, 32, 256),
        (3, 240, 64, 256),
        (6, 176, 32, 128),
        (6, 176, 64, 256),
    ]
    .into_iter()
    .enumerate()
    {
        let mut lengths: Vec<usize> = (0..sequences)
            .map(|_| r.random_range(1..=longest))
            .collect();
        lengths.extend([1, 16, 17, 32, 33, 97, 113, longest]);
        for dtype in DTYPES {
            check(
                &lengths,
                heads,
                head_dim,
                dtype,
                i % 2 == 1,
                0.125,
                141 + i as u64,
            );
        }
    }
}

fn qkv(
    dev: &Device,
    total: usize,
    heads: usize,
    dim: usize,
    dtype: DType,
) -> (Tensor, Tensor, Tensor) {
    let t = || {
        Tensor::randn(0f32, 1.0, (total, heads, dim), dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    };
    (t(), t(), t())
}

fn err_of(r: candle_ragged::Result<Tensor>) -> RaggedError {
    match r {
        Ok(t) => panic!("expected an error, got a tensor of shape {:?}", t.shape()),
        Err(e) => e,
    }
}

#[test]
fn bad_inputs_are_clear_errors() {
    let dev = device();
    let batch = RaggedBatch::from_lengths(&[3, 2], &dev).unwrap();
    let (q, k, v) = qkv(&dev, 5, 2, 64, DType::F16);
    let scale = 0.125;

    let q4 = q.unsqueeze(0).unwrap();
    assert!(matches!(
        err_of(ragged_attention(&q4, &k, &v, &batch, scale)),
        RaggedError::Rank { what: "q", .. }
    ));
    let (_, k_bad, _) = qkv(&dev, 5, 3, 64, DType::F16);
    assert!(matches!(
        err_of(ragged_attention(&q, &k_bad, &v, &batch, scale)),
        RaggedError::ShapeMismatch { what: "k", .. }
    ));
    let v32 = v.to_dtype(DType::F32).unwrap();
    assert!(matches!(
        err_of(ragged_attention(&q, &k, &v32, &batch, scale)),
        RaggedError::DTypeMismatch { what: "v", .. }
    ));
    let wrong_total = RaggedBatch::from_lengths(&[3, 3], &dev).unwrap();
    assert!(matches!(
        err_of(ragged_attention(&q, &k, &v, &wrong_total, scale)),
        RaggedError::TotalMismatch {
            expected: 6,
            found: 5,
            ..
        }
    ));
    let (q48, k48, v48) = qkv(&dev, 5, 2, 48, DType::F16);
    let e = err_of(ragged_attention(&q48, &k48, &v48, &batch, scale));
    assert!(
        matches!(e, RaggedError::UnsupportedHeadDim { head_dim: 48, .. }),
        "{e}"
    );
    assert!(
        e.to_string().contains("48"),
        "message names the head_dim: {e}"
    );
    // A view whose last dimension is strided (transposed heads and dims).
    let qt = Tensor::randn(0f32, 1.0, (5, 64, 2), &dev)
        .unwrap()
        .to_dtype(DType::F16)
        .unwrap()
        .transpose(1, 2)
        .unwrap();
    assert!(matches!(
        err_of(ragged_attention(&qt, &k, &v, &batch, scale)),
        RaggedError::LastDimNotContiguous { what: "q", .. }
    ));
    let (qi, ki, vi) = (
        q.to_dtype(DType::U32).unwrap(),
        k.to_dtype(DType::U32).unwrap(),
        v.to_dtype(DType::U32).unwrap(),
    );
    assert!(matches!(
        err_of(ragged_attention(&qi, &ki, &vi, &batch, scale)),
        RaggedError::UnsupportedDType { .. }
    ));
    assert!(matches!(
        err_of(ragged_attention(&q, &k, &v, &batch, f32::NAN)),
        RaggedError::BadScale { .. }
    ));

    // Past the documented length limit: refused before any work.
    let long = RaggedBatch::from_lengths(&[MAX_SEQ_LEN + 1], &dev).unwrap();
    let (ql, kl, vl) = qkv(&dev, MAX_SEQ_LEN + 1, 1, 64, DType::F16);
    let e = err_of(ragged_attention(&ql, &kl, &vl, &long, scale));
    assert!(
        matches!(e, RaggedError::SequenceTooLong { len, limit: MAX_SEQ_LEN, .. } if len == MAX_SEQ_LEN + 1),
        "{e}"
    );
}

#[test]
fn cu_seqlens_on_another_device_is_refused() {
    let dev = device();
    if dev.is_cpu() {
        return; // only a CUDA build on a GPU machine has two devices to mix
    }
    let batch = RaggedBatch::from_lengths(&[3, 2], &Device::Cpu).unwrap();
    let (q, k, v) = qkv(&dev, 5, 2, 64, DType::F16);
    assert!(matches!(
        err_of(ragged_attention(&q, &k, &v, &batch, 0.125)),
        RaggedError::DeviceMismatch {
            what: "cu_seqlens",
            ..
        }
    ));
    let (qc, kc, vc) = qkv(&Device::Cpu, 5, 2, 64, DType::F16);
    let batch = RaggedBatch::from_lengths(&[3, 2], &dev).unwrap();
    assert!(matches!(
        err_of(ragged_attention(&qc, &kc, &vc, &batch, 0.125)),
        RaggedError::DeviceMismatch { .. }
    ));
    let _ = (q, k, v);
}

#[test]
fn cpu_and_device_agree_on_f32_shapes() {
    // On a CPU-only build both sides are the CPU; on the GPU machine this compares the two paths
    // (within 1e-5, not bit for bit: the kernels sum in different orders).
    let dev = device();
    let lengths = [5usize, 70, 1];
    let batch_dev = RaggedBatch::from_lengths(&lengths, &dev).unwrap();
    let batch_cpu = RaggedBatch::from_lengths(&lengths, &Device::Cpu).unwrap();
    let (q, k, v) = qkv(&Device::Cpu, 76, 2, 32, DType::F32);
    let on = |t: &Tensor| t.to_device(&dev).unwrap();
    let a = ragged_attention(&on(&q), &on(&k), &on(&v), &batch_dev, 0.2)
        .unwrap()
        .to_device(&Device::Cpu)
        .unwrap();
    let b = ragged_attention(&q, &k, &v, &batch_cpu, 0.2).unwrap();
    let diff = max_abs_diff(&a, &b);
    assert!(diff <= 1e-5, "cpu vs device f32 max abs diff {diff}");
}

#[test]
fn empty_sequences_add_no_rows() {
    // A batch built with `from_lengths_allowing_empty` (an image that kept nothing): its empty
    // sequence produces no rows and leaves its neighbours' results as they are without it.
    let dev = device();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let (q, k, v) = qkv(&dev, 8, 2, 64, dtype);
        let with_empty = RaggedBatch::from_lengths_allowing_empty(&[3, 0, 5, 0], &dev).unwrap();
        let without = RaggedBatch::from_lengths(&[3, 5], &dev).unwrap();
        let a = ragged_attention(&q, &k, &v, &with_empty, 0.125).unwrap();
        let b = ragged_attention(&q, &k, &v, &without, 0.125).unwrap();
        assert_eq!(a.dims(), &[8, 2, 64]);
        let diff = max_abs_diff(&a, &b);
        assert_eq!(
            diff, 0.0,
            "{dtype:?}: empty sequences changed the result by {diff}"
        );
    }
}
