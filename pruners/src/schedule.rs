//! Which blocks prune, with which pruner and settings; parsing from CLI strings.

use std::str::FromStr;

use candle_core::Device;
use candle_nn::VarBuilder;

use crate::ats::{Ats, AtsConfig};
use crate::dynamicvit::{DynamicVit, DynamicVitConfig};
use crate::error::{PruneError, Result};
use crate::evit::{Evit, EvitConfig};
use crate::threshold::{ThresholdL2, ThresholdL2Config};
use crate::{Mode, PrunerKind, TokenPruner};

/// The keep ratio of the papers' DeiT settings (DynamicViT ρ, EViT keep rate).
pub const DEFAULT_KEEP_RATIO: f64 = 0.7;
/// Default adaptive Threshold-L2 factor on the image's mean patch norm.
pub const DEFAULT_L2_RELATIVE_FACTOR: f32 = 1.0;
/// Default adaptive EViT attention-mass share.
pub const DEFAULT_EVIT_SHARE: f64 = 0.9;
/// Patch count of DeiT at 224 px (DynamicViT's `init_n`, ATS's `n_ref_tokens - 1`).
pub const DEIT_224_PATCHES: usize = 196;

/// A pruner's configuration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PrunerConfig {
    ThresholdL2(ThresholdL2Config),
    DynamicVit(DynamicVitConfig),
    Evit(EvitConfig),
    Ats(AtsConfig),
}

impl PrunerConfig {
    pub fn kind(&self) -> PrunerKind {
        match self {
            PrunerConfig::ThresholdL2(_) => PrunerKind::ThresholdL2,
            PrunerConfig::DynamicVit(_) => PrunerKind::DynamicVit,
            PrunerConfig::Evit(_) => PrunerKind::Evit,
            PrunerConfig::Ats(_) => PrunerKind::Ats,
        }
    }
}

/// One pruning site: the block index (0-based) and the pruner acting there.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScheduledPruner {
    pub block: usize,
    pub config: PrunerConfig,
}

/// A pruner name plus mode, as given on the command line: `"none"`, `"evit"`,
/// `"evit-adaptive"`, `"threshold-l2:fixed"`, `"dynamicvit adaptive"`, ...
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrunerSpec {
    /// `None` for `"none"`.
    pub kind: Option<PrunerKind>,
    pub mode: Mode,
}

const VALID: &str = "none, threshold-l2, dynamicvit, evit, ats (optionally followed by -fixed or -adaptive, e.g. evit-adaptive)";

impl FromStr for PrunerSpec {
    type Err = PruneError;
    fn from_str(s: &str) -> Result<Self> {
        let lower = s.trim().to_ascii_lowercase();
        let unknown = || PruneError::UnknownPruner {
            name: s.to_string(),
            valid: VALID.to_string(),
        };
        let mut name = lower.as_str();
        let mut mode = Mode::Fixed;
        for (suffix, m) in [("fixed", Mode::Fixed), ("adaptive", Mode::Adaptive)] {
            if let Some(rest) = name.strip_suffix(suffix) {
                let rest = rest.trim_end_matches(['-', '_', ':', '+', ' ', '/', '@']);
                if rest.len() < name.len() - suffix.len() {
                    name = rest;
                    mode = m;
                    break;
                }
            }
        }
        let kind = match name {
            "none" | "off" | "dense" => {
                if name.len() != lower.len() {
                    return Err(unknown());
                }
                None
            }
            "threshold-l2" | "threshold_l2" | "thresholdl2" | "l2" | "threshold" => {
                Some(PrunerKind::ThresholdL2)
            }
            "dynamicvit" | "dynamic-vit" | "dynamic_vit" | "dyvit" => Some(PrunerKind::DynamicVit),
            "evit" => Some(PrunerKind::Evit),
            "ats" => Some(PrunerKind::Ats),
            _ => return Err(unknown()),
        };
        Ok(PrunerSpec { kind, mode })
    }
}

impl FromStr for PrunerKind {
    type Err = PruneError;
    fn from_str(s: &str) -> Result<Self> {
        match s.parse::<PrunerSpec>()?.kind {
            Some(k) => Ok(k),
            None => Err(PruneError::UnknownPruner {
                name: s.to_string(),
                valid: "threshold-l2, dynamicvit, evit, ats".into(),
            }),
        }
    }
}

