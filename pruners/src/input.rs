//! What a pruner sees ([`PruneInput`]) and what it decides ([`KeepPlan`]).

use candle_core::{DType, Device, Tensor, D};

use crate::error::{PruneError, Result};

/// Values of the block's attention, as ATS needs them.
#[derive(Debug, Clone, Copy)]
pub enum ValueInput<'a> {
    /// `[B, H, N, D]` per-head values; the norm is taken over all heads' values
    /// concatenated (`‖V_j‖₂` of the `H·D`-vector), as the ATS reference does.
    Values(&'a Tensor),
    /// `[B, N]` precomputed value norms `‖V_j‖₂`.
    Norms(&'a Tensor),
}

/// The tokens of a (possibly padded) batch at one pruning site.
///
/// Image `b` owns the leading `lengths[b]` rows of `tokens[b]`; rows after that are padding
/// and are never looked at for a decision (they must be finite, zeros recommended, because
/// EViT's fused token is a batched weighted sum with zero weight on padding).
/// The first `num_prefix` rows of every image are the class token (and the distillation token
/// for distilled DeiT); they are always kept and never scored.
#[derive(Debug, Clone, Copy)]
pub struct PruneInput<'a> {
    /// `[B, N, C]` hidden states, any float dtype (scores are computed in f32).
    pub tokens: &'a Tensor,
    /// Per-image number of real tokens (prefix included); `None` means every image has `N`.
    pub lengths: Option<&'a [usize]>,
    /// Softmax attention of the class token's query over the keys: `[B, H, N]` per head or
    /// `[B, N]` already averaged over heads. Zeros (or anything) at padding.
    pub cls_attn: Option<&'a Tensor>,
    /// Values or value norms, for ATS.
    pub values: Option<ValueInput<'a>>,
    /// Number of leading prefix tokens (1: class token; 2: class + distillation token).
    pub num_prefix: usize,
}

impl<'a> PruneInput<'a> {
    /// A dense batch (all images have `N` tokens) with `num_prefix` prefix tokens.
    pub fn new(tokens: &'a Tensor, num_prefix: usize) -> Self {
        Self {
            tokens,
            lengths: None,
            cls_attn: None,
            values: None,
            num_prefix,
        }
    }

    /// Per-image valid lengths of a padded batch.
    pub fn with_lengths(mut self, lengths: &'a [usize]) -> Self {
        self.lengths = Some(lengths);
        self
    }

    /// Class-token attention, `[B, H, N]` or `[B, N]`.
    pub fn with_cls_attn(mut self, cls_attn: &'a Tensor) -> Self {
        self.cls_attn = Some(cls_attn);
        self
    }

    /// Per-head values `[B, H, N, D]`.
    pub fn with_values(mut self, values: &'a Tensor) -> Self {
        self.values = Some(ValueInput::Values(values));
        self
    }

    /// Precomputed value norms `[B, N]`.
    pub fn with_value_norms(mut self, norms: &'a Tensor) -> Self {
        self.values = Some(ValueInput::Norms(norms));
        self
    }

