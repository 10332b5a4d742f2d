//! DeiT as small candle modules, in timm's structure and with timm's tensor names
//! (`patch_embed.proj`, `blocks.{i}.attn.qkv`, ...). Checkpoints in other namings are renamed
//! (and their separate q/k/v fused) by [`crate::checkpoint`] before they reach these modules, so
//! there is one code path for every checkpoint family and every model size.
//!
//! Per-token ops ([`Mlp`], LayerNorm, the Linear layers) accept any rank whose last dim is C;
//! only [`Attention`] looks at how tokens are grouped into images, through
//! [`AttentionInputs`]. Token-pruned execution (padded or ragged) is in [`crate::pruned`].
//!
//! Every Linear is a [`FusedLinear`]: on CUDA its bias, the MLP's GELU and the block's residual
//! adds ride in the matmul's epilogue instead of being separate passes over the activations
//! (those passes cost more than the matmuls in candle). The plain [`DeiT::forward`] runs the
//! blocks on the flattened `[B·N, C]` tokens with the ragged attention kernel on equal lengths:
//! no head split/merge copies, no `[B, H, N, N]` scores in memory.

use candle_core::{DType, Module, Result, Tensor, D};
use candle_fastpath::{layer_norm, linear, FusedLinear, LayerNorm};
use candle_nn::VarBuilder;
use candle_ragged::RaggedBatch;

/// Whether a forward over `batch_size` images runs its last block on the prefix rows only past
/// the attention ([`Block::forward_prefix`]): batches of more than one image (at batch 1 every
/// kernel is latency, and the two row gathers would cost more than the rows they save), unless
/// `CANDLE_DEIT_LAST_BLOCK=all` (read once; every row, for A/B measurements).
pub fn last_block_prefix_only(batch_size: usize) -> bool {
    static ALL_ROWS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    batch_size > 1 && !crate::env_switch(&ALL_ROWS, "CANDLE_DEIT_LAST_BLOCK", "all")
}
use pruners::PruneSite;

use crate::attention::{attend, merge_heads, split_heads, AttentionInputs};
use crate::config::DeiTConfig;
use crate::uniform_batches::UniformBatches;

/// Patch embedding: a 16×16 stride-16 conv, computed as one matmul over unfolded patches
/// (`[B·196, 3·16·16] @ Wᵀ + b`), which is the same arithmetic without im2col overhead.
#[derive(Debug, Clone)]
pub struct PatchEmbed {
    /// Conv weight flattened to `[C, 3·p·p]` in (channel, row, col) order, with the conv bias.
    proj: FusedLinear,
    patch_size: usize,
    image_size: usize,
}

impl PatchEmbed {
    /// Loads `proj.weight` `[C, 3, p, p]` and `proj.bias` `[C]`.
    pub fn new(cfg: &DeiTConfig, vb: VarBuilder) -> Result<Self> {
        let p = cfg.patch_size;
        let weight = vb
            .get((cfg.dim, 3, p, p), "proj.weight")?
            .reshape((cfg.dim, 3 * p * p))?;
        let bias = vb.get(cfg.dim, "proj.bias")?;
        Ok(Self {
            proj: FusedLinear::new(weight, Some(bias))?,
            patch_size: p,
            image_size: cfg.image_size,
        })
    }
}

impl Module for PatchEmbed {
    /// `[B, 3, H, W]` → `[B, (H/p)·(W/p), C]`, tokens in row-major patch order (as conv + flatten).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, c, h, w) = x.dims4()?;
        if c != 3 || h != self.image_size || w != self.image_size {
            candle_core::bail!(
                "patch embedding expects [B, 3, {s}, {s}] images, got {:?}",
                x.dims(),
                s = self.image_size
            );
        }
        let p = self.patch_size;
        let (gh, gw) = (h / p, w / p);
        // One row per patch, flattened like the conv weight, in the weight's dtype (one gather
        // and cast kernel on CUDA).
        let patches = candle_fastpath::patchify(x, p, self.proj.weight().dtype())?;
        self.proj.forward(&patches)?.reshape((b, gh * gw, ()))
    }
}

/// Multi-head self-attention with a fused qkv projection (timm's `Attention`).
#[derive(Debug, Clone)]
pub struct Attention {
    /// `[3C, C]`: rows are q | k | v, each head-major.
    pub qkv: FusedLinear,
    pub proj: FusedLinear,
    pub heads: usize,
    pub scale: f64,
}

impl Attention {
    pub fn new(cfg: &DeiTConfig, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            qkv: linear(cfg.dim, 3 * cfg.dim, vb.pp("qkv"))?,
            proj: linear(cfg.dim, cfg.dim, vb.pp("proj"))?,
            heads: cfg.heads,
            scale: (cfg.head_dim() as f64).powf(-0.5),
        })
    }

    /// Attention over tokens laid out as `inputs` says. The two projections are per-token.
    pub fn forward_with(&self, x: &Tensor, inputs: &AttentionInputs) -> Result<Tensor> {
        let heads = self.heads_from_qkv(&self.qkv.forward(x)?, inputs)?;
        self.proj.forward(&heads)
    }

    /// `residual + attn` from an already computed qkv projection (`[.., 3C]`, same layout as the
    /// tokens; a block computes it together with its LayerNorm, `candle_fastpath::norm_linear`,
    /// and hands it on to pruners that score tokens with this block's attention), the residual
    /// added in the output projection's epilogue.
    pub fn residual_from_qkv(
        &self,
        qkv: &Tensor,
        residual: &Tensor,
        inputs: &AttentionInputs,
    ) -> Result<Tensor> {
        Ok(self
            .proj
            .forward_residual(&self.heads_from_qkv(qkv, inputs)?, residual)?)
    }

    /// The attention output before the projection (`[.., C]`, heads merged).
    fn heads_from_qkv(&self, qkv: &Tensor, inputs: &AttentionInputs) -> Result<Tensor> {
        let (q, k, v) = split_heads(qkv, self.heads, inputs)?;
        let out = attend(&q, &k, &v, self.scale, inputs)?;
        merge_heads(&out, inputs)
    }
}

