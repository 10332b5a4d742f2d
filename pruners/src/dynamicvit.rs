//! DynamicViT (Rao et al., NeurIPS 2021): a learned keep/drop predictor before some blocks.
//!
//! Facts from the reference code (`raoyongming/DynamicViT`, `models/dyvit.py` and `vit.py`:
//! `PredictorLG`, `VisionTransformerDiffPruning.forward`; `main.py`) that this module follows:
//! - Predictor `PredictorLG`: `in_conv = [LayerNorm(C) (eps 1e-5, PyTorch default), Linear(C,C),
//!   GELU (exact erf)]`; split channels: `[:C//2]` local, `[C//2:]` pooled over tokens weighted by
//!   the current policy (`Σ x·policy / Σ policy`); concat → `out_conv = [Linear(C,C/2), GELU,
//!   Linear(C/2,C/4), GELU, Linear(C/4,2), LogSoftmax]`. Column 0 is the **keep** log-prob.
//! - It runs on the patch tokens only (`x[:, 1:]`); at inference the policy is all-ones over the
//!   tokens that remain, so the pooled half is the mean over the image's current patch tokens.
//!   Here: over the valid patch tokens (prefix and padding excluded).
//! - Placement: `pruning_loc = [3, 6, 9]` for DeiT, *before* the block (`x = batch_index_select
//!   (x, now_policy); x = blk(x)`): [`PruneSite::BeforeBlock`].
//! - Keep counts: `token_ratio = [ρ, ρ², ρ³]` of the **original** patch count
//!   (`init_n = 14 * 14`), `num_keep_node = int(init_n * token_ratio[s])` — Python `int()`
//!   truncates, so ρ = 0.7 keeps 137, 96, 67 (not ceil: 138, 97, 68). This module does the same
//!   (floor, in f64, clamped to `[1, current patch count]`).
//! - Selection: `argsort(keep_score, descending)[:k]`; the class token is always kept.
//! - Weights: `score_predictor.{s}.in_conv.0.{weight,bias}` (LayerNorm),
//!   `score_predictor.{s}.in_conv.1.*` (Linear C→C), `score_predictor.{s}.out_conv.{0,2,4}.*`
//!   (Linears C→C/2→C/4→2), `s` = 0, 1, 2 for the three pruning locations.
//!   Random init (no checkpoint) follows the reference `_init_weights`: Linear weights
//!   truncated-normal std 0.02, biases 0, LayerNorm weight 1 / bias 0 (seeded, deterministic).

use std::sync::OnceLock;

use candle_core::{DType, Device, Module, Tensor, D};
use candle_fastpath::{norm_linear, FusedLinear, LayerNorm, PooledMlpHead};
use candle_nn::VarBuilder;
use candle_ragged::{pack, RaggedBatch};

use crate::error::{PruneError, Result};
use crate::input::PruneInput;
use crate::{KeepCount, KeepRule, Mode, Needs, PruneSite, PrunerKind, TokenPruner};

/// Where the predictor's weights came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightsSource {
    /// Loaded from a DynamicViT checkpoint.
    Checkpoint,
    /// Randomly initialised: decisions are meaningless for accuracy (timing only).
    Random,
}

impl std::fmt::Display for WeightsSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WeightsSource::Checkpoint => "checkpoint",
            WeightsSource::Random => "random",
        })
    }
}

/// How DynamicViT decides.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DynamicVitMode {
    /// Keep the top `floor(keep_ratio · original_patches)` keep-probabilities (the paper's
    /// inference). `keep_ratio` is ρ^(s+1) of the original count for stage `s`.
    TopK { keep_ratio: f64 },
    /// Keep tokens whose keep-probability is `> threshold` (0.5: keep beats drop) (adaptive).
    Probability { threshold: f32 },
}

/// Configuration of one DynamicViT pruning location.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DynamicVitConfig {
    /// Index of the predictor (`score_predictor.{stage}`), 0 for the first pruning location.
    pub stage: usize,
    pub mode: DynamicVitMode,
    /// Patch count of the un-pruned image (196 for DeiT-224); fixed-mode counts refer to it.
    pub original_patches: usize,
    /// LayerNorm epsilon of the predictor (PyTorch default 1e-5 in the reference).
    pub layer_norm_eps: f64,
}