/// The pruning sites of a model.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PruningSchedule {
    /// Sorted by block.
    pub entries: Vec<ScheduledPruner>,
}

/// Blocks `depth/4, depth/2, 3·depth/4` (3, 6, 9 for depth 12), deduplicated, excluding 0.
pub fn default_blocks(depth: usize) -> Vec<usize> {
    let mut v: Vec<usize> = [depth / 4, depth / 2, 3 * depth / 4]
        .into_iter()
        .filter(|&b| b > 0 && b < depth)
        .collect();
    v.dedup();
    v
}

impl PruningSchedule {
    /// No pruning.
    pub fn none() -> Self {
        Self::default()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The papers' DeiT setting: blocks 3, 6, 9 (for depth 12; `depth/4, depth/2, 3depth/4`
    /// otherwise) with keep ratio 0.7.
    /// - Threshold-L2: fixed keeps `ceil(0.7·n)` of the current patches at each site;
    ///   adaptive keeps norms ≥ 1.0 × the image's mean patch norm.
    /// - DynamicViT: fixed keeps `floor(0.7^s · 196)` (137, 96, 67); adaptive keeps p(keep) > 0.5.
    /// - EViT: fixed keeps `ceil(0.7·n)` of the current patches (+ fused token); adaptive keeps
    ///   90 % of the class-attention mass.
    /// - ATS: fixed samples `K = ceil(0.7·n)` points; adaptive samples `K = 196` points.
    pub fn default_for(kind: PrunerKind, mode: Mode, depth: usize) -> Self {
        let r = DEFAULT_KEEP_RATIO;
        let entries = default_blocks(depth)
            .into_iter()
            .enumerate()
            .map(|(stage, block)| {
                let config = match (kind, mode) {
                    (PrunerKind::ThresholdL2, Mode::Fixed) => {
                        PrunerConfig::ThresholdL2(ThresholdL2Config::fixed(r))
                    }
                    (PrunerKind::ThresholdL2, Mode::Adaptive) => PrunerConfig::ThresholdL2(
                        ThresholdL2Config::relative(DEFAULT_L2_RELATIVE_FACTOR),
                    ),
                    (PrunerKind::DynamicVit, Mode::Fixed) => PrunerConfig::DynamicVit(
                        DynamicVitConfig::fixed(stage, r, DEIT_224_PATCHES),
                    ),
                    (PrunerKind::DynamicVit, Mode::Adaptive) => PrunerConfig::DynamicVit(
                        DynamicVitConfig::adaptive(stage, DEIT_224_PATCHES),
                    ),
                    (PrunerKind::Evit, Mode::Fixed) => PrunerConfig::Evit(EvitConfig::fixed(r)),
                    (PrunerKind::Evit, Mode::Adaptive) => {
                        PrunerConfig::Evit(EvitConfig::adaptive(DEFAULT_EVIT_SHARE))
                    }
                    (PrunerKind::Ats, Mode::Fixed) => PrunerConfig::Ats(AtsConfig::fixed(r)),
                    (PrunerKind::Ats, Mode::Adaptive) => {
                        PrunerConfig::Ats(AtsConfig::adaptive(DEIT_224_PATCHES))
                    }
                };
                ScheduledPruner { block, config }
            })
            .collect();
        Self { entries }
    }

    /// Parses a CLI string (see [`PrunerSpec`]) into the default schedule for `depth`.
    pub fn parse(s: &str, depth: usize) -> Result<Self> {
        let spec: PrunerSpec = s.parse()?;
        Ok(match spec.kind {
            None => Self::none(),
            Some(kind) => Self::default_for(kind, spec.mode, depth),
        })
    }

    /// The pruner acting at `block`, if any.
    pub fn at(&self, block: usize) -> Option<&ScheduledPruner> {
        self.entries.iter().find(|e| e.block == block)
    }

    /// Builds the pruners. DynamicViT predictors load from `weights` (a `VarBuilder` at the
    /// DynamicViT checkpoint root) when given, and are randomly initialised otherwise (check
    /// [`TokenPruner::weights_source`]). Errors on a block `>= depth` or a duplicate block.
    pub fn build(
        &self,
        depth: usize,
        embed_dim: usize,
        weights: Option<&VarBuilder>,
        device: &Device,
    ) -> Result<Vec<(usize, Box<dyn TokenPruner>)>> {
        let mut out: Vec<(usize, Box<dyn TokenPruner>)> = Vec::with_capacity(self.entries.len());
        for e in &self.entries {
            if e.block >= depth {
                return Err(PruneError::InvalidConfig(format!(
                    "pruning at block {} but the model has {depth} blocks",
                    e.block
                )));
            }
            if out.iter().any(|(b, _)| *b == e.block) {
                return Err(PruneError::InvalidConfig(format!(
                    "two pruners at block {}",
                    e.block
                )));
            }
            let p: Box<dyn TokenPruner> = match e.config {
                PrunerConfig::ThresholdL2(c) => Box::new(ThresholdL2::new(c)?),
                PrunerConfig::Evit(c) => Box::new(Evit::new(c)?),
                PrunerConfig::Ats(c) => Box::new(Ats::new(c)?),
                PrunerConfig::DynamicVit(c) => Box::new(match weights {
                    Some(vb) => DynamicVit::load(c, embed_dim, vb)?,
                    None => DynamicVit::random_init(c, embed_dim, device)?,
                }),
            };
            out.push((e.block, p));
        }
        out.sort_by_key(|(b, _)| *b);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_names_and_modes() {
        let s: PrunerSpec = "evit".parse().unwrap();
        assert_eq!(s.kind, Some(PrunerKind::Evit));
        assert_eq!(s.mode, Mode::Fixed);
        let s: PrunerSpec = "Threshold-L2-adaptive".parse().unwrap();
        assert_eq!(s.kind, Some(PrunerKind::ThresholdL2));
        assert_eq!(s.mode, Mode::Adaptive);
        let s: PrunerSpec = "dynamicvit:fixed".parse().unwrap();
        assert_eq!(s.kind, Some(PrunerKind::DynamicVit));
        let s: PrunerSpec = "ats adaptive".parse().unwrap();
        assert_eq!((s.kind, s.mode), (Some(PrunerKind::Ats), Mode::Adaptive));
        assert_eq!("none".parse::<PrunerSpec>().unwrap().kind, None);
    }

    #[test]
    fn parse_rejects_unknown_with_valid_list() {
        for bad in ["tome", "evitadaptive", "none-adaptive", "", "adaptive"] {
            match bad.parse::<PrunerSpec>() {
                Err(PruneError::UnknownPruner { name, valid }) => {
                    assert_eq!(name, bad);
                    for v in ["none", "threshold-l2", "dynamicvit", "evit", "ats"] {
                        assert!(valid.contains(v), "{valid}");
                    }
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
    }

    #[test]
    fn default_schedule_blocks_and_ratios() {
        let s = PruningSchedule::default_for(PrunerKind::DynamicVit, Mode::Fixed, 12);
        assert_eq!(
            s.entries.iter().map(|e| e.block).collect::<Vec<_>>(),
            vec![3, 6, 9]
        );
        let counts: Vec<usize> = s
            .entries
            .iter()
            .map(|e| match e.config {
                PrunerConfig::DynamicVit(c) => c.fixed_keep_count().unwrap(),
                _ => unreachable!(),
            })
            .collect();
        // int(196 * 0.7**s) in the reference
        assert_eq!(counts, vec![137, 96, 67]);
        assert!(PruningSchedule::parse("none", 12).unwrap().is_empty());
        let e = PruningSchedule::parse("evit", 12).unwrap();
        assert_eq!(e.entries.len(), 3);
        assert!(
            matches!(e.entries[0].config, PrunerConfig::Evit(c) if c == EvitConfig::fixed(0.7))
        );
    }

    #[test]
    fn build_checks_blocks() {
        let s = PruningSchedule::default_for(PrunerKind::Evit, Mode::Fixed, 12);
        assert!(s.build(12, 8, None, &Device::Cpu).is_ok());
        assert!(matches!(
            s.build(6, 8, None, &Device::Cpu),
            Err(PruneError::InvalidConfig(_))
        ));
    }
}