impl Module for Attention {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_with(x, &AttentionInputs::Dense)
    }
}

/// fc1 → exact (erf) GELU → fc2. Per-token.
#[derive(Debug, Clone)]
pub struct Mlp {
    pub fc1: FusedLinear,
    pub fc2: FusedLinear,
}

impl Mlp {
    pub fn new(cfg: &DeiTConfig, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            fc1: linear(cfg.dim, cfg.mlp_hidden(), vb.pp("fc1"))?,
            fc2: linear(cfg.mlp_hidden(), cfg.dim, vb.pp("fc2"))?,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // timm's DeiT uses nn.GELU (erf), not the tanh approximation.
        self.fc2.forward(&self.fc1.forward_gelu(x)?)
    }
}

/// `cu_seqlens` of packed (ragged) attention inputs, `None` for padded ones: what the one-image
/// fused kernels read their sequence's length from.
fn packed_offsets<'a>(inputs: &AttentionInputs<'a>) -> Option<&'a Tensor> {
    match inputs {
        AttentionInputs::Ragged { batch } => Some(batch.cu_seqlens()),
        _ => None,
    }
}

/// Pre-norm transformer block: `x = x + attn(norm1(x)); x = x + mlp(norm2(x))`.
/// What [`Block::forward_chained_with_norms`] returns: the block's output, the next block's qkv
/// projection of it (when this block computed it) and the L2 norm of each of its rows (when asked
/// for and computed on the way).
pub type ChainedBlock = (Tensor, Option<Tensor>, Option<Tensor>);

#[derive(Debug, Clone)]
pub struct Block {
    pub norm1: LayerNorm,
    pub attn: Attention,
    pub norm2: LayerNorm,
    pub mlp: Mlp,
}

