//! The three execution paths agree: for every pruner × {fixed, adaptive}, `padded` and `ragged`
//! keep the same tokens and give the same logits (and top-1), and with nothing pruned both equal
//! `dense`. Small random models on the CPU (CI); the published sizes run with
//! `cargo test -p workspace-tests --test paths_agreement -- --ignored` (`PATHS_DEVICE=cuda` with
//! the `cuda` feature; `PATHS_MODELS=deit-tiny,deit-small`, `PATHS_BATCH=32`).

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, IndexOp, Tensor};
use candle_nn::VarBuilder;
use common::{random_timm_weights, to_tensors};
use models::{Checkpoint, DeiT, DeiTConfig, ExecutionPath, PrunedForward};
use pruners::{
    AtsConfig, DynamicVit, DynamicVitConfig, EvitConfig, KeepPlan, Mode, Needs, PruneInput,
    PruneSite, PrunerConfig, PrunerKind, PruningSchedule, ScheduledPruner, ThresholdL2Config,
    TokenPruner,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

type Pruners = Vec<models::BlockPruner>;

// ---------------------------------------------------------------------------------------------
// Setup
// ---------------------------------------------------------------------------------------------

/// A small DeiT going through the same code as the published ones: 64 px images with 8 px
/// patches (64 patch tokens), width 64 in 2 heads (head_dim 32, a ragged-kernel size), depth 4.
fn small_cfg(distilled: bool) -> DeiTConfig {
    let mut c = DeiTConfig::custom(64, 4, 2, 10, distilled);
    c.image_size = 64;
    c.patch_size = 8;
    c.name = "paths-test".into();
    c
}

fn model(cfg: &DeiTConfig, dtype: DType, dev: &Device, seed: u64) -> DeiT {
    Checkpoint::from_tensors(to_tensors(&random_timm_weights(cfg, seed)))
        .unwrap()
        .load_model(cfg, dtype, dev)
        .unwrap()
}

/// `b` images `[b, 3, s, s]` of varied content: image `i` has a base level, a contrast that grows
/// with `i`, and a random share of "busy" patches (high contrast) among calm ones, so
/// norm / attention thresholds keep different counts per image.
fn varied_pixels(b: usize, cfg: &DeiTConfig, seed: u64, dev: &Device) -> Tensor {
    let (s, p) = (cfg.image_size, cfg.patch_size);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut data = vec![0f32; b * 3 * s * s];
    for i in 0..b {
        let contrast = 0.1
            + 2.0 * (i as f32 / b.max(2) as f32 - 1.0).powi(2).max(0.0)
            + rng.random_range(0.0..0.5);
        let busy_share: f32 = rng.random_range(0.1..0.9);
        let level: f32 = rng.random_range(-0.5..0.5);
        let grid = s / p;
        let busy: Vec<bool> = (0..grid * grid)
            .map(|_| rng.random::<f32>() < busy_share)
            .collect();
        for ch in 0..3 {
            for y in 0..s {
                for x in 0..s {
                    let amp = if busy[(y / p) * grid + x / p] {
                        contrast
                    } else {
                        0.1 * contrast
                    };
                    data[((i * 3 + ch) * s + y) * s + x] =
                        level + amp * rng.random_range(-1.0..1.0);
                }
            }
        }
    }
    Tensor::from_vec(data, (b, 3, s, s), dev).unwrap()
}

/// Random DynamicViT predictor weights (`score_predictor.{stage}.*`) scaled ~1/sqrt(fan_in), so
/// that keep probabilities actually vary (the reference init, std 0.02, makes them all ≈ 0.5).
fn dynamicvit_weights(
    cfg: &DeiTConfig,
    stages: usize,
    seed: u64,
    dev: &Device,
) -> VarBuilder<'static> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut map = HashMap::new();
    for stage in 0..stages {
        for (name, shape) in DynamicVit::tensor_names(stage, cfg.dim) {
            let n: usize = shape.iter().product();
            let data: Vec<f32> = if name.ends_with("in_conv.0.weight") {
                vec![1.0; n]
            } else {
                let fan_in = *shape.last().unwrap() as f32;
                let s = if shape.len() == 1 {
                    0.1
                } else {
                    (3.0 / fan_in).sqrt()
                };
                (0..n).map(|_| rng.random_range(-s..s)).collect()
            };
            map.insert(name, Tensor::from_vec(data, shape, dev).unwrap());
        }
    }
    VarBuilder::from_tensors(map, DType::F32, dev)
}

/// The pruner configuration of `kind` × `mode` for the small config at pruning stage `stage`
/// (keep ratio 0.7 / the default adaptive rules, with the counts referring to this config's
/// patch count).
fn small_config(kind: PrunerKind, mode: Mode, stage: usize, patches: usize) -> PrunerConfig {
    match (kind, mode) {
        (PrunerKind::ThresholdL2, Mode::Fixed) => {
            PrunerConfig::ThresholdL2(ThresholdL2Config::fixed(0.7))
        }
        (PrunerKind::ThresholdL2, Mode::Adaptive) => {
            PrunerConfig::ThresholdL2(ThresholdL2Config::relative(1.0))
        }
        (PrunerKind::DynamicVit, Mode::Fixed) => {
            PrunerConfig::DynamicVit(DynamicVitConfig::fixed(stage, 0.7, patches))
        }
        (PrunerKind::DynamicVit, Mode::Adaptive) => {
            PrunerConfig::DynamicVit(DynamicVitConfig::adaptive(stage, patches))
        }
        (PrunerKind::Evit, Mode::Fixed) => PrunerConfig::Evit(EvitConfig::fixed(0.7)),
        (PrunerKind::Evit, Mode::Adaptive) => PrunerConfig::Evit(EvitConfig::adaptive(0.9)),
        (PrunerKind::Ats, Mode::Fixed) => PrunerConfig::Ats(AtsConfig::fixed(0.7)),
        (PrunerKind::Ats, Mode::Adaptive) => PrunerConfig::Ats(AtsConfig::adaptive(patches / 2)),
    }
}

fn schedule(blocks: &[usize], config: impl Fn(usize) -> PrunerConfig) -> PruningSchedule {
    PruningSchedule {
        entries: blocks
            .iter()
            .enumerate()
            .map(|(stage, &block)| ScheduledPruner {
                block,
                config: config(stage),
            })
            .collect(),
    }
}

fn build(model: &DeiT, s: &PruningSchedule, dev: &Device) -> Pruners {
    let vb = dynamicvit_weights(&model.config, s.entries.len(), 7, dev);
    model.build_pruners(s, Some(&vb)).unwrap()
}

// ---------------------------------------------------------------------------------------------
// Comparisons
// ---------------------------------------------------------------------------------------------

fn logits(f: &PrunedForward) -> Vec<Vec<f32>> {
    f32_rows(&f.logits)
}

/// A `[B, classes]` logits tensor of any dtype as f32 rows.
fn f32_rows(t: &Tensor) -> Vec<Vec<f32>> {
    t.to_dtype(DType::F32).unwrap().to_vec2().unwrap()
}

fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |best, (i, &v)| {
            if v > best.1 {
                (i, v)
            } else {
                best
            }
        })
        .0
}

/// Tolerance on |Δlogit|: 1e-4 in f32. In half precision 1e-2, or 4 units of the format's
/// epsilon relative to the largest logit if that is larger: a bf16 logit of magnitude 2..4 has an
/// ulp of 1.6e-2, so two roundings of the same value can already differ by more than 1e-2 (f16,
/// with 3 more mantissa bits, stays within 1e-2 here).
fn tolerance(dtype: DType, reference: &[Vec<f32>]) -> f32 {
    let eps = match dtype {
        DType::F32 => return 1e-4,
        DType::F16 => half::f16::EPSILON.to_f32(),
        _ => half::bf16::EPSILON.to_f32(),
    };
    let scale = reference.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
    (4.0 * eps * scale.max(1.0)).max(1e-2)
}

