//! select_by_rule_bounded (no host read) against select_by_rule (one read of the lengths): the
//! same kept rows, bit for bit, at the offsets its device-side `cu_seqlens` says, inside the
//! capacity and length bound it documents; outputs poisoned before each call. Then the ops that
//! follow a step in a pruned forward (attention, leading rows, sequence means, pack, unpack, a
//! second step) on the bounded batch against the same ops on the exact one.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_ragged::{
    leading_rows, pack, ragged_attention, select_by_rule, select_by_rule_bounded, sequence_mean,
    unpack, DroppedFusion, KeepCount, KeepRule, RaggedBatch, TokenScores,
};
use common::{device, host, poison, randn, rng};
use rand::Rng;

const RULES: [KeepRule; 7] = [
    KeepRule::Top(KeepCount::CeilRatio(0.7)),
    KeepRule::AtLeast(0.5),
    KeepRule::Above(100.0),
    KeepRule::AtLeastMeanTimes(1.0),
    KeepRule::MassShare(0.5),
    KeepRule::InverseTransform {
        samples: KeepCount::CeilRatio(0.7),
    },
    KeepRule::InverseTransform {
        samples: KeepCount::Exactly(40),
    },
];

/// Packed rows of sequence `b`, as f32 on the host.
fn rows_of(x: &[f32], offsets: &[u32], b: usize, c: usize) -> Vec<f32> {
    x[offsets[b] as usize * c..offsets[b + 1] as usize * c].to_vec()
}

/// Checks `(got, got_batch)` (bounded) against `(want, want_batch)` (exact) and the documented
/// bounds from `input`.
fn assert_same_step(
    what: &str,
    (got, got_batch): (&Tensor, &RaggedBatch),
    (want, want_batch): (&Tensor, &RaggedBatch),
    input: &RaggedBatch,
    prefix: usize,
    rule: KeepRule,
    fusion: Option<DroppedFusion>,
) {
    let c = want.dim(1).unwrap();
    assert!(!got_batch.lengths_on_host(), "{what}");
    let n = input.max_len() - prefix;
    let bound = prefix + n.min(rule.max_kept(n) + fusion.is_some() as usize);
    let b = input.batch_size();
    assert_eq!(got_batch.max_len(), bound, "{what}: length bound");
    let rows = input.total_tokens().min(b * bound);
    assert_eq!(got_batch.total_tokens(), rows, "{what}: capacity");
    assert_eq!(got.dims(), &[rows, c], "{what}: output rows");
    let lengths = got_batch.lengths().unwrap();
    assert_eq!(lengths, want_batch.lengths().unwrap(), "{what}: lengths");
    assert!(lengths.iter().all(|&l| l <= bound), "{what}: {lengths:?}");
    let (go, wo) = (got_batch.offsets().unwrap(), want_batch.offsets().unwrap());
    assert_eq!(go, wo, "{what}: offsets");
    let (g, w) = (host(got), host(want));
    for bi in 0..b {
        assert_eq!(
            rows_of(&g, &go, bi, c),
            rows_of(&w, &wo, bi, c),
            "{what}: rows of sequence {bi}"
        );
    }
}

#[test]
fn bounded_steps_keep_what_exact_steps_keep() {
    let dev = device();
    let mut r = rng(71);
    let c = 40;
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for (prefix, lengths) in [
            (1, vec![197, 2, 63, 64, 65, 577, 1 + 196 * 7 / 10]),
            (2, vec![3]),
            (1, vec![197; 5]),
        ] {
            let total: usize = lengths.iter().sum();
            let batch = RaggedBatch::from_lengths(&lengths, &dev).unwrap();
            let x = Tensor::from_slice(&randn(&mut r, total * c, 1.0), (total, c), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            for rule in RULES {
                for fusion in [None, Some(DroppedFusion::WeightedMean)] {
                    let what = format!("{dtype:?} prefix={prefix} {rule:?} {fusion:?} {lengths:?}");
                    let want =
                        select_by_rule(&x, &batch, TokenScores::RowL2Norm, prefix, rule, fusion)
                            .unwrap();
                    poison(&dev, total * c, dtype);
                    let got = select_by_rule_bounded(
                        &x,
                        &batch,
                        TokenScores::RowL2Norm,
                        prefix,
                        rule,
                        fusion,
                    )
                    .unwrap();
                    assert_same_step(
                        &what,
                        (&got.0, &got.1),
                        (&want.0, &want.1),
                        &batch,
                        prefix,
                        rule,
                        fusion,
                    );
                    // A second step from the bounded batch (lengths on the device only) against
                    // a second exact step.
                    let rule2 = KeepRule::Top(KeepCount::CeilRatio(0.5));
                    let want2 = select_by_rule(
                        &want.0,
                        &want.1,
                        TokenScores::RowL2Norm,
                        prefix,
                        rule2,
                        fusion,
                    )
                    .unwrap();
                    poison(&dev, total * c, dtype);
                    let got2 = select_by_rule_bounded(
                        &got.0,
                        &got.1,
                        TokenScores::RowL2Norm,
                        prefix,
                        rule2,
                        fusion,
                    )
                    .unwrap();
                    assert_same_step(
                        &format!("{what}, second step"),
                        (&got2.0, &got2.1),
                        (&want2.0, &want2.1),
                        &got.1,
                        prefix,
                        rule2,
                        fusion,
                    );
                }
            }
        }
    }
}