impl Block {
    pub fn new(cfg: &DeiTConfig, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            norm1: layer_norm(cfg.dim, cfg.ln_eps, vb.pp("norm1"))?,
            attn: Attention::new(cfg, vb.pp("attn"))?,
            norm2: layer_norm(cfg.dim, cfg.ln_eps, vb.pp("norm2"))?,
            mlp: Mlp::new(cfg, vb.pp("mlp"))?,
        })
    }

    /// The attention half: `x + attn(norm1(x))`. Pruners that score tokens between the halves
    /// can call the halves separately.
    pub fn attn_residual(&self, x: &Tensor, inputs: &AttentionInputs) -> Result<Tensor> {
        Ok(self.attn_residual_with_qkv(x, inputs)?.0)
    }

    /// [`Self::attn_residual`] that also returns the block's fused qkv projection.
    pub fn attn_residual_with_qkv(
        &self,
        x: &Tensor,
        inputs: &AttentionInputs,
    ) -> Result<(Tensor, Tensor)> {
        // norm1 and qkv as one kernel where that is faster (candle_fastpath::norm_linear).
        let qkv = candle_fastpath::norm_linear(x, &self.norm1, &self.attn.qkv, false)?;
        Ok((self.attn.residual_from_qkv(&qkv, x, inputs)?, qkv))
    }

    /// The MLP half: `x + mlp(norm2(x))`; per-token, so any layout works
    /// (candle_fastpath::block_mlp: norm2, fc1 and the GELU as one kernel where that is faster on
    /// CUDA, one pass over chunks of rows on the CPU).
    pub fn mlp_residual(&self, x: &Tensor) -> Result<Tensor> {
        Ok(candle_fastpath::block_mlp(x, &self.mlp_to(None))?.0)
    }

    pub fn forward_with(&self, x: &Tensor, inputs: &AttentionInputs) -> Result<Tensor> {
        Ok(self.forward_chained(x, None, None, inputs)?.0)
    }

    /// [`Self::forward_with`] for a run of blocks over the same tokens: `qkv`, when given, is
    /// this block's qkv projection of `x` (computed by the block before, see `next`); `next`,
    /// when given, is the block that runs next on this block's output with the same `inputs`,
    /// and the call then also returns that block's qkv projection, computed with this block's
    /// fc2 (`candle_fastpath::residual_norm_linear`: one kernel where it applies, fc2 then
    /// norm_linear otherwise: the same arithmetic the next block would run). Returns the
    /// block's output and the next block's qkv (`None` without `next`, or when the next block
    /// will take the one-launch block and compute its own).
    pub fn forward_chained(
        &self,
        x: &Tensor,
        qkv: Option<Tensor>,
        next: Option<&Block>,
        inputs: &AttentionInputs,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (y, next_qkv, _) = self.forward_chained_with_norms(x, qkv, next, inputs, false)?;
        Ok((y, next_qkv))
    }

    /// [`Self::forward_chained`] that, with `want_norms`, also returns the L2 norm of each row of
    /// the block's output (`[rows]` f32) where the block runs as one launch that can compute them
    /// on the way (`candle_fastpath::attention_block_with_norms`, lever 77): the scores of a
    /// Threshold-L2 step before the next block, bit for bit the ones its selection kernel would
    /// compute from the rows. `None` otherwise (the step then computes them itself).
    pub fn forward_chained_with_norms(
        &self,
        x: &Tensor,
        qkv: Option<Tensor>,
        next: Option<&Block>,
        inputs: &AttentionInputs,
        want_norms: bool,
    ) -> Result<ChainedBlock> {
        if qkv.is_none() {
            if let Some(batch) = self.small_block_batch(x, inputs) {
                let y = candle_fastpath::small_block(
                    x,
                    batch.cu_seqlens(),
                    batch.max_len(),
                    &self.fused_weights(),
                )?;
                return Ok((y, None, None));
            }
        }
        // norm1 + qkv, the attention, proj + residual + norm2 + fc1 + GELU, then fc2 + residual
        // (+ the next block's norm1 + qkv): where the kernels apply, four launches
        // (candle_fastpath::norm_linear and residual_norm_linear) instead of eight; for one
        // image, three (attention_residual_norm_linear), or one from this block's qkv to the
        // next one's (attention_block).
        let qkv = self.qkv_of(x, qkv)?;
        let next = Self::chained_next(next, x, inputs);
        if let Some(done) = self.whole_block(x, &qkv, next, inputs, want_norms)? {
            return Ok(done);
        }
        if let Some((x1, hidden)) = self.fused_attention_through_fc1(x, &qkv, inputs)? {
            // fc2 + residual (+ the next block's norm1 + qkv).
            let (y, next_qkv) = candle_fastpath::fc2_then_next(&hidden, &x1, &self.mlp_to(next))?;
            return Ok((y, next_qkv, None));
        }
        // The attention, then the rest of the block (and the next block's qkv) per token:
        // proj + residual + norm2 + fc1 + GELU, then fc2 + residual (+ norm1 + qkv), as two
        // launches where the CUDA kernels apply, one pass over chunks of rows on the CPU.
        let heads = self.attn.heads_from_qkv(&qkv, inputs)?;
        let (y, next_qkv) =
            candle_fastpath::block_after_attention(&heads, x, &self.attn.proj, &self.mlp_to(next))?;
        Ok((y, next_qkv, None))
    }

    /// `next`, unless it will run as one launch on tokens like `x` (`small_block_batch`) and
    /// compute its own qkv: the block whose norm1 and qkv this block's last step runs.
    fn chained_next<'a>(
        next: Option<&'a Block>,
        x: &Tensor,
        inputs: &AttentionInputs,
    ) -> Option<&'a Block> {
        next.filter(|n| n.small_block_batch(x, inputs).is_none())
    }

    /// This block's MLP half, with `next`'s norm1 and qkv when given.
    fn mlp_to<'a>(&'a self, next: Option<&'a Block>) -> candle_fastpath::BlockMlp<'a> {
        candle_fastpath::BlockMlp {
            norm2: &self.norm2,
            fc1: &self.mlp.fc1,
            fc2: &self.mlp.fc2,
            next: next.map(|n| (&n.norm1, &n.attn.qkv)),
        }
    }

    /// The block's output and the next block's qkv in one launch
    /// (`candle_fastpath::attention_block`) where it applies: one image's packed tokens at
    /// DeiT-T's width, with a next block (`next` as [`Self::chained_next`] gives it: one that
    /// does not run as one launch itself); else `None`. With `want_norms`, the output's row
    /// norms too
    /// ([`Self::forward_chained_with_norms`]).
    fn whole_block(
        &self,
        x: &Tensor,
        qkv: &Tensor,
        next: Option<&Block>,
        inputs: &AttentionInputs,
        want_norms: bool,
    ) -> Result<Option<ChainedBlock>> {
        let (AttentionInputs::Ragged { batch }, Some(next)) = (inputs, next) else {
            return Ok(None);
        };
        let tail = self.tail_to(next);
        let (heads, cu) = (self.attn.heads, batch.cu_seqlens());
        // One sequence only: the applies check reads that off cu_seqlens.
        if !candle_fastpath::attention_block_applies(qkv, cu, heads, x, &tail) {
            return Ok(None);
        }
        let scale = self.attn.scale;
        if want_norms {
            let (y, next_qkv, norms) =
                candle_fastpath::attention_block_with_norms(qkv, cu, heads, scale, x, &tail)?;
            return Ok(Some((y, Some(next_qkv), Some(norms))));
        }
        let (y, next_qkv) = candle_fastpath::attention_block(qkv, cu, heads, scale, x, &tail)?;
        Ok(Some((y, Some(next_qkv), None)))
    }

    /// `(x1, gelu(fc1(norm2(x1))))` with `x1 = x + proj(attention)`, from the block's qkv
    /// projection: as one kernel, `candle_fastpath::attention_residual_norm_linear`, where it
    /// applies (one image's packed tokens at DeiT-T's width), or as two at DeiT-S's width,
    /// `candle_fastpath::attention_linear_residual_norm` (the attention through norm2) and fc1;
    /// `None` otherwise.
    fn fused_attention_through_fc1(
        &self,
        x: &Tensor,
        qkv: &Tensor,
        inputs: &AttentionInputs,
    ) -> Result<Option<(Tensor, Tensor)>> {
        if let Some((x1, z)) = self.fused_attention_through_norm2(x, qkv, inputs)? {
            let hidden = self
                .mlp
                .fc1
                .forward_with(&z, candle_fastpath::Epilogue::Gelu)?;
            return Ok(Some((x1, hidden)));
        }
        let Some(cu) = packed_offsets(inputs) else {
            return Ok(None);
        };
        let (a, norm2, fc1) = (&self.attn, &self.norm2, &self.mlp.fc1);
        // One sequence only: the applies check reads that off cu_seqlens.
        if !candle_fastpath::attention_residual_norm_linear_applies(
            qkv, cu, a.heads, x, &a.proj, norm2, fc1, true,
        ) {
            return Ok(None);
        }
        let done = candle_fastpath::attention_residual_norm_linear(
            qkv, cu, a.heads, a.scale, x, &a.proj, norm2, fc1, true,
        )?;
        Ok(Some(done))
    }

    /// `(x1, norm2(x1))` with `x1 = x + proj(attention)`, from the block's qkv projection, as one
    /// kernel, `candle_fastpath::attention_linear_residual_norm` (lever 119), where it applies
    /// (one image's packed tokens at DeiT-S's width); `None` otherwise.
    fn fused_attention_through_norm2(
        &self,
        x: &Tensor,
        qkv: &Tensor,
        inputs: &AttentionInputs,
    ) -> Result<Option<(Tensor, Tensor)>> {
        let Some(cu) = packed_offsets(inputs) else {
            return Ok(None);
        };
        let (a, norm2) = (&self.attn, &self.norm2);
        // One sequence only: the applies check reads that off cu_seqlens.
        if !candle_fastpath::attention_linear_residual_norm_applies(
            qkv, cu, a.heads, x, &a.proj, norm2,
        ) {
            return Ok(None);
        }
        let both = candle_fastpath::attention_linear_residual_norm(
            qkv, cu, a.heads, a.scale, x, &a.proj, norm2,
        )?;
        Ok(Some(both))
    }

    /// The block's output at the first `num_prefix` rows of every sequence of `batch` only (the
    /// class and distillation tokens), `[B, num_prefix, C]`, from packed tokens `x` `[total, C]`:
    /// what a classifier's head reads after its last block. The attention still runs over every
    /// row (all keys and values are needed), the projection, residuals and MLP over the prefix
    /// rows only (three quarters of the block's GEMM work at any batch size; the same
    /// arithmetic per row). `qkv` as in [`Self::forward_chained`].
    pub fn forward_prefix(
        &self,
        x: &Tensor,
        qkv: Option<Tensor>,
        batch: &RaggedBatch,
        num_prefix: usize,
    ) -> Result<Tensor> {
        let inputs = AttentionInputs::Ragged { batch };
        let heads = self.attention_output(x, qkv, &inputs)?;
        let heads = candle_ragged::leading_rows(&heads, batch, num_prefix)?;
        let x = candle_ragged::leading_rows(x, batch, num_prefix)?;
        let after = candle_fastpath::block_after_attention(
            &heads,
            &x,
            &self.attn.proj,
            &self.mlp_to(None),
        )?;
        Ok(after.0)
    }

    /// The attention's output for tokens `x` (heads merged, before the projection), from their
    /// qkv projection ([`Self::qkv_of`]).
    fn attention_output(
        &self,
        x: &Tensor,
        qkv: Option<Tensor>,
        inputs: &AttentionInputs,
    ) -> Result<Tensor> {
        self.attn.heads_from_qkv(&self.qkv_of(x, qkv)?, inputs)
    }

    /// The qkv projection of tokens `x`: `qkv` when the block before computed it
    /// ([`Self::forward_chained`]), else norm1 + qkv here (`candle_fastpath::norm_linear`).
    fn qkv_of(&self, x: &Tensor, qkv: Option<Tensor>) -> Result<Tensor> {
        match qkv {
            Some(qkv) => Ok(qkv),
            None => Ok(candle_fastpath::norm_linear(
                x,
                &self.norm1,
                &self.attn.qkv,
                false,
            )?),
        }
    }

    /// The batch of `inputs` when this block runs as one launch on `x` (packed tokens few enough
    /// for candle_fastpath::small_block: a DeiT at batch 1 on CUDA, f16 / bf16, outside graph
    /// capture by default), the same block as one kernel instead of ~8.
    fn small_block_batch<'a>(
        &self,
        x: &Tensor,
        inputs: &AttentionInputs<'a>,
    ) -> Option<&'a RaggedBatch> {
        match inputs {
            AttentionInputs::Ragged { batch } => {
                candle_fastpath::small_block_applies(x, batch.max_len(), &self.fused_weights())
                    .then_some(*batch)
            }
            _ => None,
        }
    }

    /// This block's weights after its attention and `next`'s norm1 and qkv: what the chained
    /// batch-1 kernels run from this block's qkv (or its hidden states after attention) to the
    /// next block's qkv ([`candle_fastpath::BlockTail::mlp`] for the MLP half alone).
    fn tail_to<'a>(&'a self, next: &'a Block) -> candle_fastpath::BlockTail<'a> {
        candle_fastpath::BlockTail {
            proj: &self.attn.proj,
            norm2: &self.norm2,
            fc1: &self.mlp.fc1,
            fc2: &self.mlp.fc2,
            next_norm1: &next.norm1,
            next_qkv: &next.attn.qkv,
        }
    }

    /// This block's weights as [`candle_fastpath::small_block`] reads them.
    pub fn fused_weights(&self) -> candle_fastpath::BlockWeights<'_> {
        candle_fastpath::BlockWeights {
            norm1: &self.norm1,
            qkv: &self.attn.qkv,
            proj: &self.attn.proj,
            norm2: &self.norm2,
            fc1: &self.mlp.fc1,
            fc2: &self.mlp.fc2,
            heads: self.attn.heads,
            scale: self.attn.scale as f32,
        }
    }

    /// What a pruner at `site` of this block sees: the block's input (before the block), or the
    /// hidden states after attention + residual together with the block's fused qkv (after
    /// attention, for the class token's attention; [`Self::attention_residual_chained`], `qkv`
    /// being that projection of `x` when the block before computed it). A step before the block
    /// takes no qkv here: `qkv` must then be `None` (an error otherwise).
    pub fn tokens_at(
        &self,
        site: PruneSite,
        x: &Tensor,
        qkv: Option<Tensor>,
        inputs: &AttentionInputs,
    ) -> Result<(Tensor, Option<Tensor>)> {
        match site {
            PruneSite::BeforeBlock if qkv.is_some() => candle_core::bail!(
                "tokens_at: a qkv projection was given for a step before the block, which sees \
                 the block's input only"
            ),
            PruneSite::BeforeBlock => Ok((x.clone(), None)),
            PruneSite::AfterAttention => {
                let (h, qkv) = self.attention_residual_chained(x, qkv, inputs)?;
                Ok((h, Some(qkv)))
            }
        }
    }

    /// [`Self::attention_residual_chained`] that also returns the class token's attention
    /// scores a step after the attention ranks (`[1, heads + 1, len]`, candle-ragged's
    /// `StepScores` rows), computed inside the attention kernel where that applies
    /// (candle_fastpath::attention_residual_with_cls_probs, lever 88: one image at DeiT-T's
    /// width); `None` otherwise (the step computes them).
    pub fn attention_residual_with_cls_probs(
        &self,
        x: &Tensor,
        qkv: Option<Tensor>,
        inputs: &AttentionInputs,
    ) -> Result<(Tensor, Tensor, Option<Tensor>)> {
        let qkv = self.qkv_of(x, qkv)?;
        if let AttentionInputs::Ragged { batch } = inputs {
            let (heads, cu) = (self.attn.heads, batch.cu_seqlens());
            if candle_fastpath::attention_cls_probs_enabled()
                && candle_fastpath::attention_residual_applies(&qkv, cu, heads, x, &self.attn.proj)
            {
                let (x1, probs) = candle_fastpath::attention_residual_with_cls_probs(
                    &qkv,
                    cu,
                    heads,
                    self.attn.scale,
                    x,
                    &self.attn.proj,
                )?;
                return Ok((x1, qkv, Some(probs)));
            }
        }
        let (x1, qkv) = self.attention_residual_chained(x, Some(qkv), inputs)?;
        Ok((x1, qkv, None))
    }

    /// The hidden states after attention + residual, `x + proj(attention(norm1(x)))`, and the
    /// block's qkv projection: what a pruning step after the attention sees
    /// ([`Self::tokens_at`]). `qkv`, when given, is that projection of `x`, computed by the block
    /// before ([`Self::forward_chained`]). For one image at DeiT-T's width the attention and the
    /// projection are one kernel (`candle_fastpath::attention_residual`, lever 86; with it
    /// switched off `attention_residual_norm_linear`, whose norm2 + fc1 output is dropped: the
    /// step decides which rows the MLP half sees, and the fused token it may add has to go
    /// through norm2 + fc1 itself); at DeiT-S's, `attention_linear_residual_norm` (lever 119),
    /// whose norm2 output is dropped; else two.
    pub fn attention_residual_chained(
        &self,
        x: &Tensor,
        qkv: Option<Tensor>,
        inputs: &AttentionInputs,
    ) -> Result<(Tensor, Tensor)> {
        let qkv = self.qkv_of(x, qkv)?;
        // One launch from qkv to x1 (lever 86), else the one through fc1 whose fc1 is dropped.
        if let AttentionInputs::Ragged { batch } = inputs {
            let cu = batch.cu_seqlens();
            if candle_fastpath::attention_residual_applies(
                &qkv,
                cu,
                self.attn.heads,
                x,
                &self.attn.proj,
            ) {
                let x1 = candle_fastpath::attention_residual(
                    &qkv,
                    cu,
                    self.attn.heads,
                    self.attn.scale,
                    x,
                    &self.attn.proj,
                )?;
                return Ok((x1, qkv));
            }
        }
        // Else one launch from qkv through norm2 (lever 119: DeiT-S's width) or fc1 (DeiT-T's),
        // whose last output is dropped.
        if let Some((x1, _)) = self.fused_attention_through_norm2(x, &qkv, inputs)? {
            return Ok((x1, qkv));
        }
        if let Some((x1, _)) = self.fused_attention_through_fc1(x, &qkv, inputs)? {
            return Ok((x1, qkv));
        }
        Ok((self.attn.residual_from_qkv(&qkv, x, inputs)?, qkv))
    }

    /// A fixed-count pruning step after this block's attention on `x1` (one image's tokens: its
    /// hidden states after attention + residual), then the block's MLP half and the `next`
    /// block's qkv, as one launch where it applies (candle_fastpath::select_mlp_block, lever 87:
    /// DeiT-T's width, one image, with a next block that does not run as a small block of its
    /// own over `after`, the kept tokens' batch): `Some((x2, qkv'))`, bit for bit what
    /// candle_ragged::select_top_k_by and then [`Self::rest_after_chained`] give. `None` where it
    /// does not apply, before any work: the caller selects, then runs the rest.
    /// `given`: the step's scores when the attention kernel computed them
    /// ([`Self::attention_residual_with_cls_probs`]), else computed here from `scores`.
    #[allow(clippy::too_many_arguments)]
    pub fn select_then_mlp_chained(
        &self,
        x1: &Tensor,
        scores: candle_ragged::TokenScores<'_>,
        given: Option<candle_ragged::StepScores>,
        prefix: usize,
        keep: usize,
        fusion: Option<candle_ragged::DroppedFusion>,
        next: Option<&Block>,
        after: &AttentionInputs,
    ) -> Result<Option<(Tensor, Tensor)>> {
        let Some(next) = next else {
            return Ok(None);
        };
        let tail = self.tail_to(next).mlp();
        if !candle_fastpath::select_mlp_block_applies(x1, &tail) {
            return Ok(None);
        }
        let patches = x1.dim(0)?.saturating_sub(prefix);
        let out_rows = prefix + keep + (fusion.is_some() && keep < patches) as usize;
        // rest_after_chained's rule: a next block running as one launch computes its own qkv.
        if next
            .small_block_batch(&x1.narrow(0, 0, out_rows.min(x1.dim(0)?))?, after)
            .is_some()
        {
            return Ok(None);
        }
        let step = match given {
            Some(step) => step,
            None => candle_ragged::step_scores(x1, 1, scores)?,
        };
        let (x2, next_qkv) =
            candle_fastpath::select_mlp_block(x1, &step, prefix, keep, fusion, &tail)?;
        Ok(Some((x2, next_qkv)))
    }

    /// A fixed-count pruning step before this block on `x` (one image's tokens, the block's
    /// input) with `qkv` this block's qkv projection of them (computed by the block before), then
    /// the whole block and the `next` block's qkv, as one launch where it applies
    /// (candle_fastpath::select_attention_block, lever 90: DeiT-T's width, one image, no fused
    /// row, with a next block that does not run as a small block of its own over `after`, the
    /// kept tokens' batch): `Some((x2, qkv', norms))`, bit for bit what
    /// candle_ragged::select_top_k_gathering and then [`Self::rest_after_chained`] give, with
    /// x2's row norms when `want_norms` (as [`Self::forward_chained_with_norms`]). `None` where
    /// it does not apply, before any work: the caller selects, then runs the rest.
    #[allow(clippy::too_many_arguments)]
    pub fn select_then_block_chained(
        &self,
        x: &Tensor,
        qkv: &Tensor,
        scores: candle_ragged::TokenScores<'_>,
        prefix: usize,
        keep: usize,
        next: Option<&Block>,
        after: &AttentionInputs,
        want_norms: bool,
    ) -> Result<Option<ChainedBlock>> {
        // Row norms are ranked as given scores (the block before computes them); without them
        // the select kernel computes its own.
        let (Some(next), false) = (
            next,
            matches!(scores, candle_ragged::TokenScores::RowL2Norm),
        ) else {
            return Ok(None);
        };
        let tail = self.tail_to(next);
        let out_rows = prefix + keep;
        let heads = self.attn.heads;
        if !candle_fastpath::select_attention_block_applies(qkv, heads, x, &tail, out_rows) {
            return Ok(None);
        }
        // whole_block's rule: a next block running as one launch computes its own qkv.
        if next
            .small_block_batch(&x.narrow(0, 0, out_rows)?, after)
            .is_some()
        {
            return Ok(None);
        }
        let step = candle_ragged::step_scores(x, 1, scores)?;
        let scale = self.attn.scale;
        if want_norms {
            let (y, next_qkv, norms) = candle_fastpath::select_attention_block_with_norms(
                qkv, x, &step, prefix, keep, heads, scale, &tail,
            )?;
            return Ok(Some((y, Some(next_qkv), Some(norms))));
        }
        let (y, next_qkv) = candle_fastpath::select_attention_block(
            qkv, x, &step, prefix, keep, heads, scale, &tail,
        )?;
        Ok(Some((y, Some(next_qkv), None)))
    }

    /// The rest of the block after a pruning step at `site` on the kept tokens `x` (laid out as
    /// `inputs` says): the whole block, or its MLP half.
    pub fn rest_after(
        &self,
        site: PruneSite,
        x: &Tensor,
        inputs: &AttentionInputs,
    ) -> Result<Tensor> {
        match site {
            PruneSite::BeforeBlock => self.forward_with(x, inputs),
            PruneSite::AfterAttention => self.mlp_residual(x),
        }
    }

    /// [`Self::rest_after`] that also computes the `next` block's qkv as
    /// [`Self::forward_chained`] does (`None` without `next`); `qkv`, for a step before the
    /// block, is this block's qkv projection of `x` when the step gathered it with the tokens.
    pub fn rest_after_chained(
        &self,
        site: PruneSite,
        x: &Tensor,
        qkv: Option<Tensor>,
        next: Option<&Block>,
        inputs: &AttentionInputs,
    ) -> Result<(Tensor, Option<Tensor>)> {
        match site {
            PruneSite::BeforeBlock => self.forward_chained(x, qkv, next, inputs),
            PruneSite::AfterAttention => {
                // One launch from the kept tokens to the next block's qkv where it applies
                // (candle_fastpath::mlp_block: DeiT-T's width, a grid of one wave), as the
                // chained blocks' second step.
                let next = Self::chained_next(next, x, inputs);
                if let Some(next) = next {
                    let tail = self.tail_to(next).mlp();
                    if candle_fastpath::mlp_block_applies(x, &tail) {
                        let (y, next_qkv) = candle_fastpath::mlp_block(x, &tail)?;
                        return Ok((y, Some(next_qkv)));
                    }
                }
                // Else norm2 + fc1 + GELU, then fc2 + residual (+ the next norm1 + qkv): two
                // launches where the CUDA kernels apply, one pass over chunks of rows on the CPU.
                Ok(candle_fastpath::block_mlp(x, &self.mlp_to(next))?)
            }
        }
    }
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_with(x, &AttentionInputs::Dense)
    }
}