/// Same logits within `tol` and the same top-1 for every image; returns max |Δ|.
fn assert_logits_agree(what: &str, a: &[Vec<f32>], b: &[Vec<f32>], tol: f32) -> f32 {
    assert_eq!(a.len(), b.len(), "{what}: batch sizes");
    let mut max = 0f32;
    for (i, (ra, rb)) in a.iter().zip(b).enumerate() {
        assert!(
            ra.iter().all(|v| v.is_finite()),
            "{what}: image {i} has non-finite logits"
        );
        for (x, y) in ra.iter().zip(rb) {
            max = max.max((x - y).abs());
        }
        // The same top-1, unless the two leading logits are tied within the tolerance: then
        // rounding may legitimately order them either way (random-weight models in bf16 give
        // such near-ties; a real disagreement shows up as a logit difference above `tol`).
        let (ia, ib) = (argmax(ra), argmax(rb));
        assert!(
            ia == ib || (ra[ia] - ra[ib]).abs() <= tol,
            "{what}: top-1 of image {i} differs ({ia} vs {ib}, logits {} vs {})",
            ra[ia],
            ra[ib]
        );
    }
    assert!(max <= tol, "{what}: max |Δlogit| {max} > {tol}");
    max
}

/// Padded and ragged kept the same tokens at every stage.
fn assert_same_decisions(what: &str, p: &PrunedForward, r: &PrunedForward) {
    assert_eq!(p.stages.len(), r.stages.len(), "{what}: stage count");
    for (sp, sr) in p.stages.iter().zip(&r.stages) {
        assert_eq!(sp.block, sr.block, "{what}");
        for (i, (a, b)) in sp.keep_indices.iter().zip(&sr.keep_indices).enumerate() {
            assert_eq!(
                a, b,
                "{what}: block {} image {i}: kept indices differ",
                sp.block
            );
        }
        assert_eq!(
            sp.fused, sr.fused,
            "{what}: block {} fused tokens",
            sp.block
        );
        assert_eq!(sp.original_positions, sr.original_positions, "{what}");
    }
}

/// Structural checks of one path's record: ascending kept positions with the prefix, lengths
/// consistent with the previous stage.
fn assert_well_formed(what: &str, f: &PrunedForward, num_prefix: usize) {
    let b = f.logits.dim(0).unwrap();
    let mut lengths = vec![f.initial_tokens; b];
    for s in &f.stages {
        assert_eq!(s.keep_indices.len(), b, "{what}");
        for (i, (idx, &len)) in s.keep_indices.iter().zip(&lengths).enumerate() {
            assert!(idx.windows(2).all(|w| w[0] < w[1]), "{what}: not ascending");
            assert!(
                idx.iter()
                    .take(num_prefix)
                    .copied()
                    .eq(0..num_prefix as u32),
                "{what}: prefix"
            );
            assert!(idx.len() > num_prefix, "{what}: no patch token kept");
            assert!(
                (*idx.last().unwrap() as usize) < len,
                "{what}: index past length"
            );
            assert_eq!(
                s.kept_tokens[i],
                idx.len() + usize::from(s.fused[i]),
                "{what}"
            );
        }
        lengths = s.kept_tokens.clone();
    }
}

struct Outcome {
    padded: PrunedForward,
    ragged: PrunedForward,
    max_diff: f32,
}

/// The padded and the ragged forward of `pixels` with `pruners`.
fn padded_and_ragged(
    model: &DeiT,
    pixels: &Tensor,
    pruners: &Pruners,
) -> (PrunedForward, PrunedForward) {
    let run = |path| model.forward_pruned(pixels, pruners, path).unwrap();
    (run(ExecutionPath::Padded), run(ExecutionPath::Ragged))
}

/// Runs padded and ragged and checks they agree.
fn check_padded_vs_ragged(what: &str, model: &DeiT, pixels: &Tensor, pruners: &Pruners) -> Outcome {
    let (padded, ragged) = padded_and_ragged(model, pixels, pruners);
    let max_diff = assert_agree(what, model, &padded, &ragged);
    Outcome {
        padded,
        ragged,
        max_diff,
    }
}

/// Both forwards well formed, the same decisions, logits within the tolerance; max |Δlogit|.
fn assert_agree(what: &str, model: &DeiT, padded: &PrunedForward, ragged: &PrunedForward) -> f32 {
    let np = model.config.num_prefix_tokens();
    assert_well_formed(what, padded, np);
    assert_well_formed(what, ragged, np);
    assert_same_decisions(what, padded, ragged);
    let (lp, lr) = (logits(padded), logits(ragged));
    assert_logits_agree(what, &lp, &lr, tolerance(model.dtype(), &lp))
}

/// Per image whose padded and ragged decisions differ: (stage, image, size of the symmetric
/// difference of its kept indices at the first stage where they differ).
fn first_differences(p: &PrunedForward, r: &PrunedForward) -> Vec<(usize, usize, usize)> {
    let images = p.stages.first().map_or(0, |s| s.keep_indices.len());
    (0..images)
        .filter_map(|i| {
            p.stages
                .iter()
                .zip(&r.stages)
                .enumerate()
                .find_map(|(st, (sp, sr))| {
                    let (a, b) = (&sp.keep_indices[i], &sr.keep_indices[i]);
                    (a != b).then(|| {
                        let only_a = a.iter().filter(|x| !b.contains(x)).count();
                        let only_b = b.iter().filter(|x| !a.contains(x)).count();
                        (st, i, only_a + only_b)
                    })
                })
        })
        .collect()
}

/// As [`check_padded_vs_ragged`], except that the two paths may order a near-tie differently:
/// their f32 blocks round differently at the ~1e-6 level, and a learned pruner's
/// keep-probabilities of two tokens can be that close (DynamicViT at DeiT-B's size, batch 8,
/// block 6; and on the small CPU model, [`every_pruner_padded_equals_ragged`]).
/// So where decisions differ, each differing image's first difference must be one token kept in
/// place of another, in at most ⌈batch / 16⌉ images (a real disagreement differs wholesale),
/// and the execution is then compared with the padded run's plans replayed on the ragged path
/// (`fresh` builds the pruners again for that run).
fn check_padded_vs_ragged_allowing_near_ties(
    what: &str,
    model: &DeiT,
    pixels: &Tensor,
    pruners: &Pruners,
    fresh: impl Fn() -> Pruners,
) -> Outcome {
    let (padded, ragged) = padded_and_ragged(model, pixels, pruners);
    let diffs = first_differences(&padded, &ragged);
    let max_diff = if diffs.is_empty() {
        assert_agree(what, model, &padded, &ragged)
    } else {
        let np = model.config.num_prefix_tokens();
        assert_well_formed(what, &padded, np);
        assert_well_formed(what, &ragged, np);
        let batch = padded.stages[0].keep_indices.len();
        assert!(
            diffs.len() <= batch.div_ceil(16) && diffs.iter().all(|&(_, _, d)| d <= 2),
            "{what}: padded and ragged decide differently beyond a near-tie: (stage, image, tokens \
             differing) {diffs:?}"
        );
        eprintln!(
            "{what}: {} image(s) order a near-tie differently (stage, image, tokens differing: \
             {diffs:?}); execution compared with the padded run's plans replayed",
            diffs.len()
        );
        check_with_replayed_plans(what, model, pixels, fresh())
    };
    Outcome {
        padded,
        ragged,
        max_diff,
    }
}