/// Ops downstream of a bounded step read the device `cu_seqlens` and leave the spare rows alone.
#[test]
fn ops_on_a_bounded_batch_match_the_exact_batch() {
    let dev = device();
    let mut r = rng(72);
    let (heads, d) = (3, 64);
    let c = heads * d;
    let lengths = [197usize, 65, 2, 130, 64, 1 + 138];
    let total: usize = lengths.iter().sum();
    let batch = RaggedBatch::from_lengths(&lengths, &dev).unwrap();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let x = Tensor::from_slice(&randn(&mut r, total * c, 1.0), (total, c), &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let rule = KeepRule::AtLeastMeanTimes(1.0);
        let fusion = Some(DroppedFusion::WeightedMean);
        let (we, wb) = select_by_rule(&x, &batch, TokenScores::RowL2Norm, 1, rule, fusion).unwrap();
        let (ge, gb) =
            select_by_rule_bounded(&x, &batch, TokenScores::RowL2Norm, 1, rule, fusion).unwrap();
        assert!(
            gb.total_tokens() > wb.total_tokens(),
            "the test needs spare rows"
        );
        let wo = wb.offsets().unwrap().into_owned();
        let what = format!("{dtype:?}");

        // Attention over the packed rows as q, k and v (the live rows only are compared).
        let as_qkv = |t: &Tensor| t.reshape((t.dim(0).unwrap(), heads, d)).unwrap();
        let want = ragged_attention(&as_qkv(&we), &as_qkv(&we), &as_qkv(&we), &wb, 0.125).unwrap();
        poison(&dev, gb.total_tokens() * c, dtype);
        let got = ragged_attention(&as_qkv(&ge), &as_qkv(&ge), &as_qkv(&ge), &gb, 0.125).unwrap();
        assert_eq!(got.dim(0).unwrap(), gb.total_tokens(), "{what}");
        let (g, w) = (
            host(&got.flatten_from(1).unwrap()),
            host(&want.flatten_from(1).unwrap()),
        );
        for bi in 0..lengths.len() {
            assert_eq!(
                rows_of(&g, &wo, bi, c),
                rows_of(&w, &wo, bi, c),
                "{what}: attention {bi}"
            );
        }

        // Class tokens, means, unpack, pack: image-shaped results compare whole.
        poison(&dev, lengths.len() * 2 * c, dtype);
        let same = |a: &Tensor, b: &Tensor, op: &str| {
            assert_eq!(host(a), host(b), "{what}: {op}");
        };
        same(
            &leading_rows(&ge, &gb, 2).unwrap(),
            &leading_rows(&we, &wb, 2).unwrap(),
            "leading_rows",
        );
        same(
            &sequence_mean(&ge, &gb, 1).unwrap(),
            &sequence_mean(&we, &wb, 1).unwrap(),
            "sequence_mean",
        );
        let max_len = gb.max_len();
        let image = unpack(&ge, &gb, max_len).unwrap();
        same(&image, &unpack(&we, &wb, max_len).unwrap(), "unpack");
        poison(&dev, gb.total_tokens() * c, dtype);
        let packed = pack(&image, &gb).unwrap();
        assert_eq!(packed.dim(0).unwrap(), gb.total_tokens(), "{what}");
        let p = host(&packed);
        let live = *wo.last().unwrap() as usize * c;
        assert_eq!(&p[..live], &host(&we)[..], "{what}: pack");
        assert!(
            p[live..].iter().all(|&v| v == 0.0),
            "{what}: pack's spare rows are zeros"
        );
    }
}