/// A DeiT (or plain ViT with class token) image classifier, optionally distilled.
#[derive(Debug, Clone)]
pub struct DeiT {
    pub config: DeiTConfig,
    pub patch_embed: PatchEmbed,
    /// `[1, 1, C]`
    pub cls_token: Tensor,
    /// `[1, 1, C]`, distilled models only.
    pub dist_token: Option<Tensor>,
    /// `[1, N, C]` with N = prefix tokens + patches.
    pub pos_embed: Tensor,
    pub blocks: Vec<Block>,
    pub norm: LayerNorm,
    pub head: FusedLinear,
    /// Distillation head (distilled models only), averaged with `head` at inference.
    pub head_dist: Option<FusedLinear>,
    /// The batch descriptions of equal-length sequences this model's forwards reuse (dense
    /// batches, fixed-ratio pruning steps): no `cu_seqlens` upload per forward.
    pub uniform_batches: UniformBatches,
    /// `[N, C]`: what the patch GEMM's residual operand is when it computes a whole sequence's
    /// rows ([`DeiT::embed_into_first_block`]): `pos_embed`, and in the prefix rows (whose patch
    /// row is zero, so the GEMM gives the patch bias there) `prefix + pos − patch bias`, formed
    /// in f32 and rounded once.
    pub embed_residual: Tensor,
    /// `[P, C]`: the class (and distillation) token as the rows [`DeiT::embed`] puts first,
    /// formed once at load (concatenating them per call cost two copy kernels per forward).
    pub prefix_tokens: Tensor,
}