/// The most distinct per-image lengths at any stage.
fn distinct_lengths(f: &PrunedForward) -> usize {
    f.stages
        .iter()
        .map(|s| {
            let mut l = s.kept_tokens.clone();
            l.sort_unstable();
            l.dedup();
            l.len()
        })
        .max()
        .unwrap_or(0)
}

fn dense(model: &DeiT, pixels: &Tensor) -> Vec<Vec<f32>> {
    logits(
        &model
            .forward_pruned(pixels, &[], ExecutionPath::Dense)
            .unwrap(),
    )
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

const BLOCKS: [usize; 3] = [1, 2, 3];

/// Every pruner × mode: padded and ragged agree on a batch of 32 varied images (f32): the same
/// decisions, or at most a near-tie ordered differently in ⌈32 / 16⌉ images, whose execution is
/// then compared with the padded run's plans replayed (on this small model too the paths' f32
/// blocks round differently: a DynamicViT fixed step has seen two keep log-probabilities one
/// f32 ulp apart, −0.7006 and −0.70059997, ordered differently by the two paths).
#[test]
fn every_pruner_padded_equals_ragged() {
    let dev = Device::Cpu;
    for distilled in [false, true] {
        let cfg = small_cfg(distilled);
        let m = model(&cfg, DType::F32, &dev, 100 + distilled as u64);
        let pixels = varied_pixels(32, &cfg, 5, &dev);
        for kind in PrunerKind::ALL {
            for mode in [Mode::Fixed, Mode::Adaptive] {
                let what = format!("{kind}-{mode} distilled={distilled}");
                let s = schedule(&BLOCKS, |st| {
                    small_config(kind, mode, st, cfg.num_patches())
                });
                let o = check_padded_vs_ragged_allowing_near_ties(
                    &what,
                    &m,
                    &pixels,
                    &build(&m, &s, &dev),
                    || build(&m, &s, &dev),
                );
                assert_eq!(o.padded.stages.len(), 3, "{what}");
                // Something was pruned, and adaptive modes (and ATS, whose samples collapse)
                // really produce ragged batches, so the padding mask is exercised.
                let last = o.ragged.stages.last().unwrap();
                assert!(
                    last.kept_tokens
                        .iter()
                        .all(|&k| k < o.ragged.initial_tokens),
                    "{what}: nothing pruned"
                );
                if mode == Mode::Adaptive || kind == PrunerKind::Ats {
                    assert!(
                        distinct_lengths(&o.ragged) >= 3,
                        "{what}: images keep (almost) equal counts: {:?}",
                        o.ragged.kept_tokens()
                    );
                }
                eprintln!(
                    "{what}: max |Δlogit| {:.2e}, final mean tokens {:.1}",
                    o.max_diff,
                    o.ragged.mean_final_tokens()
                );
            }
        }
    }
}

/// Records the plans a pruner makes (on the padded run) so that the ragged run can replay them.
#[derive(Debug)]
struct Recording {
    inner: Box<dyn TokenPruner>,
    plans: Arc<Mutex<Vec<KeepPlan>>>,
}

impl TokenPruner for Recording {
    fn kind(&self) -> PrunerKind {
        self.inner.kind()
    }
    fn mode(&self) -> Mode {
        self.inner.mode()
    }
    fn site(&self) -> PruneSite {
        self.inner.site()
    }
    fn needs(&self) -> Needs {
        self.inner.needs()
    }
    fn scores(&self, input: &PruneInput) -> pruners::Result<Tensor> {
        self.inner.scores(input)
    }
    fn keep_rule(&self) -> Option<pruners::KeepRule> {
        self.inner.keep_rule()
    }
    fn fusion(&self) -> Option<pruners::EvitFusion> {
        self.inner.fusion()
    }
    fn plan(&self, input: &PruneInput) -> pruners::Result<KeepPlan> {
        let plan = self.inner.plan(input)?;
        self.plans.lock().unwrap().push(plan.clone());
        Ok(plan)
    }
}

/// Hands out a recorded plan (indices and EViT's fused tokens) instead of deciding.
#[derive(Debug)]
struct Replay {
    site: PruneSite,
    plan: KeepPlan,
}

impl TokenPruner for Replay {
    fn kind(&self) -> PrunerKind {
        PrunerKind::ThresholdL2
    }
    fn mode(&self) -> Mode {
        Mode::Fixed
    }
    fn site(&self) -> PruneSite {
        self.site
    }
    fn needs(&self) -> Needs {
        Needs::default()
    }
    fn scores(&self, input: &PruneInput) -> pruners::Result<Tensor> {
        let g = input.validate()?;
        Ok(Tensor::zeros(
            (g.batch, g.tokens),
            DType::F32,
            input.tokens.device(),
        )?)
    }
    fn plan(&self, input: &PruneInput) -> pruners::Result<KeepPlan> {
        let g = input.validate()?;
        // The replayed run must arrive at the same layout the plan was made for.
        for (i, idx) in self.plan.indices.iter().enumerate() {
            assert!(
                (*idx.last().unwrap() as usize) < g.lengths[i],
                "replay: image {i} is shorter"
            );
        }
        Ok(self.plan.clone())
    }
}

/// Half precision rounds differently on the two paths (the padded attention rounds scores and
/// probabilities to f16/bf16; the ragged kernel keeps them in f32), so decisions near a threshold
/// flip between paths (and near-ties can in f32). The execution is compared with the decisions
/// held fixed: the padded run's plans are replayed on the ragged path; the logits then agree
/// within the dtype's tolerance.
fn check_with_replayed_plans(what: &str, m: &DeiT, pixels: &Tensor, pruners: Pruners) -> f32 {
    let recorded: Vec<Arc<Mutex<Vec<KeepPlan>>>> = pruners.iter().map(|_| Arc::default()).collect();
    let recording: Pruners = pruners
        .into_iter()
        .zip(&recorded)
        .map(|((block, inner), plans)| {
            let r: Box<dyn TokenPruner> = Box::new(Recording {
                inner,
                plans: plans.clone(),
            });
            (block, r)
        })
        .collect();
    let padded = m
        .forward_pruned(pixels, &recording, ExecutionPath::Padded)
        .unwrap();
    let replay: Pruners = recording
        .iter()
        .zip(&recorded)
        .map(|((block, p), plans)| {
            let plan = plans.lock().unwrap().pop().unwrap();
            let r: Box<dyn TokenPruner> = Box::new(Replay {
                site: p.site(),
                plan,
            });
            (*block, r)
        })
        .collect();
    let ragged = m
        .forward_pruned(pixels, &replay, ExecutionPath::Ragged)
        .unwrap();
    assert_well_formed(what, &ragged, m.config.num_prefix_tokens());
    assert_same_decisions(what, &padded, &ragged);
    let (lp, lr) = (logits(&padded), logits(&ragged));
    let tol = tolerance(m.dtype(), &lp);
    let mut max = 0f32;
    for (i, (a, b)) in lp.iter().zip(&lr).enumerate() {
        assert!(b.iter().all(|v| v.is_finite()), "{what}: image {i}");
        a.iter()
            .zip(b)
            .for_each(|(x, y)| max = max.max((x - y).abs()));
        // Same top-1 unless the padded run's two best classes are within the tolerance.
        let mut sorted = a.clone();
        sorted.sort_by(|x, y| y.total_cmp(x));
        if sorted[0] - sorted[1] > 2.0 * tol {
            assert_eq!(argmax(a), argmax(b), "{what}: top-1 of image {i}");
        }
    }
    assert!(max <= tol, "{what}: max |Δlogit| {max} > {tol}");
    max
}

/// Half precision, every pruner × mode: with the decisions held fixed, padded and ragged agree
/// within the f16/bf16 tolerance.
#[test]
fn half_precision_padded_equals_ragged() {
    let dev = Device::Cpu;
    let cfg = small_cfg(false);
    let pixels = varied_pixels(32, &cfg, 9, &dev);
    for dtype in [DType::F16, DType::BF16] {
        let m = model(&cfg, dtype, &dev, 200);
        for kind in PrunerKind::ALL {
            for mode in [Mode::Fixed, Mode::Adaptive] {
                let what = format!("{kind}-{mode} {dtype:?}");
                let s = schedule(&BLOCKS, |st| {
                    small_config(kind, mode, st, cfg.num_patches())
                });
                let d = check_with_replayed_plans(&what, &m, &pixels, build(&m, &s, &dev));
                eprintln!("{what}: max |Δlogit| {d:.2e}");
            }
        }
    }
}

/// With nothing pruned (no pruners, or pruners that keep everything), padded and ragged equal
/// dense, in f32 and half precision.
#[test]
fn keeping_everything_equals_dense() {
    let dev = Device::Cpu;
    for (distilled, dtype) in [
        (false, DType::F32),
        (true, DType::F32),
        (false, DType::BF16),
        (true, DType::F16),
    ] {
        let cfg = small_cfg(distilled);
        let m = model(&cfg, dtype, &dev, 300);
        let pixels = varied_pixels(8, &cfg, 11, &dev);
        let want = dense(&m, &pixels);
        let tol = tolerance(dtype, &want);
        let patches = cfg.num_patches();
        let keep_all: [(&str, PruningSchedule); 4] = [
            ("none", PruningSchedule::none()),
            (
                "threshold-l2 1.0",
                schedule(&BLOCKS, |_| {
                    PrunerConfig::ThresholdL2(ThresholdL2Config::fixed(1.0))
                }),
            ),
            (
                "dynamicvit 1.0",
                schedule(&BLOCKS, |st| {
                    PrunerConfig::DynamicVit(DynamicVitConfig::fixed(st, 1.0, patches))
                }),
            ),
            (
                "evit 1.0",
                schedule(&BLOCKS, |_| PrunerConfig::Evit(EvitConfig::fixed(1.0))),
            ),
        ];
        for (name, s) in keep_all {
            let what = format!("{name} distilled={distilled} {dtype:?}");
            let o = check_padded_vs_ragged(&what, &m, &pixels, &build(&m, &s, &dev));
            for f in [&o.padded, &o.ragged] {
                assert!(
                    f.stages
                        .iter()
                        .all(|s| s.kept_tokens.iter().all(|&k| k == cfg.seq_len())),
                    "{what}"
                );
                assert!(
                    f.stages.iter().all(|s| s.fused.iter().all(|&x| !x)),
                    "{what}"
                );
            }
            assert_logits_agree(
                &format!("{what} padded/dense"),
                &logits(&o.padded),
                &want,
                tol,
            );
            assert_logits_agree(
                &format!("{what} ragged/dense"),
                &logits(&o.ragged),
                &want,
                tol,
            );
        }
    }
    // The dense path refuses pruners instead of silently ignoring them.
    let cfg = small_cfg(false);
    let m = model(&cfg, DType::F32, &dev, 300);
    let s = schedule(&BLOCKS, |_| PrunerConfig::Evit(EvitConfig::fixed(0.5)));
    let pixels = varied_pixels(2, &cfg, 1, &dev);
    assert!(m
        .forward_pruned(&pixels, &build(&m, &s, &dev), ExecutionPath::Dense)
        .is_err());
}

/// Each image of a pruned batch gets the logits (and decisions) it gets alone, where nothing is
/// padded: the padding mask and the packing do not leak between images.
#[test]
fn batched_equals_one_image_at_a_time() {
    let dev = Device::Cpu;
    let cfg = small_cfg(true);
    let m = model(&cfg, DType::F32, &dev, 400);
    let pixels = varied_pixels(6, &cfg, 13, &dev);
    for kind in [PrunerKind::ThresholdL2, PrunerKind::Evit, PrunerKind::Ats] {
        let s = schedule(&BLOCKS, |st| {
            small_config(kind, Mode::Adaptive, st, cfg.num_patches())
        });
        let pruners = build(&m, &s, &dev);
        let o = check_padded_vs_ragged(&format!("{kind} batch"), &m, &pixels, &pruners);
        let (lp, lr) = (logits(&o.padded), logits(&o.ragged));
        for i in 0..6 {
            let one = pixels.i(i..i + 1).unwrap();
            // Batch of 1 (edge case): padded and ragged agree, and match the batched run.
            let what = format!("{kind} image {i} alone");
            let single = check_padded_vs_ragged(&what, &m, &one, &pruners);
            for (stage, alone) in o.padded.stages.iter().zip(&single.padded.stages) {
                assert_eq!(stage.keep_indices[i], alone.keep_indices[0], "{what}");
                assert_eq!(stage.fused[i], alone.fused[0], "{what}");
            }
            let alone = logits(&single.padded);
            assert_logits_agree(
                &format!("{what} vs padded batch"),
                &alone,
                &lp[i..i + 1],
                1e-4,
            );
            assert_logits_agree(
                &format!("{what} vs ragged batch"),
                &alone,
                &lr[i..i + 1],
                1e-4,
            );
        }
    }
}

/// A threshold so high that only the mandatory tokens survive: the prefix and one patch.
#[test]
fn only_mandatory_tokens_survive() {
    let dev = Device::Cpu;
    for distilled in [false, true] {
        let cfg = small_cfg(distilled);
        let m = model(&cfg, DType::F32, &dev, 500);
        let pixels = varied_pixels(32, &cfg, 17, &dev);
        let s = schedule(&BLOCKS, |_| {
            PrunerConfig::ThresholdL2(ThresholdL2Config::absolute(1e9))
        });
        let what = format!("mandatory only, distilled={distilled}");
        let o = check_padded_vs_ragged(&what, &m, &pixels, &build(&m, &s, &dev));
        let np = cfg.num_prefix_tokens();
        for s in &o.ragged.stages {
            assert!(
                s.kept_tokens.iter().all(|&k| k == np + 1),
                "{what}: {:?}",
                s.kept_tokens
            );
        }
        // After that, EViT / ATS still run on two- or three-token images.
        for kind in [PrunerKind::Evit, PrunerKind::Ats] {
            let s = schedule(&BLOCKS, |st| {
                if st == 0 {
                    PrunerConfig::ThresholdL2(ThresholdL2Config::absolute(1e9))
                } else {
                    small_config(kind, Mode::Fixed, st, cfg.num_patches())
                }
            });
            check_padded_vs_ragged(
                &format!("{what} then {kind}"),
                &m,
                &pixels,
                &build(&m, &s, &dev),
            );
        }
    }
}

/// One busy image among flat ones with an absolute norm threshold: one long sequence, many
/// short ones (the case where padding wastes the most).
#[test]
fn one_image_much_longer_than_the_rest() {
    let dev = Device::Cpu;
    let cfg = small_cfg(false);
    let m = model(&cfg, DType::F32, &dev, 600);
    let (b, s) = (16, cfg.image_size);
    let mut rng = StdRng::seed_from_u64(19);
    let mut data = vec![0.25f32; b * 3 * s * s];
    let busy = 5;
    for v in &mut data[busy * 3 * s * s..(busy + 1) * 3 * s * s] {
        *v = rng.random_range(-2.0..2.0);
    }
    let pixels = Tensor::from_vec(data, (b, 3, s, s), &dev).unwrap();
    // The threshold (a test input computed from the model's own block-1 input): just above the
    // largest patch-token norm of any flat image, so flat images keep one patch (the fallback)
    // and the busy image keeps every patch above it.
    let norms = {
        let x = m.embed(&pixels).unwrap();
        let x = candle_core::Module::forward(&m.blocks[0], &x).unwrap();
        let x = x.narrow(1, 1, cfg.num_patches()).unwrap();
        x.sqr()
            .unwrap()
            .sum(2)
            .unwrap()
            .sqrt()
            .unwrap()
            .to_vec2::<f32>()
            .unwrap()
    };
    let flat_max = norms
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != busy)
        .flat_map(|(_, r)| r.iter().copied())
        .fold(0f32, f32::max);
    let threshold = flat_max * 1.001;
    let sched = schedule(&BLOCKS, |st| match st {
        0 => PrunerConfig::ThresholdL2(ThresholdL2Config::absolute(threshold)),
        _ => PrunerConfig::Evit(EvitConfig::adaptive(0.9)),
    });
    let o = check_padded_vs_ragged("one long image", &m, &pixels, &build(&m, &sched, &dev));
    let first = &o.ragged.stages[0].kept_tokens;
    let others = first
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != busy)
        .map(|(_, &k)| k)
        .max()
        .unwrap();
    assert!(first[busy] >= 4 * others, "premise: lengths {first:?}");
}