    /// Checks ranks, batch sizes and lengths; returns the batch geometry.
    pub fn validate(&self) -> Result<Geometry> {
        let dims = self.tokens.dims();
        if dims.len() != 3 {
            return Err(PruneError::Shape {
                what: "tokens",
                expected: "[B, N, C]".into(),
                got: dims.to_vec(),
            });
        }
        let (b, n, c) = (dims[0], dims[1], dims[2]);
        if !self.tokens.dtype().is_float() {
            return Err(PruneError::InvalidInput(format!(
                "tokens must be a float tensor, got {:?}",
                self.tokens.dtype()
            )));
        }
        if b == 0 {
            return Err(PruneError::InvalidInput("empty batch (B = 0)".into()));
        }
        if c == 0 {
            return Err(PruneError::InvalidInput(
                "tokens have no channels (C = 0)".into(),
            ));
        }
        if self.num_prefix == 0 {
            return Err(PruneError::InvalidInput(
                "num_prefix must be at least 1 (the class token)".into(),
            ));
        }
        let lengths = match self.lengths {
            Some(l) => {
                if l.len() != b {
                    return Err(PruneError::InvalidInput(format!(
                        "{} lengths given for a batch of {b} images",
                        l.len()
                    )));
                }
                l.to_vec()
            }
            None => vec![n; b],
        };
        for (image, &length) in lengths.iter().enumerate() {
            if length < self.num_prefix + 1 || length > n {
                return Err(PruneError::BadLength {
                    image,
                    length,
                    min: self.num_prefix + 1,
                    max: n,
                });
            }
        }
        if let Some(a) = self.cls_attn {
            let ad = a.dims();
            let ok = match ad.len() {
                2 => ad[0] == b && ad[1] == n,
                3 => ad[0] == b && ad[2] == n && ad[1] > 0,
                _ => false,
            };
            if !ok {
                return Err(PruneError::Shape {
                    what: "cls_attn",
                    expected: format!("[{b}, H, {n}] or [{b}, {n}]"),
                    got: ad.to_vec(),
                });
            }
        }
        match self.values {
            Some(ValueInput::Values(v)) => {
                let vd = v.dims();
                if vd.len() != 4 || vd[0] != b || vd[2] != n || vd[1] == 0 || vd[3] == 0 {
                    return Err(PruneError::Shape {
                        what: "values",
                        expected: format!("[{b}, H, {n}, D]"),
                        got: vd.to_vec(),
                    });
                }
            }
            Some(ValueInput::Norms(v)) => {
                let vd = v.dims();
                if vd != [b, n] {
                    return Err(PruneError::Shape {
                        what: "value_norms",
                        expected: format!("[{b}, {n}]"),
                        got: vd.to_vec(),
                    });
                }
            }
            None => {}
        }
        Ok(Geometry {
            batch: b,
            tokens: n,
            channels: c,
            lengths,
            num_prefix: self.num_prefix,
        })
    }
}

/// Batch geometry after validation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Geometry {
    pub batch: usize,
    /// Padded token count `N`.
    pub tokens: usize,
    pub channels: usize,
    /// Valid tokens per image (prefix included).
    pub lengths: Vec<usize>,
    pub num_prefix: usize,
}

impl Geometry {
    /// Patch tokens of image `b` (valid tokens after the prefix).
    pub fn patch_count(&self, b: usize) -> usize {
        self.lengths[b] - self.num_prefix
    }
}

/// EViT's fused tokens, one per image.
#[derive(Debug, Clone)]
pub struct FusedTokens {
    /// `[B, C]` in the dtype of the input tokens; zero rows where `present[b]` is false.
    pub tokens: Tensor,
    /// Whether image `b` gets a fused token (false when nothing of it was pruned).
    pub present: Vec<bool>,
}

/// Which tokens each image keeps.
#[derive(Debug, Clone)]
pub struct KeepPlan {
    /// Per image: ascending original positions, the prefix tokens `0..num_prefix` included.
    pub indices: Vec<Vec<u32>>,
    /// EViT's fused token, to be appended after the kept tokens of images where present.
    pub fused: Option<FusedTokens>,
    /// Prefix tokens of every image (copied from the input).
    pub num_prefix: usize,
}

impl KeepPlan {
    /// Number of images.
    pub fn batch_size(&self) -> usize {
        self.indices.len()
    }

    /// Whether image `b` gets a fused token appended.
    pub fn has_fused(&self, b: usize) -> bool {
        self.fused
            .as_ref()
            .is_some_and(|f| f.present.get(b).copied().unwrap_or(false))
    }

    /// Per-image token count after pruning: kept tokens plus the fused token where present.
    pub fn kept_counts(&self) -> Vec<usize> {
        (0..self.indices.len())
            .map(|b| self.indices[b].len() + usize::from(self.has_fused(b)))
            .collect()
    }

    /// Per-image kept patch tokens (prefix and fused token excluded).
    pub fn kept_patch_counts(&self) -> Vec<usize> {
        self.indices
            .iter()
            .map(|i| i.len() - self.num_prefix)
            .collect()
    }