/// Whether [`DeiT::embed_into_first_block`] may run the embedding inside block 0's norm1 + qkv
/// kernel (lever 67), unless `CANDLE_DEIT_FUSED_EMBED=0` (read once; for A/B measurements).
fn fused_embedding_allowed() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    !crate::env_switch(&OFF, "CANDLE_DEIT_FUSED_EMBED", "0")
}

impl DeiT {
    /// Builds the model from timm-named weights. The VarBuilder's dtype is the compute dtype.
    pub fn new(config: &DeiTConfig, vb: VarBuilder) -> Result<Self> {
        let c = config.dim;
        let dist_token = if config.distilled {
            Some(vb.get((1, 1, c), "dist_token")?)
        } else {
            None
        };
        let head_dist = if config.distilled {
            Some(linear(c, config.num_classes, vb.pp("head_dist"))?)
        } else {
            None
        };
        let blocks = (0..config.depth)
            .map(|i| Block::new(config, vb.pp(format!("blocks.{i}"))))
            .collect::<Result<Vec<_>>>()?;
        let patch_embed = PatchEmbed::new(config, vb.pp("patch_embed"))?;
        let cls_token = vb.get((1, 1, c), "cls_token")?;
        let pos_embed = vb.get((1, config.seq_len(), c), "pos_embed")?;
        let mut prefix = vec![cls_token.reshape((1, c))?];
        if let Some(dist) = &dist_token {
            prefix.push(dist.reshape((1, c))?);
        }
        let prefix_tokens = Tensor::cat(&prefix, 0)?;
        let embed_residual = embed_residual(&patch_embed, &prefix_tokens, &pos_embed)?;
        Ok(Self {
            config: config.clone(),
            patch_embed,
            cls_token,
            dist_token,
            pos_embed,
            embed_residual,
            prefix_tokens,
            blocks,
            norm: layer_norm(c, config.ln_eps, vb.pp("norm"))?,
            head: linear(c, config.num_classes, vb.pp("head"))?,
            head_dist,
            uniform_batches: UniformBatches::default(),
        })
    }