// ---------------------------------------------------------------------------------------------
// Published sizes (GPU check; slow on the CPU)
// ---------------------------------------------------------------------------------------------

/// Images whose kept tokens differ between padded and ragged at some stage (informational).
fn images_deciding_differently(m: &DeiT, pixels: &Tensor, pruners: &Pruners) -> usize {
    let p = m
        .forward_pruned(pixels, pruners, ExecutionPath::Padded)
        .unwrap();
    let r = m
        .forward_pruned(pixels, pruners, ExecutionPath::Ragged)
        .unwrap();
    (0..pixels.dim(0).unwrap())
        .filter(|&i| {
            p.stages
                .iter()
                .zip(&r.stages)
                .any(|(a, b)| a.keep_indices[i] != b.keep_indices[i])
        })
        .count()
}

/// [`DeiT::forward_pruned_on_device`] against the host-decided ragged forward `host` of the
/// same pruners: the same kept tokens per stage and the same logits within the f32 tolerance;
/// on CUDA, for fixed-count pruners, also its captured graph, replayed, against the eager call
/// (bit-identical). Then [`DeiT::forward_pruned_capturable`] the same way, and on CUDA its graph
/// replayed for another input against the eager call on that input (one graph, two keep
/// patterns). Returns the max |Δlogit| against `host`.
fn check_on_device(
    what: &str,
    m: &DeiT,
    pixels: &Tensor,
    pruners: &Pruners,
    host: &PrunedForward,
) -> f32 {
    let on_device = m.forward_pruned_on_device(pixels, pruners).unwrap();
    assert_eq!(
        on_device.kept_tokens,
        host.kept_tokens(),
        "{what}: kept tokens per stage, device vs host decisions"
    );
    let eager = on_device.logits;
    let want = logits(host);
    let got = f32_rows(&eager);
    let d = assert_logits_agree(
        &format!("{what} on device"),
        &got,
        &want,
        tolerance(DType::F32, &want),
    );
    let fixed = pruners
        .iter()
        .all(|(_, p)| p.fixed_count(m.config.num_patches()).is_some());
    if pixels.device().is_cuda() && fixed {
        let graph = candle_fastpath::CapturedForward::capture(pixels, |x| {
            m.forward_pruned_on_device(x, pruners)
                .map(|f| f.logits)
                .map_err(candle_core::Error::wrap)
        })
        .unwrap();
        // A different input first, so the replay below cannot pass by leftover buffers.
        graph.run(&(pixels * 0.5).unwrap()).unwrap();
        let replayed = graph.run(pixels).unwrap();
        assert_eq!(
            max_abs(&replayed, &eager),
            0.0,
            "{what}: graph replay differs from the eager call"
        );
    }
    let dc = check_capturable(what, m, pixels, pruners, host, &want);
    d.max(dc)
}

