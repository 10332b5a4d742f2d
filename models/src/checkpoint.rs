//! Reading DeiT checkpoints in the three namings found on the Hub, validating them against a
//! config, and turning them into timm-named weights for [`crate::DeiT::new`].
//!
//! Validation happens on the checkpoint's full tensor list *before* any module is built, so a
//! missing, extra or mis-shaped tensor is reported by name with both shapes, instead of
//! surfacing as a candle shape error deep in a forward pass (or, for extra tensors, not at all).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;

use crate::config::DeiTConfig;
use crate::deit::DeiT;
use crate::error::ModelError;

/// Which naming scheme a checkpoint uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightNaming {
    /// timm `VisionTransformer` / `VisionTransformerDistilled` (`cls_token`, `blocks.{i}.attn.qkv`).
    Timm,
    /// transformers `ViTForImageClassification` (`vit.` prefix, separate query/key/value,
    /// `classifier`): the `facebook/deit-*-patch16-224` repos.
    HfVit,
    /// transformers `DeiTForImageClassificationWithTeacher` (`deit.` prefix, `distillation_token`,
    /// `cls_classifier` + `distillation_classifier`): the `facebook/deit-*-distilled-*` repos.
    HfDeit,
}

impl WeightNaming {
    /// Detects the naming from the tensor names (by the class token's name).
    pub fn detect<'a>(mut names: impl Iterator<Item = &'a str>) -> Result<Self, ModelError> {
        names
            .find_map(|n| match n {
                "cls_token" => Some(Self::Timm),
                "vit.embeddings.cls_token" => Some(Self::HfVit),
                "deit.embeddings.cls_token" => Some(Self::HfDeit),
                _ => None,
            })
            .ok_or(ModelError::UnknownNaming)
    }

    fn hf_prefix(self) -> &'static str {
        match self {
            Self::Timm => "",
            Self::HfVit => "vit",
            Self::HfDeit => "deit",
        }
    }
}

/// Where a timm-named tensor comes from in a checkpoint.
#[derive(Debug, Clone)]
enum Source {
    One(String),
    /// timm's fused qkv = concat(query, key, value) along dim 0.
    Fused([String; 3]),
}

/// One timm-named tensor the model needs, and where to find it.
#[derive(Debug, Clone)]
struct Entry {
    timm: String,
    shape: Vec<usize>,
    source: Source,
}

/// The tensors a config needs, as `(timm name, shape, source in this naming)`, in model order.
fn entries(cfg: &DeiTConfig, naming: WeightNaming) -> Vec<Entry> {
    let (c, h, k, p) = (cfg.dim, cfg.mlp_hidden(), cfg.num_classes, cfg.patch_size);
    let mut timm: Vec<(String, Vec<usize>)> = vec![("cls_token".into(), vec![1, 1, c])];
    if cfg.distilled {
        timm.push(("dist_token".into(), vec![1, 1, c]));
    }
    timm.push(("pos_embed".into(), vec![1, cfg.seq_len(), c]));
    timm.push(("patch_embed.proj.weight".into(), vec![c, 3, p, p]));
    timm.push(("patch_embed.proj.bias".into(), vec![c]));
    for i in 0..cfg.depth {
        let b = format!("blocks.{i}");
        for (name, shape) in [
            ("norm1.weight", vec![c]),
            ("norm1.bias", vec![c]),
            ("attn.qkv.weight", vec![3 * c, c]),
            ("attn.qkv.bias", vec![3 * c]),
            ("attn.proj.weight", vec![c, c]),
            ("attn.proj.bias", vec![c]),
            ("norm2.weight", vec![c]),
            ("norm2.bias", vec![c]),
            ("mlp.fc1.weight", vec![h, c]),
            ("mlp.fc1.bias", vec![h]),
            ("mlp.fc2.weight", vec![c, h]),
            ("mlp.fc2.bias", vec![c]),
        ] {
            timm.push((format!("{b}.{name}"), shape));
        }
    }
    timm.push(("norm.weight".into(), vec![c]));
    timm.push(("norm.bias".into(), vec![c]));
    timm.push(("head.weight".into(), vec![k, c]));
    timm.push(("head.bias".into(), vec![k]));
    if cfg.distilled {
        timm.push(("head_dist.weight".into(), vec![k, c]));
        timm.push(("head_dist.bias".into(), vec![k]));
    }
    timm.into_iter()
        .map(|(name, shape)| Entry {
            source: source_of(&name, naming),
            timm: name,
            shape,
        })
        .collect()
}