/// The device-side prefix sum of the new lengths over more sequences than its block has threads.
#[test]
fn many_sequences() {
    let dev = device();
    let mut r = rng(73);
    let b = 2500;
    let lengths: Vec<usize> = (0..b).map(|_| r.random_range(2..9)).collect();
    let total: usize = lengths.iter().sum();
    let c = 8;
    let batch = RaggedBatch::from_lengths(&lengths, &dev).unwrap();
    let x = Tensor::from_slice(&randn(&mut r, total * c, 1.0), (total, c), &dev).unwrap();
    let rule = KeepRule::AtLeastMeanTimes(1.0);
    let want = select_by_rule(&x, &batch, TokenScores::RowL2Norm, 1, rule, None).unwrap();
    let got = select_by_rule_bounded(&x, &batch, TokenScores::RowL2Norm, 1, rule, None).unwrap();
    assert_same_step(
        "2500 sequences",
        (&got.0, &got.1),
        (&want.0, &want.1),
        &batch,
        1,
        rule,
        None,
    );
}

/// A bounded batch still refuses what an exact one refuses, before any launch.
#[test]
fn bad_input_is_refused() {
    let dev = Device::Cpu;
    let batch = RaggedBatch::from_lengths(&[3, 4], &dev).unwrap();
    let x = Tensor::zeros((7, 4), DType::F32, &dev).unwrap();
    let rule = KeepRule::AtLeast(0.0);
    let (y, b2) =
        select_by_rule_bounded(&x, &batch, TokenScores::RowL2Norm, 1, rule, None).unwrap();
    // Wrong row count for the bounded batch.
    let short = y.narrow(0, 0, y.dim(0).unwrap() - 1).unwrap();
    assert!(select_by_rule_bounded(&short, &b2, TokenScores::RowL2Norm, 1, rule, None).is_err());
    // Every token is prefix.
    assert!(select_by_rule_bounded(&x, &batch, TokenScores::RowL2Norm, 4, rule, None).is_err());
    assert!(leading_rows(&short, &b2, 1).is_err());
}

/// `read_total` reads `cu_seqlens[B]` of a bounded batch (and gives an exact batch's total
/// without a read); a batch rebuilt over the same `cu_seqlens` with exactly that many rows
/// gives the ops the same results as the capacity-sized one; the unchecked constructor still
/// refuses a `cu_seqlens` of the wrong dtype or rank.
#[test]
fn fitted_to_the_read_total() {
    let dev = device();
    let mut r = rng(91);
    let lengths = [9usize, 2, 17, 5];
    let batch = RaggedBatch::from_lengths(&lengths, &dev).unwrap();
    let total: usize = lengths.iter().sum();
    assert_eq!(batch.read_total().unwrap(), total);
    let c = 64;
    let x = Tensor::from_slice(&randn(&mut r, total * c, 1.0), (total, c), &dev).unwrap();
    let rule = KeepRule::AtLeastMeanTimes(1.0);
    let (y, bounded) =
        select_by_rule_bounded(&x, &batch, TokenScores::RowL2Norm, 1, rule, None).unwrap();
    let kept: usize = bounded.lengths().unwrap().iter().sum();
    assert_eq!(bounded.read_total().unwrap(), kept);
    assert!(
        kept < bounded.total_tokens(),
        "the rule should drop some rows"
    );
    // SAFETY: the bounded batch's own cu_seqlens, with rows = its total.
    let fitted = unsafe {
        RaggedBatch::from_device_cu_seqlens_unchecked(
            bounded.cu_seqlens().clone(),
            kept,
            bounded.max_len(),
        )
    }
    .unwrap();
    assert_eq!(fitted.batch_size(), lengths.len());
    assert_eq!(fitted.total_tokens(), kept);
    let y_fit = y.narrow(0, 0, kept).unwrap();
    let (h, d) = (1, 64);
    let qkv = |t: &Tensor| t.reshape((t.dim(0).unwrap(), h, d)).unwrap();
    let a = ragged_attention(&qkv(&y), &qkv(&y), &qkv(&y), &bounded, 0.125).unwrap();
    let b = ragged_attention(&qkv(&y_fit), &qkv(&y_fit), &qkv(&y_fit), &fitted, 0.125).unwrap();
    let a = host(&a.narrow(0, 0, kept).unwrap());
    let b = host(&b);
    assert_eq!(a, b, "attention over the fitted batch");
    let m1 = host(&sequence_mean(&y, &bounded, 1).unwrap());
    let m2 = host(&sequence_mean(&y_fit, &fitted, 1).unwrap());
    assert_eq!(m1, m2, "sequence means over the fitted batch");
    for bad in [
        Tensor::zeros(5, DType::F32, &dev).unwrap(),
        Tensor::zeros((1, 5), DType::U32, &dev).unwrap(),
        Tensor::zeros(1, DType::U32, &dev).unwrap(),
    ] {
        let e = unsafe { RaggedBatch::from_device_cu_seqlens_unchecked(bad, 4, 4) }.unwrap_err();
        assert!(e.to_string().contains("cu_seqlens"), "{e}");
    }
}