fn max_abs(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// See [`check_on_device`]: the capturable forward, no host sync for any pruner.
fn check_capturable(
    what: &str,
    m: &DeiT,
    pixels: &Tensor,
    pruners: &Pruners,
    host: &PrunedForward,
    want: &[Vec<f32>],
) -> f32 {
    let forward = |x: &Tensor| m.forward_pruned_capturable(x, pruners).unwrap();
    let out = forward(pixels);
    assert_eq!(
        out.kept_tokens().unwrap(),
        host.kept_tokens(),
        "{what}: kept tokens per stage, capturable vs host decisions"
    );
    let got = f32_rows(&out.logits);
    let d = assert_logits_agree(
        &format!("{what} capturable"),
        &got,
        want,
        tolerance(DType::F32, want),
    );
    if pixels.device().is_cuda() {
        let graph = candle_fastpath::CapturedForward::capture(pixels, |x| {
            m.forward_pruned_capturable(x, pruners)
                .map(|f| f.logits)
                .map_err(candle_core::Error::wrap)
        })
        .unwrap();
        let other = (pixels * 0.5).unwrap();
        let replayed_other = graph.run(&other).unwrap();
        let replayed = graph.run(pixels).unwrap();
        assert_eq!(
            max_abs(&replayed, &out.logits),
            0.0,
            "{what}: capturable graph replay differs from the eager call"
        );
        let eager_other = forward(&other);
        assert_eq!(
            max_abs(&replayed_other, &eager_other.logits),
            0.0,
            "{what}: capturable graph replayed for another input differs from the eager call \
             (kept {:?} vs {:?})",
            eager_other.kept_tokens().unwrap().last(),
            out.kept_tokens().unwrap().last(),
        );
    }
    let ds = check_two_stage(what, m, pixels, pruners, host, &out.logits);
    d.max(ds)
}

/// The capturable forward cut after its first step ([`DeiT::forward_to_first_step`], the
/// step's total read back, [`DeiT::forward_from_step`] over exactly that many rows and over a
/// few spare rows more), and cut after every step ([`DeiT::forward_to_next_step`], each step
/// fitted to its total): each step's total is the host's, and the logits agree with the
/// capturable forward's within the f32 tolerance. On CUDA, the same through
/// [`models::StagedGraph`] (both [`models::Reads`]), replayed for another input first. Returns
/// the max |Δlogit|.
fn check_two_stage(
    what: &str,
    m: &DeiT,
    pixels: &Tensor,
    pruners: &Pruners,
    host: &PrunedForward,
    capturable: &Tensor,
) -> f32 {
    let want = f32_rows(capturable);
    let tol = tolerance(DType::F32, &want);
    let host_totals: Vec<usize> = host.kept_tokens().iter().map(|k| k.iter().sum()).collect();
    let step = m.forward_to_first_step(pixels, pruners).unwrap();
    let mut worst = 0f32;
    for spare in [0, 7] {
        let (fitted, total) = step.fit(|t| t + spare).unwrap();
        assert_eq!(
            total, host_totals[0],
            "{what}: first step's total, split vs host"
        );
        let rows = fitted.tokens().dim(0).unwrap();
        assert_eq!(
            rows,
            (total + spare).min(step.tokens().dim(0).unwrap()),
            "{what}: rows kept after the read"
        );
        let got = m.forward_from_step(&fitted, pruners).unwrap();
        let got = f32_rows(&got);
        worst = worst.max(assert_logits_agree(
            &format!("{what} two-stage over {rows} rows"),
            &got,
            &want,
            tol,
        ));
    }
    // Cut after every step, each fitted to exactly its total.
    let (mut fitted, _) = step.fit(|t| t).unwrap();
    for (k, &host_total) in host_totals.iter().enumerate().skip(1) {
        let next = m.forward_to_next_step(&fitted, pruners).unwrap();
        assert_eq!(
            next.block(),
            step_blocks(pruners)[k],
            "{what}: step {k}'s block"
        );
        let (f, total) = next.fit(|t| t).unwrap();
        assert_eq!(total, host_total, "{what}: step {k}'s total, split vs host");
        fitted = f;
    }
    let e = m.forward_to_next_step(&fitted, pruners).unwrap_err();
    assert!(e.to_string().contains("no step after block"), "{e}");
    let got = m.forward_from_step(&fitted, pruners).unwrap();
    let got = f32_rows(&got);
    worst = worst.max(assert_logits_agree(
        &format!("{what} split after every step"),
        &got,
        &want,
        tol,
    ));
    if pixels.device().is_cuda() {
        let other = (pixels * 0.5).unwrap();
        let eager_other = f32_rows(&m.forward_pruned_capturable(&other, pruners).unwrap().logits);
        for reads in [models::Reads::First, models::Reads::EveryStep] {
            let graphs = models::StagedGraph::capture(m, pixels, pruners, reads).unwrap();
            let replayed_other = graphs.run(&other).unwrap();
            let replayed = graphs.run(pixels).unwrap();
            let got = f32_rows(&replayed);
            worst = worst.max(assert_logits_agree(
                &format!("{what} staged graphs {reads:?}"),
                &got,
                &want,
                tol,
            ));
            let got_other = f32_rows(&replayed_other);
            worst = worst.max(assert_logits_agree(
                &format!("{what} staged graphs {reads:?}, another input"),
                &got_other,
                &eager_other,
                tolerance(DType::F32, &eager_other),
            ));
            let stages = if reads == models::Reads::First {
                1
            } else {
                host_totals.len()
            };
            assert!(
                graphs.captured_graphs() >= stages,
                "{what}: {} graphs after the first for {stages} stages",
                graphs.captured_graphs()
            );
        }
    }
    worst
}

/// The blocks of a schedule's pruning steps, in order.
fn step_blocks(pruners: &Pruners) -> Vec<usize> {
    let mut b: Vec<usize> = pruners.iter().map(|(blk, _)| *blk).collect();
    b.sort_unstable();
    b
}

/// Device-side decisions give the host-decided ragged forward's kept tokens and logits, for
/// every pruner and mode: fixed counts through the sync-free path, the others through
/// `select_by_rule`; a pruner without a keep rule is refused with a clear error.
#[test]
fn device_decisions_equal_host_decisions() {
    let dev = Device::Cpu;
    for distilled in [false, true] {
        let cfg = small_cfg(distilled);
        let m = model(&cfg, DType::F32, &dev, 300 + distilled as u64);
        let pixels = varied_pixels(16, &cfg, 9, &dev);
        every_pruner_on_device(&format!("distilled={distilled}"), &m, &cfg, &pixels);
        let plan = KeepPlan {
            indices: vec![(0..cfg.seq_len() as u32).collect(); 16],
            fused: None,
            num_prefix: cfg.num_prefix_tokens(),
        };
        let replay: Pruners = vec![(
            1,
            Box::new(Replay {
                site: PruneSite::BeforeBlock,
                plan,
            }),
        )];
        let err = m
            .forward_pruned_on_device(&pixels, &replay)
            .unwrap_err()
            .to_string();
        assert!(err.contains("keep rule"), "replayed plan: {err}");
        let err = m
            .forward_pruned_capturable(&pixels, &replay)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("keep rule"),
            "replayed plan, capturable: {err}"
        );
    }
}

