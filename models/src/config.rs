//! DeiT architecture hyper-parameters as a plain struct.
//!
//! The named configs (`tiny()`, `small()`, `base()`, `*_distilled()`) are the published DeiT
//! models; custom sizes (tests, fine-tunes) are built with a struct literal or
//! [`DeiTConfig::custom`] and run through exactly the same code.

use crate::error::ModelError;

/// Every name accepted by [`DeiTConfig::from_name`], in the order they are listed in errors.
pub const MODEL_NAMES: [&str; 6] = [
    "deit-tiny",
    "deit-small",
    "deit-base",
    "deit-tiny-distilled",
    "deit-small-distilled",
    "deit-base-distilled",
];

/// Architecture of a DeiT / ViT classifier with a class token (and a distillation token when
/// `distilled`).
#[derive(Debug, Clone, PartialEq)]
pub struct DeiTConfig {
    /// A short name for messages (e.g. `deit-small`); `custom` for inferred configs.
    pub name: String,
    /// Input side in pixels (square input).
    pub image_size: usize,
    /// Patch side in pixels.
    pub patch_size: usize,
    /// Embedding width C.
    pub dim: usize,
    /// Number of transformer blocks.
    pub depth: usize,
    /// Attention heads per block; `dim` must be divisible by it.
    pub heads: usize,
    /// MLP hidden width = `dim * mlp_ratio`.
    pub mlp_ratio: usize,
    /// Classifier outputs.
    pub num_classes: usize,
    /// Has a distillation token and a second head (`head_dist`), averaged with `head` at inference.
    pub distilled: bool,
    /// LayerNorm epsilon (1e-6 for DeiT in timm; HF configs say 1e-12 but load the same weights).
    pub ln_eps: f64,
}

impl DeiTConfig {
    fn standard(name: &str, dim: usize, heads: usize, distilled: bool) -> Self {
        Self {
            name: name.to_string(),
            image_size: 224,
            patch_size: 16,
            dim,
            depth: 12,
            heads,
            mlp_ratio: 4,
            num_classes: 1000,
            distilled,
            ln_eps: 1e-6,
        }
    }

    /// DeiT-Tiny: dim 192, 3 heads.
    pub fn tiny() -> Self {
        Self::standard("deit-tiny", 192, 3, false)
    }

    /// DeiT-Small: dim 384, 6 heads.
    pub fn small() -> Self {
        Self::standard("deit-small", 384, 6, false)
    }

    /// DeiT-Base: dim 768, 12 heads.
    pub fn base() -> Self {
        Self::standard("deit-base", 768, 12, false)
    }

    /// Same config with a distillation token and head (and `-distilled` appended to the name).
    pub fn distilled(mut self) -> Self {
        if !self.distilled {
            self.distilled = true;
            self.name.push_str("-distilled");
        }
        self
    }

    /// A custom-sized config (image 224 / patch 16 / mlp ratio 4 / eps 1e-6 unless changed after).
    pub fn custom(
        dim: usize,
        depth: usize,
        heads: usize,
        num_classes: usize,
        distilled: bool,
    ) -> Self {
        Self {
            name: "custom".to_string(),
            depth,
            num_classes,
            ..Self::standard("custom", dim, heads, distilled)
        }
    }

    /// Looks a published config up by name: `deit-{tiny,small,base}[-distilled]`.
    pub fn from_name(name: &str) -> Result<Self, ModelError> {
        let normalized = name.trim().to_ascii_lowercase().replace('_', "-");
        let (size, distilled) = match normalized.strip_suffix("-distilled") {
            Some(size) => (size, true),
            None => (normalized.as_str(), false),
        };
        let cfg = match size {
            "deit-tiny" => Self::tiny(),
            "deit-small" => Self::small(),
            "deit-base" => Self::base(),
            _ => {
                return Err(ModelError::UnknownModel {
                    name: name.to_string(),
                    valid: MODEL_NAMES.join(", "),
                })
            }
        };
        Ok(if distilled { cfg.distilled() } else { cfg })
    }

    /// Class token (+ distillation token) count: the tokens before the patch tokens.
    pub fn num_prefix_tokens(&self) -> usize {
        if self.distilled {
            2
        } else {
            1
        }
    }

    /// Patches per side.
    pub fn grid_size(&self) -> usize {
        self.image_size / self.patch_size
    }

    /// Patch tokens per image (196 for 224/16).
    pub fn num_patches(&self) -> usize {
        self.grid_size() * self.grid_size()
    }

    /// Tokens per image entering the first block.
    pub fn seq_len(&self) -> usize {
        self.num_patches() + self.num_prefix_tokens()
    }