/// Maps a timm name to its name(s) in `naming` (see the transformers ViT/DeiT modeling files).
fn source_of(timm: &str, naming: WeightNaming) -> Source {
    let pre = naming.hf_prefix();
    let one = |s: String| Source::One(s);
    match naming {
        WeightNaming::Timm => one(timm.to_string()),
        WeightNaming::HfVit | WeightNaming::HfDeit => {
            if let Some(rest) = timm.strip_prefix("blocks.") {
                let (i, leaf) = rest
                    .split_once('.')
                    .expect("block tensor names have a leaf");
                let layer = format!("{pre}.encoder.layer.{i}");
                let (module, param) = leaf.rsplit_once('.').expect("leaf has a param");
                if module == "attn.qkv" {
                    let qkv = ["query", "key", "value"]
                        .map(|m| format!("{layer}.attention.attention.{m}.{param}"));
                    return Source::Fused(qkv);
                }
                let hf_module = match module {
                    "norm1" => "layernorm_before",
                    "attn.proj" => "attention.output.dense",
                    "norm2" => "layernorm_after",
                    "mlp.fc1" => "intermediate.dense",
                    "mlp.fc2" => "output.dense",
                    other => unreachable!("unmapped block module {other}"),
                };
                return one(format!("{layer}.{hf_module}.{param}"));
            }
            let emb = format!("{pre}.embeddings");
            match timm {
                "cls_token" => one(format!("{emb}.cls_token")),
                "dist_token" => one(format!("{emb}.distillation_token")),
                "pos_embed" => one(format!("{emb}.position_embeddings")),
                "patch_embed.proj.weight" => {
                    one(format!("{emb}.patch_embeddings.projection.weight"))
                }
                "patch_embed.proj.bias" => one(format!("{emb}.patch_embeddings.projection.bias")),
                "norm.weight" => one(format!("{pre}.layernorm.weight")),
                "norm.bias" => one(format!("{pre}.layernorm.bias")),
                _ => {
                    let (module, param) = timm.rsplit_once('.').expect("head names have a param");
                    let hf_module = match (naming, module) {
                        (WeightNaming::HfVit, "head") => "classifier",
                        (WeightNaming::HfDeit, "head") => "cls_classifier",
                        (_, "head_dist") => "distillation_classifier",
                        (_, other) => unreachable!("unmapped tensor {other}"),
                    };
                    one(format!("{hf_module}.{param}"))
                }
            }
        }
    }
}

/// Tensors that transformers' base models may save but classification never reads (the pooler of
/// `ViTModel(add_pooling_layer=True)`); tolerated with any shape and skipped.
fn is_known_unused(name: &str, naming: WeightNaming) -> bool {
    match naming {
        WeightNaming::Timm => false,
        _ => name.starts_with(&format!("{}.pooler.dense.", naming.hf_prefix())),
    }
}

/// Expected checkpoint tensor names and shapes for `cfg` in `naming` (q/k/v listed separately for
/// the transformers namings), in model order.
pub fn expected_tensors(cfg: &DeiTConfig, naming: WeightNaming) -> Vec<(String, Vec<usize>)> {
    let mut out = Vec::new();
    for e in entries(cfg, naming) {
        match e.source {
            Source::One(name) => out.push((name, e.shape)),
            Source::Fused(names) => {
                let mut part = e.shape.clone();
                part[0] /= 3;
                out.extend(names.into_iter().map(|n| (n, part.clone())));
            }
        }
    }
    out
}

/// A checkpoint's tensors (on the CPU, in their stored dtype) and its detected naming.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    tensors: HashMap<String, Tensor>,
    naming: WeightNaming,
}

impl Checkpoint {
    /// Wraps already-loaded tensors, detecting the naming.
    pub fn from_tensors(tensors: HashMap<String, Tensor>) -> Result<Self, ModelError> {
        let naming = WeightNaming::detect(tensors.keys().map(String::as_str))?;
        Ok(Self { tensors, naming })
    }