impl DynamicVitConfig {
    /// Fixed mode at `stage` with the reference keep ratio `rho^(stage+1)`.
    pub fn fixed(stage: usize, rho: f64, original_patches: usize) -> Self {
        Self {
            stage,
            mode: DynamicVitMode::TopK {
                keep_ratio: rho.powi(stage as i32 + 1),
            },
            original_patches,
            layer_norm_eps: 1e-5,
        }
    }
    /// Adaptive mode (keep-probability > 0.5) at `stage`.
    pub fn adaptive(stage: usize, original_patches: usize) -> Self {
        Self {
            stage,
            mode: DynamicVitMode::Probability { threshold: 0.5 },
            original_patches,
            layer_norm_eps: 1e-5,
        }
    }
    fn validate(&self) -> Result<()> {
        let ok = match self.mode {
            DynamicVitMode::TopK { keep_ratio } => keep_ratio > 0.0 && keep_ratio <= 1.0,
            DynamicVitMode::Probability { threshold } => (0.0..1.0).contains(&threshold),
        } && self.original_patches > 0;
        if ok {
            Ok(())
        } else {
            Err(PruneError::InvalidConfig(format!("dynamicvit: {self:?}")))
        }
    }
    /// Number of patch tokens the fixed mode keeps (before clamping to the current count).
    pub fn fixed_keep_count(&self) -> Option<usize> {
        match self.mode {
            DynamicVitMode::TopK { keep_ratio } => {
                Some(((self.original_patches as f64 * keep_ratio).floor() as usize).max(1))
            }
            DynamicVitMode::Probability { .. } => None,
        }
    }
}

/// DynamicViT's `PredictorLG`. As a candle [`Module`] it maps patch tokens `[B, P, C]` (all
/// valid) to log-probabilities `[B, P, 2]` (column 0: keep, column 1: drop).
///
/// It computes in the tokens' dtype, as the reference evaluates under
/// `torch.cuda.amp.autocast()`: for f16 / bf16 tokens the Linear layers and GELUs run in that
/// dtype (weights cast once, on first use), with the LayerNorm statistics, the pooled mean and
/// the log-softmax in f32; f32 tokens run everything in f32. (In f32 the predictor's matmuls
/// cost about as much as the blocks the pruning saves.)
#[derive(Debug, Clone)]
pub struct PredictorLG {
    /// The weights as loaded, in f32.
    f32: PredictorModules,
    /// The same weights in f16 and bf16, made on first use.
    half: [OnceLock<PredictorModules>; 2],
    embed_dim: usize,
}

/// The predictor's layers in one dtype.
#[derive(Debug, Clone)]
struct PredictorModules {
    norm: LayerNorm,
    // FusedLinear: on CUDA the bias and GELU ride in the matmul's epilogue (candle's Linear
    // would add two more passes over every token's features).
    in_linear: FusedLinear,
    out: [FusedLinear; 3],
    packed: PackedLayers,
}

/// The same weights arranged for packed tokens ([`PredictorLG::keep_log_probs_packed`]): `out_conv`
/// as one [`PooledMlpHead`] (the concatenation `[local, pooled]` never formed; on CUDA two kernels
/// for the three layers and the log-softmax).
#[derive(Debug, Clone)]
struct PackedLayers {
    head: PooledMlpHead,
}

impl PackedLayers {
    fn new(out: &[FusedLinear; 3]) -> Result<Self> {
        let bias = |l: &FusedLinear, name: &str| {
            l.bias()
                .cloned()
                .ok_or_else(|| PruneError::InvalidConfig(format!("dynamicvit: {name} has no bias")))
        };
        Ok(Self {
            head: PooledMlpHead::new(
                out[0].weight().clone(),
                bias(&out[0], "out_conv.0")?,
                out[1].weight().clone(),
                bias(&out[1], "out_conv.2")?,
                out[2].weight().clone(),
                bias(&out[2], "out_conv.4")?,
            )
            .map_err(candle_core::Error::from)?,
        })
    }
}