    /// Longest image after pruning (the padded length of the next block).
    pub fn max_len(&self) -> usize {
        self.kept_counts().into_iter().max().unwrap_or(0)
    }

    /// `[B, n]` u8 mask over original positions: 1 where the token is kept (fused token not
    /// represented). Errors if an index is `>= n`.
    pub fn keep_mask(&self, n: usize, device: &Device) -> Result<Tensor> {
        let b = self.indices.len();
        let mut mask = vec![0u8; b * n];
        for (i, idx) in self.indices.iter().enumerate() {
            for &j in idx {
                let j = j as usize;
                if j >= n {
                    return Err(PruneError::InvalidInput(format!(
                        "kept index {j} of image {i} is outside a mask of {n} tokens"
                    )));
                }
                mask[i * n + j] = 1;
            }
        }
        Ok(Tensor::from_vec(mask, (b, n), device)?)
    }

    /// Applies the plan to a padded batch `[B, N, C]`: returns `[B, M, C]` (M = [`Self::max_len`])
    /// holding each image's kept tokens in ascending original order, then its fused token where
    /// present, then zero padding; and the new per-image lengths. One `index_select` on the
    /// device.
    pub fn gather_padded(&self, tokens: &Tensor) -> Result<(Tensor, Vec<usize>)> {
        let (b, n, c) = tokens.dims3()?;
        if b != self.indices.len() {
            return Err(PruneError::InvalidInput(format!(
                "plan has {} images, tokens have {b}",
                self.indices.len()
            )));
        }
        let counts = self.kept_counts();
        let m = counts.iter().copied().max().unwrap_or(0);
        // Source rows: b*n token rows, then one zero row, then b fused rows.
        let zero_row = (b * n) as u32;
        let mut rows = Vec::with_capacity(b * m);
        for (i, idx) in self.indices.iter().enumerate() {
            for &j in idx {
                if j as usize >= n {
                    return Err(PruneError::InvalidInput(format!(
                        "kept index {j} of image {i} is outside {n} tokens"
                    )));
                }
                rows.push((i * n) as u32 + j);
            }
            if self.has_fused(i) {
                rows.push(zero_row + 1 + i as u32);
            }
            rows.extend(std::iter::repeat_n(zero_row, m - counts[i]));
        }
        let flat = tokens.reshape((b * n, c))?;
        let zeros = Tensor::zeros((1, c), tokens.dtype(), tokens.device())?;
        let mut parts = vec![flat, zeros];
        if let Some(f) = &self.fused {
            parts.push(f.tokens.to_dtype(tokens.dtype())?);
        }
        let src = Tensor::cat(&parts, 0)?;
        let rows = Tensor::from_vec(rows, b * m, tokens.device())?;
        let out = src.index_select(&rows, 0)?.reshape((b, m, c))?;
        Ok((out, counts))
    }
}

/// `[B, N]` f32 class-token attention averaged over heads (rank-2 input is taken as already averaged).
pub(crate) fn cls_attn_mean(a: &Tensor) -> Result<Tensor> {
    let a = a.to_dtype(DType::F32)?;
    Ok(match a.rank() {
        3 => a.mean(1)?,
        _ => a,
    })
}

/// `[B, N]` f32 class-token attention summed over heads (rank-2 input is taken as already reduced;
/// only ranking and normalised shares are used downstream, so sum vs mean does not matter there).
pub(crate) fn cls_attn_sum(a: &Tensor) -> Result<Tensor> {
    let a = a.to_dtype(DType::F32)?;
    Ok(match a.rank() {
        3 => a.sum(1)?,
        _ => a,
    })
}

/// `[B, N]` f32 value norms.
pub(crate) fn value_norms(v: ValueInput<'_>) -> Result<Tensor> {
    Ok(match v {
        ValueInput::Norms(t) => t.to_dtype(DType::F32)?,
        ValueInput::Values(t) => {
            let t = t.to_dtype(DType::F32)?;
            // ‖concat_h V_h[j]‖ = sqrt(Σ_h Σ_d V²)
            t.sqr()?.sum(D::Minus1)?.sum(1)?.sqrt()?
        }
    })
}