    /// Reads a `.safetensors` file, or a PyTorch `.bin` / `.pth` / `.pt` (zip pickle) file through
    /// candle's pickle reader. The format is chosen by extension; PyTorch checkpoints that nest
    /// the state dict under `model` or `state_dict` (the original DeiT releases) are unwrapped.
    pub fn from_file(path: &Path) -> Result<Self, ModelError> {
        let read_err = |reason: String| ModelError::ReadWeights {
            path: path.to_path_buf(),
            reason,
        };
        if !path.is_file() {
            let reason = match std::fs::metadata(path) {
                Ok(_) => "not a regular file".to_string(),
                Err(e) => e.to_string(),
            };
            return Err(read_err(reason));
        }
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase)
            .unwrap_or_default();
        let tensors: HashMap<String, Tensor> = match ext.as_str() {
            "safetensors" => candle_core::safetensors::load(path, &Device::Cpu)
                .map_err(|e| read_err(format!("invalid safetensors file: {e}")))?,
            "bin" | "pth" | "pt" => read_pickle(path).map_err(read_err)?,
            _ => {
                return Err(ModelError::UnsupportedWeightsFormat {
                    path: path.to_path_buf(),
                })
            }
        };
        if tensors.is_empty() {
            return Err(read_err("the file holds no tensors".into()));
        }
        Self::from_tensors(tensors)
    }

    pub fn naming(&self) -> WeightNaming {
        self.naming
    }

    /// Tensor names and shapes, sorted by name.
    pub fn shapes(&self) -> BTreeMap<String, Vec<usize>> {
        self.tensors
            .iter()
            .map(|(n, t)| (n.clone(), t.dims().to_vec()))
            .collect()
    }

    fn dims_of(&self, name: &str) -> Option<&[usize]> {
        self.tensors.get(name).map(|t| t.dims())
    }

    /// Whether the checkpoint has a distillation token (in any naming).
    pub fn is_distilled(&self) -> bool {
        self.tensors.contains_key("dist_token")
            || self.tensors.contains_key(&format!(
                "{}.embeddings.distillation_token",
                self.naming.hf_prefix()
            ))
    }

    /// Infers the architecture from tensor shapes: dim, depth, patch and image size, MLP ratio,
    /// class count and distillation. The head count is not visible in shapes; it is `heads` when
    /// given, else the published DeiT value for the width (192→3, 384→6, 768→12), else dim/64.
    pub fn infer_config(&self, heads: Option<usize>) -> Result<DeiTConfig, ModelError> {
        let distilled = self.is_distilled();
        let mut probe = DeiTConfig::custom(1, 1, 1, 1, distilled);
        probe.mlp_ratio = 1;
        let find = |timm: &str| -> Result<(String, Vec<usize>), ModelError> {
            let name = match source_of(timm, self.naming) {
                Source::One(n) => n,
                Source::Fused(ns) => ns[0].clone(),
            };
            let dims = self
                .dims_of(&name)
                .ok_or_else(|| ModelError::CannotInfer(format!("no tensor `{name}`")))?;
            Ok((name, dims.to_vec()))
        };
        let bad = |name: &str, dims: &[usize]| {
            ModelError::CannotInfer(format!("tensor `{name}` has unexpected shape {dims:?}"))
        };
        let (name, cls) = find("cls_token")?;
        let dim = match cls.as_slice() {
            [1, 1, c] if *c > 0 => *c,
            _ => return Err(bad(&name, &cls)),
        };
        let (name, pw) = find("patch_embed.proj.weight")?;
        let patch = match pw.as_slice() {
            [_, 3, p, q] if p == q && *p > 0 => *p,
            _ => return Err(bad(&name, &pw)),
        };
        let (name, pos) = find("pos_embed")?;
        let n_patches = match pos.as_slice() {
            [1, n, _] if *n > probe.num_prefix_tokens() => n - probe.num_prefix_tokens(),
            _ => return Err(bad(&name, &pos)),
        };
        let grid = (n_patches as f64).sqrt().round() as usize;
        if grid * grid != n_patches {
            return Err(ModelError::CannotInfer(format!(
                "`{name}` has {n_patches} patch positions, not a square grid"
            )));
        }
        let block_re = match self.naming {
            WeightNaming::Timm => "blocks.".to_string(),
            n => format!("{}.encoder.layer.", n.hf_prefix()),
        };
        let depth = self
            .tensors
            .keys()
            .filter_map(|n| {
                n.strip_prefix(&block_re)?
                    .split('.')
                    .next()?
                    .parse::<usize>()
                    .ok()
            })
            .max()
            .map(|m| m + 1)
            .ok_or_else(|| ModelError::CannotInfer("no transformer blocks found".into()))?;
        let (name, fc1) = find("blocks.0.mlp.fc1.weight")?;
        let mlp_ratio = match fc1.as_slice() {
            [h, c] if *c == dim && h % dim == 0 && *h > 0 => h / dim,
            _ => return Err(bad(&name, &fc1)),
        };
        let (name, head) = find("head.weight")?;
        let num_classes = match head.as_slice() {
            [k, c] if *c == dim && *k > 0 => *k,
            _ => return Err(bad(&name, &head)),
        };
        let cfg = DeiTConfig {
            name: "custom".into(),
            image_size: grid * patch,
            patch_size: patch,
            dim,
            depth,
            heads: heads.unwrap_or_else(|| DeiTConfig::default_heads_for_dim(dim)),
            mlp_ratio,
            num_classes,
            distilled,
            ln_eps: 1e-6,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the checkpoint's full tensor list against what `cfg` needs: every expected tensor
    /// present with its exact shape, nothing unexpected. Errors name the first offending tensor
    /// (in model order; unexpected tensors sorted by name).
    pub fn validate(&self, cfg: &DeiTConfig) -> Result<(), ModelError> {
        cfg.validate()?;
        let model = cfg.name.clone();
        let expected = expected_tensors(cfg, self.naming);
        // A distilled/non-distilled mix-up is one mistake, not a list of tensors (it would first
        // show up as a confusing pos_embed length mismatch): say so directly.
        if self.is_distilled() != cfg.distilled {
            return Err(ModelError::DistilledMismatch {
                model,
                model_distilled: cfg.distilled,
            });
        }
        for (name, shape) in &expected {
            match self.dims_of(name) {
                None => {
                    return Err(ModelError::MissingTensor {
                        name: name.clone(),
                        expected: shape.clone(),
                    })
                }
                Some(found) if found != shape.as_slice() => {
                    return Err(ModelError::ShapeMismatch {
                        name: name.clone(),
                        expected: shape.clone(),
                        found: found.to_vec(),
                        model,
                    })
                }
                Some(_) => {}
            }
        }
        let expected_names: std::collections::HashSet<&str> =
            expected.iter().map(|(n, _)| n.as_str()).collect();
        let extra = self.shapes().into_iter().find(|(n, _)| {
            !expected_names.contains(n.as_str()) && !is_known_unused(n, self.naming)
        });
        if let Some((name, found)) = extra {
            return Err(ModelError::UnexpectedTensor { name, found, model });
        }
        Ok(())
    }

    /// Validates, then returns the weights under timm names (q/k/v fused into qkv), cast to
    /// `dtype` and moved to `device`.
    pub fn into_timm_tensors(
        self,
        cfg: &DeiTConfig,
        dtype: DType,
        device: &Device,
    ) -> Result<HashMap<String, Tensor>, ModelError> {
        self.validate(cfg)?;
        let mut tensors = self.tensors;
        let mut out = HashMap::new();
        for e in entries(cfg, self.naming) {
            let t = match e.source {
                Source::One(name) => tensors.remove(&name).expect("validated"),
                Source::Fused(names) => {
                    let parts = names
                        .iter()
                        .map(|n| tensors.remove(n).expect("validated"))
                        .collect::<Vec<_>>();
                    // All three must share a dtype for cat; they do in any real checkpoint,
                    // but cast to be safe.
                    let parts = parts
                        .iter()
                        .map(|t| t.to_dtype(dtype))
                        .collect::<candle_core::Result<Vec<_>>>()?;
                    Tensor::cat(&parts, 0)?
                }
            };
            out.insert(e.timm, t.to_dtype(dtype)?.to_device(device)?);
        }
        Ok(out)
    }

    /// Validates the checkpoint against `cfg` and builds the model in `dtype` on `device`.
    pub fn load_model(
        self,
        cfg: &DeiTConfig,
        dtype: DType,
        device: &Device,
    ) -> Result<DeiT, ModelError> {
        let tensors = self.into_timm_tensors(cfg, dtype, device)?;
        let vb = VarBuilder::from_backend(
            Box::new(TakenOnce(std::sync::Mutex::new(tensors))),
            dtype,
            device.clone(),
        );
        Ok(DeiT::new(cfg, vb)?)
    }
}

/// Checkpoint tensors that the model takes out as it is built: each is handed over once and no
/// longer held here, so a layer that keeps its weight in another form (on the CPU,
/// `FusedLinear`'s packed panels) frees the tensor as soon as it has it. With candle's
/// `HashMap` backend every tensor stayed alive until the whole model was built: a DeiT-B f32
/// `bench` peaked at the checkpoint plus all the panels (682 MB against a 361 MB steady state).
struct TakenOnce(std::sync::Mutex<HashMap<String, Tensor>>);

impl TakenOnce {
    fn take(&self, name: &str) -> candle_core::Result<Tensor> {
        let mut tensors = self.0.lock().unwrap_or_else(|e| e.into_inner());
        tensors.remove(name).ok_or_else(|| {
            candle_core::Error::CannotFindTensor {
                path: name.to_string(),
            }
            .bt()
        })
    }
}

impl candle_nn::var_builder::SimpleBackend for TakenOnce {
    fn get(
        &self,
        shape: candle_core::Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let tensor = self.take(name)?;
        if tensor.shape() != &shape {
            return Err(candle_core::Error::UnexpectedShape {
                msg: format!("shape mismatch for {name}"),
                expected: shape,
                got: tensor.shape().clone(),
            }
            .bt());
        }
        tensor.to_device(dev)?.to_dtype(dtype)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.take(name)?.to_device(dev)?.to_dtype(dtype)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        let tensors = self.0.lock().unwrap_or_else(|e| e.into_inner());
        tensors.contains_key(name)
    }
}

/// Reads a PyTorch zip checkpoint. The original DeiT `.pth` releases nest the weights under
/// `model`; transformers' `pytorch_model.bin` is a flat state dict.
fn read_pickle(path: &Path) -> Result<HashMap<String, Tensor>, String> {
    let mut first_err = None;
    for key in [None, Some("model"), Some("state_dict")] {
        match candle_core::pickle::read_all_with_key(path, key) {
            Ok(ts) if !ts.is_empty() => return Ok(ts.into_iter().collect()),
            Ok(_) => {}
            Err(e) => {
                first_err.get_or_insert_with(|| e.to_string());
            }
        }
    }
    Err(match first_err {
        Some(e) => format!("invalid PyTorch checkpoint: {e}"),
        None => "the PyTorch checkpoint holds no tensors".into(),
    })
}

/// Loads `path` and builds a model for `cfg` (see [`Checkpoint::load_model`]).
pub fn load_deit(
    path: &Path,
    cfg: &DeiTConfig,
    dtype: DType,
    device: &Device,
) -> Result<DeiT, ModelError> {
    Checkpoint::from_file(path)?.load_model(cfg, dtype, device)
}

/// Files fetched for (or found next to) a checkpoint.
#[derive(Debug, Clone, Default)]
pub struct CheckpointFiles {
    pub weights: PathBuf,
    /// timm or transformers `config.json`, if any.
    pub config: Option<PathBuf>,
    /// transformers `preprocessor_config.json`, if any.
    pub preprocessor_config: Option<PathBuf>,
}

impl CheckpointFiles {
    /// A local weights file plus `config.json` / `preprocessor_config.json` from the same folder
    /// when they exist.
    pub fn local(weights: &Path) -> Self {
        let dir = weights.parent().unwrap_or(Path::new("."));
        let existing = |name: &str| {
            let p = dir.join(name);
            p.is_file().then_some(p)
        };
        Self {
            weights: weights.to_path_buf(),
            config: existing("config.json"),
            preprocessor_config: existing("preprocessor_config.json"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_nn::var_builder::SimpleBackend;

    #[test]
    fn each_tensor_is_handed_over_once() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let w = Tensor::arange(0f32, 6.0, &dev)?.reshape((2, 3))?;
        let backend = TakenOnce(std::sync::Mutex::new(HashMap::from([(
            "w".to_string(),
            w.clone(),
        )])));
        assert!(backend.contains_tensor("w"));
        // A wrong shape is an error, and the tensor is gone all the same.
        let wrong = backend.get(
            (3, 2).into(),
            "w",
            candle_nn::Init::Const(0.),
            DType::F32,
            &dev,
        );
        assert!(wrong.is_err());
        assert!(!backend.contains_tensor("w"));

        let backend = TakenOnce(std::sync::Mutex::new(HashMap::from([("w".to_string(), w)])));
        let got = backend.get(
            (2, 3).into(),
            "w",
            candle_nn::Init::Const(0.),
            DType::F32,
            &dev,
        )?;
        assert_eq!(got.to_vec2::<f32>()?, [[0., 1., 2.], [3., 4., 5.]]);
        // Taken: no longer held, and a second request is an error, not a copy.
        assert!(!backend.contains_tensor("w"));
        assert!(backend.get_unchecked("w", DType::F32, &dev).is_err());
        Ok(())
    }
}