impl PredictorModules {
    fn to_dtype(&self, dtype: DType) -> Result<Self> {
        let fused = |e| candle_core::Error::from(e);
        let norm = LayerNorm::new(
            self.norm.weight().to_dtype(dtype)?,
            self.norm.bias().to_dtype(dtype)?,
            self.norm.eps(),
        )
        .map_err(fused)?;
        let linear = |l: &FusedLinear| -> Result<FusedLinear> {
            let bias = l.bias().map(|b| b.to_dtype(dtype)).transpose()?;
            Ok(FusedLinear::new(l.weight().to_dtype(dtype)?, bias).map_err(fused)?)
        };
        let out = [
            linear(&self.out[0])?,
            linear(&self.out[1])?,
            linear(&self.out[2])?,
        ];
        Ok(Self {
            norm,
            in_linear: linear(&self.in_linear)?,
            packed: PackedLayers::new(&out)?,
            out,
        })
    }
}

fn load_tensor(vb: &VarBuilder, name: &str, shape: &[usize]) -> Result<Tensor> {
    if !vb.contains_tensor(name) {
        let full = if vb.prefix().is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", vb.prefix())
        };
        return Err(PruneError::MissingWeight { name: full });
    }
    let t = vb.get_unchecked_dtype(name, DType::F32)?;
    if t.dims() != shape {
        return Err(PruneError::WeightShape {
            name: format!("{}.{name}", vb.prefix()),
            expected: shape.to_vec(),
            got: t.dims().to_vec(),
        });
    }
    Ok(t)
}