/// [`check_on_device`] for every pruner in both modes on `pixels`, against the host decisions.
fn every_pruner_on_device(tag: &str, m: &DeiT, cfg: &DeiTConfig, pixels: &Tensor) {
    let dev = pixels.device();
    for kind in PrunerKind::ALL {
        for mode in [Mode::Fixed, Mode::Adaptive] {
            let what = format!("{kind}-{mode} {tag}");
            let s = schedule(&BLOCKS, |st| {
                small_config(kind, mode, st, cfg.num_patches())
            });
            let pruners = build(m, &s, dev);
            let host = m
                .forward_pruned(pixels, &pruners, ExecutionPath::Ragged)
                .unwrap();
            let d = check_on_device(&what, m, pixels, &pruners, &host);
            eprintln!("{what}: device vs host decisions, max |Δlogit| {d:.2e}");
        }
    }
}

/// One image: the fixed on-device path chains every block into the next, a step's block too when
/// the step sits before it and fuses nothing (the step gathers the qkv rows the block before
/// computed, `select_top_k_gathering`); every pruner in both modes must still give the host
/// decisions' tokens and logits (EViT / ATS steps after attention, and adaptive modes, keep the
/// unchained path: the same check).
#[test]
fn one_image_device_decisions_equal_host_decisions() {
    let dev = Device::Cpu;
    for distilled in [false, true] {
        let cfg = small_cfg(distilled);
        let m = model(&cfg, DType::F32, &dev, 310 + distilled as u64);
        for seed in [3, 4] {
            let pixels = varied_pixels(1, &cfg, seed, &dev);
            let tag = format!("batch 1 distilled={distilled} seed {seed}");
            every_pruner_on_device(&tag, &m, &cfg, &pixels);
        }
    }
}

fn env_device() -> Device {
    match std::env::var("PATHS_DEVICE").as_deref() {
        Ok("cuda") => {
            Device::new_cuda(0).expect("PATHS_DEVICE=cuda needs the `cuda` feature and a GPU")
        }
        _ => Device::Cpu,
    }
}