    /// Per-head width.
    pub fn head_dim(&self) -> usize {
        self.dim / self.heads
    }

    /// MLP hidden width.
    pub fn mlp_hidden(&self) -> usize {
        self.dim * self.mlp_ratio
    }

    /// Flattened patch length: 3 * patch * patch.
    pub fn patch_dim(&self) -> usize {
        3 * self.patch_size * self.patch_size
    }

    /// Checks the invariants the modules rely on (divisibility, non-zero sizes).
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |reason: String| {
            Err(ModelError::InvalidConfig {
                name: self.name.clone(),
                reason,
            })
        };
        if self.dim == 0 || self.depth == 0 || self.heads == 0 || self.patch_size == 0 {
            return bad("dim, depth, heads and patch_size must be non-zero".into());
        }
        if self.num_classes == 0 || self.mlp_ratio == 0 {
            return bad("num_classes and mlp_ratio must be non-zero".into());
        }
        if !self.dim.is_multiple_of(self.heads) {
            return bad(format!(
                "dim {} is not divisible by heads {}",
                self.dim, self.heads
            ));
        }
        if !self.image_size.is_multiple_of(self.patch_size) || self.image_size == 0 {
            return bad(format!(
                "image_size {} is not a non-zero multiple of patch_size {}",
                self.image_size, self.patch_size
            ));
        }
        Ok(())
    }

    /// The timm Hub repository holding these weights, e.g. `timm/deit_small_patch16_224.fb_in1k`.
    /// `None` for configs that are not a published DeiT.
    pub fn timm_repo(&self) -> Option<String> {
        let size = self.published_size()?;
        let distilled = if self.distilled { "_distilled" } else { "" };
        Some(format!("timm/deit_{size}{distilled}_patch16_224.fb_in1k"))
    }

    /// The facebook Hub repository, e.g. `facebook/deit-small-distilled-patch16-224`.
    pub fn facebook_repo(&self) -> Option<String> {
        let size = self.published_size()?;
        let distilled = if self.distilled { "-distilled" } else { "" };
        Some(format!("facebook/deit-{size}{distilled}-patch16-224"))
    }

    fn published_size(&self) -> Option<&'static str> {
        let size = [Self::tiny(), Self::small(), Self::base()]
            .into_iter()
            .zip(["tiny", "small", "base"])
            .find(|(c, _)| {
                c.dim == self.dim
                    && c.heads == self.heads
                    && c.depth == self.depth
                    && c.image_size == self.image_size
                    && c.patch_size == self.patch_size
                    && c.mlp_ratio == self.mlp_ratio
                    && c.num_classes == self.num_classes
            })?;
        Some(size.1)
    }

    /// The head count the published models use for `dim` (192→3, 384→6, 768→12), else `dim / 64`
    /// (timm's ViT convention), used when a checkpoint's head count is not given anywhere.
    pub fn default_heads_for_dim(dim: usize) -> usize {
        match dim {
            192 => 3,
            384 => 6,
            768 => 12,
            d if d >= 64 && d % 64 == 0 => d / 64,
            _ => 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for name in MODEL_NAMES {
            let cfg = DeiTConfig::from_name(name).unwrap();
            assert_eq!(cfg.name, name);
            assert_eq!(cfg.distilled, name.ends_with("-distilled"));
            cfg.validate().unwrap();
        }
        assert_eq!(
            DeiTConfig::from_name("deit-small").unwrap(),
            DeiTConfig::small()
        );
        assert_eq!(DeiTConfig::from_name("DeiT_Base").unwrap().dim, 768);
    }

    #[test]
    fn unknown_name_lists_valid_ones() {
        let err = DeiTConfig::from_name("deit-huge").unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("deit-huge"), "{msg}");
        for name in MODEL_NAMES {
            assert!(msg.contains(name), "{msg}");
        }
    }

    #[test]
    fn derived_sizes() {
        let s = DeiTConfig::small();
        assert_eq!(
            (s.num_patches(), s.seq_len(), s.head_dim(), s.mlp_hidden()),
            (196, 197, 64, 1536)
        );
        let d = DeiTConfig::tiny().distilled();
        assert_eq!((d.seq_len(), d.head_dim()), (198, 64));
        assert_eq!(
            d.timm_repo().unwrap(),
            "timm/deit_tiny_distilled_patch16_224.fb_in1k"
        );
        assert_eq!(
            DeiTConfig::base().facebook_repo().unwrap(),
            "facebook/deit-base-patch16-224"
        );
        assert_eq!(DeiTConfig::custom(48, 2, 3, 10, false).timm_repo(), None);
        assert!(DeiTConfig::custom(48, 2, 5, 10, false).validate().is_err());
    }
}