/// Deterministic truncated-normal samples (SplitMix64 + Box–Muller), truncated at ±2σ.
fn trunc_normal(n: usize, std: f64, seed: u64) -> Vec<f32> {
    let mut state = seed;
    let mut next = move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        ((z >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let (u1, u2) = (next(), next());
        let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
        if z.abs() <= 2.0 {
            out.push((z * std) as f32);
        }
    }
    out
}

impl PredictorLG {
    /// Tensor names (relative to `score_predictor.{s}`) and shapes for embedding width `c`.
    pub fn tensor_specs(c: usize) -> Vec<(&'static str, Vec<usize>)> {
        vec![
            ("in_conv.0.weight", vec![c]),
            ("in_conv.0.bias", vec![c]),
            ("in_conv.1.weight", vec![c, c]),
            ("in_conv.1.bias", vec![c]),
            ("out_conv.0.weight", vec![c / 2, c]),
            ("out_conv.0.bias", vec![c / 2]),
            ("out_conv.2.weight", vec![c / 4, c / 2]),
            ("out_conv.2.bias", vec![c / 4]),
            ("out_conv.4.weight", vec![2, c / 4]),
            ("out_conv.4.bias", vec![2]),
        ]
    }

    fn check_dim(c: usize) -> Result<()> {
        if c < 4 {
            return Err(PruneError::InvalidConfig(format!(
                "dynamicvit: embed_dim {c} too small (needs >= 4)"
            )));
        }
        Ok(())
    }

    fn from_tensors(mut t: Vec<Tensor>, c: usize, eps: f64) -> Result<Self> {
        // order of tensor_specs
        let mut take = || t.remove(0);
        let (w, b) = (take(), take());
        let norm = LayerNorm::new(w, b, eps).map_err(candle_core::Error::from)?;
        let mut linear = || -> Result<FusedLinear> {
            let (w, b) = (take(), take());
            Ok(FusedLinear::new(w, Some(b)).map_err(candle_core::Error::from)?)
        };
        let in_linear = linear()?;
        let out = [linear()?, linear()?, linear()?];
        Ok(Self {
            f32: PredictorModules {
                norm,
                in_linear,
                packed: PackedLayers::new(&out)?,
                out,
            },
            half: Default::default(),
            embed_dim: c,
        })
    }

    /// Loads from `vb` positioned at `score_predictor.{s}` (weights converted to f32).
    pub fn load(vb: &VarBuilder, embed_dim: usize, eps: f64) -> Result<Self> {
        Self::check_dim(embed_dim)?;
        let ts = Self::tensor_specs(embed_dim)
            .into_iter()
            .map(|(name, shape)| load_tensor(vb, name, &shape))
            .collect::<Result<Vec<_>>>()?;
        Self::from_tensors(ts, embed_dim, eps)
    }

    /// Reference-style random init, deterministic for a given `seed`.
    pub fn random(embed_dim: usize, eps: f64, seed: u64, device: &Device) -> Result<Self> {
        Self::check_dim(embed_dim)?;
        let ts = Self::tensor_specs(embed_dim)
            .into_iter()
            .enumerate()
            .map(|(i, (name, shape))| {
                let n: usize = shape.iter().product();
                let data = if name == "in_conv.0.weight" {
                    vec![1f32; n]
                } else if name.ends_with("bias") {
                    vec![0f32; n]
                } else {
                    trunc_normal(n, 0.02, seed.wrapping_mul(31).wrapping_add(i as u64))
                };
                Ok(Tensor::from_vec(data, shape, device)?)
            })
            .collect::<Result<Vec<_>>>()?;
        Self::from_tensors(ts, embed_dim, eps)
    }

    /// Embedding width `C`.
    pub fn embed_dim(&self) -> usize {
        self.embed_dim
    }

    /// Log-probabilities `[B, P, 2]` for patch tokens `[B, P, C]` of which the first
    /// `valid[b]` rows of image `b` are real (`None`: all). Padding does not enter the pooled
    /// half and gets garbage log-probs.
    pub fn forward_masked(&self, x: &Tensor, valid: Option<&[usize]>) -> Result<Tensor> {
        let (b, p, c) = x.dims3()?;
        if c != self.embed_dim {
            return Err(PruneError::Shape {
                what: "tokens (dynamicvit predictor)",
                expected: format!("[B, N, {}]", self.embed_dim),
                got: x.dims().to_vec(),
            });
        }
        let (dtype, m) = self.modules(x.dtype())?;
        // Contiguous: candle's CUDA matmul refuses strided inputs (the tokens often arrive as a
        // narrowed or transposed view), while its CPU matmul silently accepts them.
        let x = x.to_dtype(dtype)?.contiguous()?;
        let h = m
            .in_linear
            .forward_gelu(&m.norm.forward(&x)?)
            .map_err(candle_core::Error::from)?;
        let half = c / 2;
        let local = h.narrow(D::Minus1, 0, half)?;
        // The pooled mean in f32 (autocast's mean accumulates in f32 too).
        let glob = h.narrow(D::Minus1, half, c - half)?.to_dtype(DType::F32)?;
        let pooled = match valid {
            None => glob.mean_keepdim(1)?,
            Some(valid) => {
                let mut m = vec![0u8; b * p];
                let mut inv = vec![0f32; b];
                for (i, &v) in valid.iter().enumerate() {
                    m[i * p..i * p + v].fill(1);
                    inv[i] = 1.0 / v as f32;
                }
                let m = Tensor::from_vec(m, (b, p, 1), x.device())?.broadcast_as(glob.shape())?;
                let masked = m.where_cond(&glob, &glob.zeros_like()?)?;
                let inv = Tensor::from_vec(inv, (b, 1, 1), x.device())?;
                masked.sum_keepdim(1)?.broadcast_mul(&inv)?
            }
        };
        let pooled = pooled.to_dtype(dtype)?;
        // candle's cat along the last dim can return a strided tensor: make it contiguous for
        // the CUDA matmul below.
        let feats = Tensor::cat(&[local, pooled.broadcast_as((b, p, c - half))?], D::Minus1)?
            .contiguous()?;
        let fused = |e| candle_core::Error::from(e);
        let mut y = m.out[0].forward_gelu(&feats).map_err(fused)?;
        y = m.out[1].forward_gelu(&y).map_err(fused)?;
        y = m.out[2].forward(&y)?.to_dtype(DType::F32)?;
        Ok(candle_nn::ops::log_softmax(&y, D::Minus1)?)
    }

    /// The keep log-probability (`log_softmax(..)[0]`, f32) of every row of packed tokens `x`
    /// `[total, C]` laid out as `batch`, whose sequences start with `num_prefix` class /
    /// distillation rows. The predictor runs on every row (the prefix rows' values are
    /// meaningless: a rule never reads them) and pools each image's mean over its patch rows
    /// only, as [`Self::forward_masked`] does over valid patch tokens; same precision policy.
    ///
    /// Built for the packed path: no concatenation, no image-shaped copy, no host work. On CUDA
    /// at DeiT's widths, f16 / bf16: LayerNorm → `in_conv` → GELU ([`norm_linear`]: one kernel
    /// at DeiT-T's width and small batches, else LayerNorm and matmul + GELU), then `out_conv`
    /// and the log-softmax as [`PooledMlpHead`]'s two kernels (the pooled mean with its
    /// per-image product, then the rows through the three layers); elsewhere the composed ops
    /// ([`PooledMlpHead::forward_composed`]). The values equal [`Self::forward_masked`]'s up to
    /// the dtype's rounding (the pooled half's product is rounded once more, on its own).
    pub fn keep_log_probs_packed(
        &self,
        x: &Tensor,
        batch: &RaggedBatch,
        num_prefix: usize,
    ) -> Result<Tensor> {
        let (rows, c) = x.dims2().map_err(|_| PruneError::Shape {
            what: "packed tokens (dynamicvit predictor)",
            expected: format!("[total, {}]", self.embed_dim),
            got: x.dims().to_vec(),
        })?;
        if c != self.embed_dim || rows != batch.total_tokens() {
            return Err(PruneError::Shape {
                what: "packed tokens (dynamicvit predictor)",
                expected: format!("[{}, {}]", batch.total_tokens(), self.embed_dim),
                got: x.dims().to_vec(),
            });
        }
        let fused = |e| candle_core::Error::from(e);
        let (dtype, m) = self.modules(x.dtype())?;
        let x = x.to_dtype(dtype)?;
        // LayerNorm → in_conv → GELU: one kernel where norm_linear's fused kernel applies
        // (DeiT-T's width at small batches), else the two steps.
        let h = norm_linear(&x, &m.norm, &m.in_linear, true).map_err(fused)?;
        Ok(m.packed
            .head
            .forward(&h, batch, num_prefix, 0)
            .map_err(fused)?)
    }

    /// The compute dtype for tokens of `dtype` (f16 and bf16 as themselves, anything else f32)
    /// and the layers in it.
    fn modules(&self, dtype: DType) -> Result<(DType, &PredictorModules)> {
        let slot = match dtype {
            DType::F16 => &self.half[0],
            DType::BF16 => &self.half[1],
            _ => return Ok((DType::F32, &self.f32)),
        };
        if slot.get().is_none() {
            // Two threads racing here both cast; one result is kept.
            let _ = slot.set(self.f32.to_dtype(dtype)?);
        }
        let m = slot
            .get()
            .ok_or_else(|| candle_core::Error::Msg("predictor weights not cast".into()))?;
        Ok((dtype, m))
    }
}

impl Module for PredictorLG {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_masked(xs, None).map_err(|e| match e {
            PruneError::Candle(e) => e,
            other => candle_core::Error::Msg(other.to_string()),
        })
    }
}