/// DeiT-T/S/B with the default schedules (blocks 3/6/9, keep 0.7, default adaptive rules),
/// random weights: padded vs ragged for every pruner × mode × dtype (f32: same decisions but for
/// a near-tie ordered differently in a few images; f16 / bf16 and ATS: the padded run's decisions
/// replayed on the ragged path), and unpruned vs dense.
#[test]
#[ignore = "published sizes: slow on the CPU; run on the GPU with PATHS_DEVICE=cuda"]
fn published_sizes_padded_equals_ragged() {
    let dev = env_device();
    let names =
        std::env::var("PATHS_MODELS").unwrap_or_else(|_| "deit-tiny,deit-small,deit-base".into());
    let batch: usize = std::env::var("PATHS_BATCH")
        .ok()
        .and_then(|b| b.parse().ok())
        .unwrap_or(32);
    for name in names.split(',') {
        let cfg = DeiTConfig::from_name(name).unwrap();
        let weights = to_tensors(&random_timm_weights(&cfg, 1));
        let pixels = varied_pixels(batch, &cfg, 2, &dev);
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let m = Checkpoint::from_tensors(weights.clone())
                .unwrap()
                .load_model(&cfg, dtype, &dev)
                .unwrap();
            let want = dense(&m, &pixels);
            for path in [ExecutionPath::Padded, ExecutionPath::Ragged] {
                let got = logits(&m.forward_pruned(&pixels, &[], path).unwrap());
                assert_logits_agree(
                    &format!("{name} {dtype:?} {path} vs dense"),
                    &got,
                    &want,
                    tolerance(dtype, &want),
                );
            }
            for kind in PrunerKind::ALL {
                for mode in [Mode::Fixed, Mode::Adaptive] {
                    let what = format!("{name} {dtype:?} {kind}-{mode}");
                    let s = PruningSchedule::default_for(kind, mode, cfg.depth);
                    let pruners = build(&m, &s, &dev);
                    // ATS picks the token nearest to each sample point of a CDF: rounding-level
                    // differences between the paths move picks at this size even in f32, so its
                    // execution is compared with replayed plans (as in half precision).
                    if dtype == DType::F32 && kind != PrunerKind::Ats {
                        let o = check_padded_vs_ragged_allowing_near_ties(
                            &what,
                            &m,
                            &pixels,
                            &pruners,
                            || build(&m, &s, &dev),
                        );
                        eprintln!(
                            "{what}: max |Δlogit| {:.2e}, mean final tokens {:.1}",
                            o.max_diff,
                            o.ragged.mean_final_tokens()
                        );
                        let d = check_on_device(&what, &m, &pixels, &pruners, &o.ragged);
                        eprintln!("{what}: device decisions (and, fixed, CUDA graph replay) vs host: max |Δlogit| {d:.2e}");
                    } else {
                        if dtype == DType::F32 {
                            // ATS on the device: informational, as padded vs ragged above.
                            let host = m
                                .forward_pruned(&pixels, &pruners, ExecutionPath::Ragged)
                                .unwrap();
                            let device = m.forward_pruned_on_device(&pixels, &pruners).unwrap();
                            let want = host.kept_tokens();
                            let differ = (0..batch)
                                .filter(|&i| {
                                    want.iter()
                                        .zip(&device.kept_tokens)
                                        .any(|(a, b)| a[i] != b[i])
                                })
                                .count();
                            eprintln!(
                                "{what}: device vs host decisions, {differ}/{batch} images keep \
                                 different counts"
                            );
                        }
                        let differ = images_deciding_differently(&m, &pixels, &pruners);
                        let d = check_with_replayed_plans(&what, &m, &pixels, pruners);
                        eprintln!(
                            "{what}: {differ}/{batch} images decide differently on their own; \
                             with replayed plans max |Δlogit| {d:.2e}"
                        );
                    }
                }
            }
        }
    }
}

/// The two-stage split refuses what it cannot continue: a schedule without a pruning step, and
/// tokens from a step the schedule does not start with.
#[test]
fn two_stage_split_errors() {
    let dev = Device::Cpu;
    let cfg = small_cfg(false);
    let m = model(&cfg, DType::F32, &dev, 41);
    let pixels = varied_pixels(3, &cfg, 4, &dev);
    let e = m.forward_to_first_step(&pixels, &[]).unwrap_err();
    assert!(e.to_string().contains("no pruning step"), "{e}");
    // Threshold-L2 adaptive at `blocks`.
    let tl2 = |blocks: &[usize]| {
        let s = schedule(blocks, |st| {
            small_config(
                PrunerKind::ThresholdL2,
                Mode::Adaptive,
                st,
                cfg.num_patches(),
            )
        });
        build(&m, &s, &dev)
    };
    let pruners = tl2(&BLOCKS);
    let step = m.forward_to_first_step(&pixels, &pruners).unwrap();
    let later = tl2(&BLOCKS[1..]);
    let e = m.forward_from_step(&step, &later).unwrap_err();
    assert!(
        e.to_string().contains("which the schedule does not have"),
        "{e}"
    );
}

/// `Block::forward_chained`'s contract, on the CPU where every step is the plain two-step
/// arithmetic: a block given the next one returns its own output unchanged and the next block's
/// qkv of it (`norm_linear(norm1, qkv)`), and the next block given that qkv returns what it
/// returns computing its own; without a next block there is no qkv.
#[test]
fn chained_blocks_hand_on_the_next_qkv() {
    let cfg = small_cfg(false);
    let dev = Device::Cpu;
    let m = model(&cfg, DType::F32, &dev, 71);
    let x = m.embed(&varied_pixels(3, &cfg, 72, &dev)).unwrap();
    let (b, n, c) = x.dims3().unwrap();
    let mut x = x.reshape((b * n, c)).unwrap();
    let batch = m.uniform_batches.get(b, n, &dev).unwrap();
    let inputs = models::AttentionInputs::Ragged { batch: &batch };
    let mut handed = None;
    for (i, block) in m.blocks.iter().enumerate() {
        let next = m.blocks.get(i + 1);
        let plain = block.forward_with(&x, &inputs).unwrap();
        let (y, qkv) = block
            .forward_chained(&x, handed.take(), next, &inputs)
            .unwrap();
        assert_eq!(
            max_abs(&y, &plain),
            0.0,
            "block {i}: output changed by chaining"
        );
        match (next, &qkv) {
            (Some(next), Some(qkv)) => {
                let own =
                    candle_fastpath::norm_linear(&y, &next.norm1, &next.attn.qkv, false).unwrap();
                assert_eq!(max_abs(qkv, &own), 0.0, "block {i}: handed-on qkv differs");
            }
            (None, None) => {}
            (next, qkv) => panic!(
                "block {i}: next block {} but qkv {}",
                next.is_some(),
                qkv.is_some()
            ),
        }
        handed = qkv;
        x = y;
    }
}

/// The prefix-only last block ([`models::Block::forward_prefix`], taken by the dense forward and
/// the on-device pruned forwards for batches of more than one image) gives the prefix rows every
/// row's computation gives: class token, and the distillation token of a distilled model.
#[test]
fn prefix_only_last_block_equals_the_full_rows() {
    let dev = Device::Cpu;
    for distilled in [false, true] {
        let cfg = small_cfg(distilled);
        let m = model(&cfg, DType::F32, &dev, 73);
        let p = cfg.num_prefix_tokens();
        let x = m.embed(&varied_pixels(3, &cfg, 74, &dev)).unwrap();
        assert!(models::deit::last_block_prefix_only(3));
        let prefix = m.prefix_after_blocks(&x).unwrap();
        let full = m.blocks_on_tokens(&x).unwrap().narrow(1, 0, p).unwrap();
        assert_eq!(prefix.dims(), full.dims());
        let d = max_abs(&prefix, &full);
        assert!(
            d <= 1e-5,
            "distilled {distilled}: prefix rows differ by {d}"
        );
        // And the logits through the dense forward (Module::forward takes this path).
        let logits = candle_core::Module::forward(&m, &varied_pixels(3, &cfg, 74, &dev)).unwrap();
        let want = m
            .logits_from_blocks(&m.blocks_on_tokens(&x).unwrap())
            .unwrap();
        let d = max_abs(&logits, &want);
        assert!(d <= 1e-5, "distilled {distilled}: logits differ by {d}");
    }
}