    /// The dtype the weights (and so the computation) are in.
    pub fn dtype(&self) -> DType {
        self.pos_embed.dtype()
    }

    /// Pixels `[B, 3, H, W]` (any float dtype; cast to the model's) → tokens `[B, N, C]` entering
    /// the first block: `[cls, (dist), patches] + pos_embed`.
    pub fn embed(&self, pixels: &Tensor) -> Result<Tensor> {
        // The patch embedding casts while it gathers (f32 pixels, the preprocessing's output).
        let patches = self.patch_embed.forward(pixels)?;
        // One kernel on CUDA: prefix and patch rows plus pos_embed, written once.
        Ok(candle_fastpath::embed_tokens(
            &patches,
            Some(&self.prefix_tokens),
            &self.pos_embed,
        )?)
    }

    /// [`Self::embed`], and where one kernel computes both, block 0's qkv projection of the
    /// tokens (`[B·N, 3C]`, what `candle_fastpath::norm_linear(norm1, qkv)` gives), to hand to
    /// [`Block::forward_chained`] as a block before it would (`None` where the kernel does not
    /// apply). One image on CUDA at DeiT-T's width (lever 67): the patch GEMM (K = 3·p² = 4C) is
    /// `candle_fastpath::residual_norm_linear`'s fc2-shaped form, run over the patch rows after a
    /// zero row per prefix token (`candle_fastpath::patchify_after_zero_rows`) with
    /// [`Self::embed_residual`] as its residual, so the position embedding, the class (and
    /// distillation) rows, block 0's LayerNorm and its qkv GEMM ride in the same launch. Its
    /// sums round where [`Self::embed`]'s do except in the prefix rows (`(0 + r) + bias` with
    /// `r = prefix + pos − bias` rounded, against `prefix + pos`: within a rounding) and in the
    /// GEMMs' summation order.
    pub fn embed_into_first_block(&self, pixels: &Tensor) -> Result<(Tensor, Option<Tensor>)> {
        match self.fused_embedding(pixels)? {
            Some((x, qkv)) => Ok((x, Some(qkv))),
            None => Ok((self.embed(pixels)?, None)),
        }
    }