/// One DynamicViT pruning location: its predictor and its keep rule.
#[derive(Debug, Clone)]
pub struct DynamicVit {
    config: DynamicVitConfig,
    predictor: PredictorLG,
    source: WeightsSource,
}

impl DynamicVit {
    /// Loads `score_predictor.{stage}.*` from `vb` (positioned at the checkpoint root).
    pub fn load(config: DynamicVitConfig, embed_dim: usize, vb: &VarBuilder) -> Result<Self> {
        config.validate()?;
        let vb = vb.pp("score_predictor").pp(config.stage);
        let predictor = PredictorLG::load(&vb, embed_dim, config.layer_norm_eps)?;
        Ok(Self {
            config,
            predictor,
            source: WeightsSource::Checkpoint,
        })
    }

    /// Randomly initialised predictor (deterministic; seed derived from the stage).
    /// [`Self::weights_source`] reports [`WeightsSource::Random`].
    pub fn random_init(
        config: DynamicVitConfig,
        embed_dim: usize,
        device: &Device,
    ) -> Result<Self> {
        config.validate()?;
        let predictor = PredictorLG::random(
            embed_dim,
            config.layer_norm_eps,
            0xD1_7A_u64 + config.stage as u64,
            device,
        )?;
        Ok(Self {
            config,
            predictor,
            source: WeightsSource::Random,
        })
    }

    /// Uses an already built predictor (e.g. hand-set weights).
    pub fn from_predictor(config: DynamicVitConfig, predictor: PredictorLG) -> Result<Self> {
        config.validate()?;
        Ok(Self {
            config,
            predictor,
            source: WeightsSource::Checkpoint,
        })
    }