/// One-image forwards replayed from CUDA graphs agree with the padded path (f16 and bf16, DeiT-T
/// and its distilled variant by default; `GRAPHS_MODELS` names others). Inside a capture a batch-1 DeiT-T runs its chained kernels
/// (candle_fastpath::attention_block and the kernels around it, levers 58–66), which eager
/// forwards never take (each block is then one small_block launch) and the other GPU tests check
/// kernel by kernel only: this is their check through the model (which qkv goes to which block,
/// the gathered rows at a fixed step). `CapturedForward` runs the forward once outside the capture
/// first; the replays below are the captured one. Pruned graphs (Threshold-L2, EViT and
/// DynamicViT fixed: device decisions) are held to the same tolerance; their decisions come from
/// the graph's own tokens, so a near-tie decided the other way would show here as a logit
/// difference.
#[test]
#[ignore = "CUDA graphs: run on the GPU with PATHS_DEVICE=cuda"]
fn one_image_graphs_agree_with_the_padded_path() {
    let dev = env_device();
    // GRAPHS_MODELS (comma-separated) picks other models, e.g. deit-small where the thin GEMM
    // (lever 100) runs inside the captured forward.
    let models = std::env::var("GRAPHS_MODELS")
        .unwrap_or_else(|_| "deit-tiny,deit-tiny-distilled".to_string());
    for name in models.split(',') {
        let cfg = DeiTConfig::from_name(name).unwrap();
        let weights = to_tensors(&random_timm_weights(&cfg, 91));
        let pixels = varied_pixels(1, &cfg, 92, &dev);
        for dtype in [DType::F16, DType::BF16] {
            let m = Checkpoint::from_tensors(weights.clone())
                .unwrap()
                .load_model(&cfg, dtype, &dev)
                .unwrap();
            let replayed = |graph: &candle_fastpath::CapturedForward| {
                // Another input first, so leftover buffers cannot make the replay pass.
                graph.run(&(&pixels * 0.5).unwrap()).unwrap();
                f32_rows(&graph.run(&pixels).unwrap())
            };
            let want = logits(
                &m.forward_pruned(&pixels, &[], ExecutionPath::Padded)
                    .unwrap(),
            );
            let dense = candle_fastpath::CapturedForward::capture(&pixels, |p| {
                candle_core::Module::forward(&m, p)
            })
            .unwrap();
            let what = format!("{name} {dtype:?} dense graph");
            let d = assert_logits_agree(&what, &replayed(&dense), &want, tolerance(dtype, &want));
            eprintln!("{what} vs padded: max |Δlogit| {d:.2e}");
            if cfg.distilled {
                continue;
            }
            for kind in [
                PrunerKind::ThresholdL2,
                PrunerKind::Evit,
                PrunerKind::DynamicVit,
            ] {
                let s = PruningSchedule::default_for(kind, Mode::Fixed, cfg.depth);
                let pruners = build(&m, &s, &dev);
                let want = logits(
                    &m.forward_pruned(&pixels, &pruners, ExecutionPath::Padded)
                        .unwrap(),
                );
                let graph = candle_fastpath::CapturedForward::capture(&pixels, |p| {
                    m.forward_pruned_on_device(p, &pruners)
                        .map(|f| f.logits)
                        .map_err(candle_core::Error::wrap)
                })
                .unwrap();
                let what = format!("{name} {dtype:?} {kind}-fixed graph");
                let d =
                    assert_logits_agree(&what, &replayed(&graph), &want, tolerance(dtype, &want));
                eprintln!("{what} vs padded: max |Δlogit| {d:.2e}");
            }
        }
    }
}

/// The embedding into block 0 ([`DeiT::embed_into_first_block`], lever 67) gives what
/// [`DeiT::embed`] and block 0's `norm_linear(norm1, qkv)` give. On the CPU (CI) the kernel never
/// applies: the tokens are `embed`'s, bit for bit, and no qkv comes back. On CUDA
/// (`PATHS_DEVICE=cuda`), DeiT-T and DeiT-T distilled in f16 and bf16: outside a graph block 0
/// runs as one launch (candle_fastpath::small_block) and computes its own qkv, so the fused form
/// is asked for inside a captured graph (`CapturedForward` calls the closure once outside the
/// capture first, where the unfused qkv stands in); the captured graph must hold two kernels
/// fewer than the same closure over `embed` + `norm_linear`, and its replays agree with those
/// within a rounding or two. Whole one-image forwards on it: `one_image_graphs_agree_with_the_padded_path`.
#[test]
fn embedding_into_the_first_block() {
    let dev = env_device();
    for name in ["deit-tiny", "deit-tiny-distilled"] {
        let cfg = DeiTConfig::from_name(name).unwrap();
        let weights = to_tensors(&random_timm_weights(&cfg, 81));
        let pixels = varied_pixels(1, &cfg, 82, &dev);
        if !dev.is_cuda() {
            let m = Checkpoint::from_tensors(weights)
                .unwrap()
                .load_model(&cfg, DType::F32, &dev)
                .unwrap();
            let (x, qkv) = m.embed_into_first_block(&pixels).unwrap();
            assert!(qkv.is_none(), "the fused embedding ran on the CPU");
            assert_eq!(max_abs(&x, &m.embed(&pixels).unwrap()), 0.0);
            continue;
        }
        for dtype in [DType::F16, DType::BF16] {
            let m = Checkpoint::from_tensors(weights.clone())
                .unwrap()
                .load_model(&cfg, dtype, &dev)
                .unwrap();
            let block = &m.blocks[0];
            let (n, c) = (cfg.seq_len(), cfg.dim);
            let unfused_qkv = |x: &Tensor| {
                candle_fastpath::norm_linear(x, &block.norm1, &block.attn.qkv, false)
                    .map_err(candle_core::Error::wrap)
            };
            // Tokens and qkv side by side in one output, so one graph returns both.
            let both = |x: Tensor, qkv: Tensor| {
                Tensor::cat(&[x.reshape((n, c))?, qkv.reshape((n, 3 * c))?], 1)
            };
            let fused = candle_fastpath::CapturedForward::capture(&pixels, |p| {
                let (x, qkv) = m.embed_into_first_block(p)?;
                let qkv = match qkv {
                    Some(qkv) => qkv,
                    None => unfused_qkv(&x)?,
                };
                both(x, qkv)
            })
            .unwrap();
            let unfused = candle_fastpath::CapturedForward::capture(&pixels, |p| {
                let x = m.embed(p)?;
                let qkv = unfused_qkv(&x)?;
                both(x, qkv)
            })
            .unwrap();
            let (kf, ku) = (
                fused.nodes().unwrap().kernels,
                unfused.nodes().unwrap().kernels,
            );
            // Patch GEMM, embed_tokens and norm_linear against one kernel.
            assert_eq!(
                kf + 2,
                ku,
                "{name} {dtype:?}: the captured embedding did not take the fused kernel"
            );
            // Another input first, so leftover buffers cannot make the replay pass.
            fused.run(&(&pixels * 0.5).unwrap()).unwrap();
            let got = fused.run(&pixels).unwrap();
            let want = unfused.run(&pixels).unwrap();
            let dx = max_abs(
                &got.narrow(1, 0, c).unwrap(),
                &want.narrow(1, 0, c).unwrap(),
            );
            let dq = max_abs(
                &got.narrow(1, c, 3 * c).unwrap(),
                &want.narrow(1, c, 3 * c).unwrap(),
            );
            eprintln!("{name} {dtype:?}: fused embedding vs embed: tokens {dx:.2e}, qkv {dq:.2e}");
            // The prefix rows round twice where `embed` rounds once, and the GEMMs sum in another
            // order: two units in the last place of the largest token, four of the largest qkv
            // value (after the LayerNorm and a GEMM over those tokens).
            let ulp = if dtype == DType::F16 {
                2f32.powi(-10)
            } else {
                2f32.powi(-7)
            };
            let largest = |t: &Tensor| max_abs(t, &t.zeros_like().unwrap());
            let tx = 2.0 * ulp * largest(&want.narrow(1, 0, c).unwrap());
            let tq = 4.0 * ulp * largest(&want.narrow(1, c, 3 * c).unwrap());
            assert!(dx <= tx, "{name} {dtype:?}: tokens differ by {dx}");
            assert!(dq <= tq, "{name} {dtype:?}: block 0's qkv differs by {dq}");
        }
    }
}