    /// [`Self::embed_into_first_block`]'s one-kernel form, `None` where it does not apply.
    fn fused_embedding(&self, pixels: &Tensor) -> Result<Option<(Tensor, Tensor)>> {
        let Some(block) = self.blocks.first() else {
            return Ok(None);
        };
        let (n, c) = (self.config.seq_len(), self.config.dim);
        let s = self.config.image_size;
        // One image (the residual operand is one image's rows) of the expected size (else
        // `embed` reports the error); block 0 not one launch on its own (an eager batch-1
        // forward's candle_fastpath::small_block, which computes its own qkv); the kernel's own
        // conditions, asked of the residual before the patch rows are made.
        let residual = &self.embed_residual;
        let applies = fused_embedding_allowed()
            && pixels.dims() == [1, 3, s, s]
            && pixels.device().same_device(residual.device())
            && !candle_fastpath::small_block_applies(residual, n, &block.fused_weights())
            && candle_fastpath::residual_norm_linear_step_applies(
                residual,
                &self.patch_embed.proj,
                &block.norm1,
                &block.attn.qkv,
                false,
            );
        if !applies {
            return Ok(None);
        }
        let rows = candle_fastpath::patchify_after_zero_rows(
            pixels,
            self.patch_embed.patch_size,
            residual.dtype(),
            self.config.num_prefix_tokens(),
        )?;
        let (x, qkv) = candle_fastpath::residual_norm_linear(
            &rows,
            residual,
            &self.patch_embed.proj,
            &block.norm1,
            &block.attn.qkv,
            false,
        )?;
        Ok(Some((x.reshape((1, n, c))?, qkv)))
    }

    /// Tokens after all blocks and the final norm: `[B, N, C]`.
    pub fn forward_features(&self, pixels: &Tensor) -> Result<Tensor> {
        self.norm.forward(&self.forward_blocks(pixels)?)
    }

    /// Tokens after all blocks, before the final norm: `[B, N, C]`.
    ///
    /// The blocks run on the flattened `[B·N, C]` tokens, attention being the ragged kernel over
    /// B sequences of N tokens (the same arithmetic as dense attention, without the head
    /// split/merge copies and the `[B, H, N, N]` scores). Head dims the kernel lacks fall back to
    /// the matmul-softmax-matmul attention.
    pub fn forward_blocks(&self, pixels: &Tensor) -> Result<Tensor> {
        self.blocks_on_tokens(&self.embed(pixels)?)
    }

    /// [`Self::forward_blocks`] from embedded tokens `[B, N, C]` (the output of [`Self::embed`]).
    pub fn blocks_on_tokens(&self, x: &Tensor) -> Result<Tensor> {
        self.run_blocks(x, false)
    }

    /// The prefix tokens (class, and distillation for distilled models) after all blocks,
    /// `[B, P, C]`, from embedded tokens `[B, N, C]`: what the head reads. For batches of more
    /// than one image the last block computes only those rows past its attention
    /// ([`Block::forward_prefix`], [`last_block_prefix_only`]); otherwise they are the first P
    /// rows of [`Self::blocks_on_tokens`].
    pub fn prefix_after_blocks(&self, x: &Tensor) -> Result<Tensor> {
        self.run_blocks(x, last_block_prefix_only(x.dim(0)?))
    }