    pub fn weights_source(&self) -> WeightsSource {
        self.source
    }
    pub fn config(&self) -> &DynamicVitConfig {
        &self.config
    }
    pub fn predictor(&self) -> &PredictorLG {
        &self.predictor
    }

    /// Full checkpoint names of the tensors this location reads.
    pub fn tensor_names(stage: usize, embed_dim: usize) -> Vec<(String, Vec<usize>)> {
        PredictorLG::tensor_specs(embed_dim)
            .into_iter()
            .map(|(n, s)| (format!("score_predictor.{stage}.{n}"), s))
            .collect()
    }

    /// Keep log-probabilities `[total]` of packed tokens (see
    /// [`PredictorLG::keep_log_probs_packed`]), after checking that every image has a patch.
    fn packed_log_probs(
        &self,
        tokens: &Tensor,
        batch: &RaggedBatch,
        num_prefix: usize,
    ) -> Result<Tensor> {
        // Not read back for a batch whose lengths live on the device (a host sync).
        if let Some((index, len)) = batch.first_sequence_at_most(num_prefix) {
            return Err(PruneError::InvalidInput(format!(
                "dynamicvit: image {index} has {len} tokens, no patch after its {num_prefix} \
                 prefix tokens"
            )));
        }
        self.predictor
            .keep_log_probs_packed(tokens, batch, num_prefix)
    }

    /// Keep/drop log-probabilities `[B, N - num_prefix, 2]` of the patch positions.
    pub fn log_probs(&self, input: &PruneInput) -> Result<Tensor> {
        let g = input.validate()?;
        let p = g.num_prefix;
        let patches = input.tokens.narrow(1, p, g.tokens - p)?;
        let valid: Vec<usize> = (0..g.batch).map(|b| g.patch_count(b)).collect();
        let all_full = valid.iter().all(|&v| v == g.tokens - p);
        self.predictor
            .forward_masked(&patches, (!all_full).then_some(valid.as_slice()))
    }
}

impl TokenPruner for DynamicVit {
    fn kind(&self) -> PrunerKind {
        PrunerKind::DynamicVit
    }
    fn mode(&self) -> Mode {
        match self.config.mode {
            DynamicVitMode::TopK { .. } => Mode::Fixed,
            DynamicVitMode::Probability { .. } => Mode::Adaptive,
        }
    }
    fn site(&self) -> PruneSite {
        PruneSite::BeforeBlock
    }
    fn needs(&self) -> Needs {
        Needs::default()
    }
    fn weights_source(&self) -> Option<WeightsSource> {
        Some(self.source)
    }

    /// `[B, N]` f32 keep log-probability; prefix positions hold 0 (= log 1), padding 0. Computed
    /// by [`PredictorLG::keep_log_probs_packed`] over the valid tokens packed, so that a model's
    /// packed path ([`TokenPruner::packed_scores`]) sees bit-identical scores.
    fn scores(&self, input: &PruneInput) -> Result<Tensor> {
        let g = input.validate()?;
        let batch = RaggedBatch::from_lengths(&g.lengths, input.tokens.device())?;
        let packed = pack(input.tokens, &batch)?;
        let keep = self.packed_log_probs(&packed, &batch, g.num_prefix)?;
        let image = candle_ragged::unpack(&keep.unsqueeze(1)?, &batch, g.tokens)?.squeeze(2)?;
        let p = g.num_prefix;
        let prefix = Tensor::zeros((g.batch, p), DType::F32, image.device())?;
        Ok(Tensor::cat(
            &[prefix, image.narrow(1, p, g.tokens - p)?],
            1,
        )?)
    }

    fn packed_scores(
        &self,
        tokens: &Tensor,
        batch: &RaggedBatch,
        num_prefix: usize,
    ) -> Result<Option<Tensor>> {
        self.packed_log_probs(tokens, batch, num_prefix).map(Some)
    }

    fn keep_rule(&self) -> Option<KeepRule> {
        Some(match self.config.mode {
            DynamicVitMode::TopK { .. } => KeepRule::Top(KeepCount::Exactly(
                self.config.fixed_keep_count().unwrap_or(1),
            )),
            // Scores are log-probabilities: p > threshold is log p > ln(threshold).
            DynamicVitMode::Probability { threshold } => KeepRule::Above(threshold.ln()),
        })
    }
}