    /// The blocks over embedded tokens: every token (`[B, N, C]`), or with `prefix_only` the
    /// prefix rows (`[B, P, C]`, the last block's MLP half on those rows only).
    fn run_blocks(&self, x: &Tensor, prefix_only: bool) -> Result<Tensor> {
        self.run_blocks_from(x, None, prefix_only)
    }

    /// [`Self::run_blocks`] with block 0's qkv of `x` when it was computed with the embedding
    /// ([`Self::embed_into_first_block`]).
    fn run_blocks_from(
        &self,
        x: &Tensor,
        qkv0: Option<Tensor>,
        prefix_only: bool,
    ) -> Result<Tensor> {
        let (b, n, c) = x.dims3()?;
        let p = self.config.num_prefix_tokens();
        let head_dim = self.config.head_dim();
        if !candle_ragged::SUPPORTED_HEAD_DIMS.contains(&head_dim) || n > candle_ragged::MAX_SEQ_LEN
        {
            let mut x = x.clone();
            for block in &self.blocks {
                x = block.forward(&x)?;
            }
            return if prefix_only {
                x.narrow(1, 0, p)
            } else {
                Ok(x)
            };
        }
        let batch = self.uniform_batches.get(b, n, x.device())?;
        let inputs = AttentionInputs::Ragged { batch: &batch };
        let mut x = x.reshape((b * n, c))?;
        let mut qkv = qkv0;
        let last = self.blocks.len().saturating_sub(1);
        for (i, block) in self.blocks.iter().enumerate() {
            if prefix_only && i == last {
                return block.forward_prefix(&x, qkv, &batch, p);
            }
            (x, qkv) = block.forward_chained(&x, qkv, self.blocks.get(i + 1), &inputs)?;
        }
        let x = x.reshape((b, n, c))?;
        if prefix_only {
            x.narrow(1, 0, p)
        } else {
            Ok(x)
        }
    }

    /// Logits `[B, num_classes]` from final-norm tokens `[B, N, C]`: `head(cls)`, or
    /// `(head(cls) + head_dist(dist)) / 2` for distilled models (their inference rule).
    pub fn forward_head(&self, features: &Tensor) -> Result<Tensor> {
        let cls = features.narrow(1, 0, 1)?.squeeze(1)?.contiguous()?;
        let logits = self.head.forward(&cls)?;
        match &self.head_dist {
            None => Ok(logits),
            Some(head_dist) => {
                let dist = features.narrow(1, 1, 1)?.squeeze(1)?.contiguous()?;
                (logits + head_dist.forward(&dist)?)? / 2.0
            }
        }
    }

    /// Logits `[B, num_classes]` from the tokens after the blocks `[B, N, C]`: the final norm on
    /// the class (and distillation) tokens only (the head reads nothing else), then the head.
    pub fn logits_from_blocks(&self, tokens: &Tensor) -> Result<Tensor> {
        self.logits_from_prefix(&tokens.narrow(1, 0, self.config.num_prefix_tokens())?)
    }

    /// Logits `[B, num_classes]` from the class (and distillation) tokens after the blocks,
    /// `[B, P, C]` before the final norm: each head reads its token's rows through
    /// `candle_fastpath::norm_linear`, which runs the norm inside the head's GEMM where that is
    /// faster (DeiT-T's width) and the two kernels elsewhere; the same as
    /// `forward_head(&norm(prefix))`.
    pub fn logits_from_prefix(&self, prefix: &Tensor) -> Result<Tensor> {
        let token = |i: usize| prefix.narrow(1, i, 1)?.squeeze(1)?.contiguous();
        let logits = candle_fastpath::norm_linear(&token(0)?, &self.norm, &self.head, false)?;
        match &self.head_dist {
            None => Ok(logits),
            Some(head_dist) => {
                let dist = candle_fastpath::norm_linear(&token(1)?, &self.norm, head_dist, false)?;
                (logits + dist)? / 2.0
            }
        }
    }

    /// Class probabilities `[B, num_classes]` in f32.
    pub fn probabilities(&self, pixels: &Tensor) -> Result<Tensor> {
        let logits = self.forward(pixels)?.to_dtype(DType::F32)?;
        candle_nn::ops::softmax(&logits, D::Minus1)
    }
}

impl Module for DeiT {
    /// Pixels `[B, 3, H, W]` → logits `[B, num_classes]`. The final norm runs on the class (and
    /// distillation) tokens only: the head reads nothing else. On the CPU it runs inside
    /// candle's pool (see `cpu_pool`).
    fn forward(&self, pixels: &Tensor) -> Result<Tensor> {
        crate::cpu_pool::in_cpu_pool(pixels.device(), || {
            let (x, qkv0) = self.embed_into_first_block(pixels)?;
            let prefix_only = last_block_prefix_only(x.dim(0)?);
            self.logits_from_prefix(&self.run_blocks_from(&x, qkv0, prefix_only)?)
        })
    }
}

/// [`DeiT::embed_residual`] from the loaded weights (`prefix`: [`DeiT::prefix_tokens`]): `[N, C]`
/// in the model's dtype.
fn embed_residual(patch_embed: &PatchEmbed, prefix: &Tensor, pos: &Tensor) -> Result<Tensor> {
    let (_, n, c) = pos.dims3()?;
    let dtype = pos.dtype();
    let prefix = prefix.to_dtype(DType::F32)?;
    let p = prefix.dim(0)?;
    let pos = pos.reshape((n, c))?.to_dtype(DType::F32)?;
    let rows = match patch_embed.proj.bias() {
        Some(bias) => (prefix + pos.narrow(0, 0, p)?)?
            .broadcast_sub(&bias.to_dtype(DType::F32)?.reshape((1, c))?)?,
        None => (prefix + pos.narrow(0, 0, p)?)?,
    };
    Tensor::cat(&[&rows, &pos.narrow(0, p, n - p)?], 0)?.to_dtype(dtype)
}
