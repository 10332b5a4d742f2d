//! [`step_scores`]: the scores of a fixed-count selection step laid out as candle-ragged's
//! select kernel reads them, for a kernel of another crate that runs the selection itself
//! (candle-fastpath's `select_mlp_block`, which ranks and gathers the kept tokens at the head of
//! a block's MLP half: lever 87 in `docs/LEVERS.md`). Both include the selection's
//! arithmetic from one header (`kernels/select_common.cuh`), so ranking these keeps the tokens
//! [`crate::select_top_k_by`] keeps and fuses the same bits.

use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};

use crate::batch::MAX_SEQ_LEN;
use crate::error::{RaggedError, Result};
use crate::scores::{given_dims, score_source, token_dims, ScoreSource, TokenScores};

const OP: &str = "step_scores";

/// How a [`StepScores`] tensor holds a sequence's scores: the `mode` of select_common.cuh's
/// `step_score`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepScoreLayout {
    /// `[B, len]`: the scores themselves (given, or computed on the CPU).
    Final,
    /// `[B, heads + 1, len]`: each head's class-token attention probabilities (rows
    /// `0..heads`), ranked by their mean (EViT); row `heads` holds the value rows' sums of
    /// squares.
    HeadProbs,
    /// As [`Self::HeadProbs`], ranked by the probabilities' sum times the square root of row
    /// `heads` (ATS's significance).
    HeadProbsTimesValueNorm,
}

impl StepScoreLayout {
    /// The selection kernels' `mode` argument (select_common.cuh's `step_score`).
    pub fn kernel_mode(self) -> i32 {
        match self {
            StepScoreLayout::Final => 0,
            StepScoreLayout::HeadProbs => 4,
            StepScoreLayout::HeadProbsTimesValueNorm => 5,
        }
    }
}

/// A fixed-count step's scores for `batch_size` sequences of `len` tokens ([`step_scores`]).
#[derive(Debug, Clone)]
pub struct StepScores {
    scores: Tensor,
    layout: StepScoreLayout,
    heads: usize,
    len: usize,
}

impl StepScores {
    /// f32, contiguous, shaped as [`Self::layout`] says.
    pub fn tensor(&self) -> &Tensor {
        &self.scores
    }

    pub fn layout(&self) -> StepScoreLayout {
        self.layout
    }

    /// The heads of the class attention (1 for [`StepScoreLayout::Final`]).
    pub fn heads(&self) -> usize {
        self.heads
    }

    /// Tokens per sequence.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true: a step has at least one token per sequence.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn batch_size(&self) -> usize {
        self.scores.dim(0).unwrap_or(0)
    }

    /// Scores another kernel computed in `layout`'s form with the arithmetic of this crate's
    /// (e.g. candle-fastpath's `attention_residual_with_cls_probs`, beside the attention):
    /// `scores` f32, `[B, len]` for [`StepScoreLayout::Final`], else `[B, heads + 1, len]`
    /// (`heads` ≥ 1). Made contiguous; anything else is an error.
    pub fn from_parts(scores: Tensor, layout: StepScoreLayout, heads: usize) -> Result<Self> {
        let bad = |what: String| msg(format!("from_parts: {what}"));
        if scores.dtype() != candle_core::DType::F32 {
            return Err(bad(format!("scores must be f32, got {:?}", scores.dtype())));
        }
        let len = match (layout, scores.dims()) {
            (StepScoreLayout::Final, &[_, len]) if heads == 1 => len,
            (
                StepScoreLayout::HeadProbs | StepScoreLayout::HeadProbsTimesValueNorm,
                &[_, rows, len],
            ) if heads >= 1 && rows == heads + 1 => len,
            _ => {
                return Err(bad(format!(
                    "{layout:?} with {heads} heads does not take shape {:?}",
                    scores.dims()
                )))
            }
        };
        if len == 0 || scores.dim(0)? == 0 {
            return Err(bad(format!("empty scores {:?}", scores.dims())));
        }
        Ok(Self {
            scores: scores.contiguous()?,
            layout,
            heads,
            len,
        })
    }
}

/// The scores [`crate::select_top_k_by`] would rank for `x` (`[batch_size·len, C]`, sequences
/// of equal length) and `scores`, as its CUDA kernel reads them: given scores as they are
/// ([`StepScoreLayout::Final`]); class attention and significance on CUDA as the per-head
/// probabilities its `cls_probs` kernel writes (one launch; [`StepScoreLayout::HeadProbs`] /
/// [`StepScoreLayout::HeadProbsTimesValueNorm`]), on the CPU as the final scores computed the
/// way the CPU select computes them. [`TokenScores::RowL2Norm`] is not taken (a block that
/// wants its norms ranked elsewhere computes them itself: candle-fastpath's
/// `attention_block_with_norms`).
pub fn step_scores(x: &Tensor, batch_size: usize, scores: TokenScores<'_>) -> Result<StepScores> {
    let (rows, c) = token_dims(OP, x)?;
    if batch_size == 0 || rows == 0 || rows % batch_size != 0 {
        return Err(msg(format!(
            "x [{rows}, {c}] does not split into {batch_size} sequences of equal length"
        )));
    }
    let len = rows / batch_size;
    if len > MAX_SEQ_LEN {
        return Err(RaggedError::SequenceTooLong {
            op: OP,
            len,
            limit: MAX_SEQ_LEN,
        });
    }
    if let TokenScores::Given(s) = scores {
        let (b, l) = given_dims(OP, s)?;
        if (b, l) != (batch_size, len) {
            return Err(RaggedError::ShapeMismatch {
                op: OP,
                what: "scores",
                expected: Shape::from((batch_size, len)),
                found: s.shape().clone(),
            });
        }
    }
    let (source, aux) = score_source(OP, scores, x, rows, c)?;
    let (heads, layout) =
        match source {
            ScoreSource::Given => {
                let aux = aux.ok_or_else(|| msg("given scores missing".into()))?;
                if !aux.device().same_device(x.device()) {
                    return Err(msg("the scores are not on x's device".into()));
                }
                return Ok(StepScores {
                    scores: aux.contiguous()?,
                    layout: StepScoreLayout::Final,
                    heads: 1,
                    len,
                });
            }
            ScoreSource::RowL2Norm => return Err(msg(
                "row L2 norms are not taken here (use select_top_k_by, or rank norms the block \
                 before computed as given scores)"
                    .into(),
            )),
            ScoreSource::ClsAttention { heads, .. } => (heads, StepScoreLayout::HeadProbs),
            ScoreSource::Significance { heads, .. } => {
                (heads, StepScoreLayout::HeadProbsTimesValueNorm)
            }
        };
    let qkv = aux.ok_or_else(|| msg("qkv missing".into()))?.contiguous()?;
    if !qkv.device().same_device(x.device()) {
        return Err(msg("qkv is not on x's device".into()));
    }
    let op = StepScoresOp {
        batch_size,
        len,
        c,
        source,
    };
    let out = x.contiguous()?.apply_op2_no_bwd(&qkv, &op)?;
    Ok(if x.device().is_cuda() {
        StepScores {
            scores: out.reshape((batch_size, heads + 1, len))?,
            layout,
            heads,
            len,
        }
    } else {
        StepScores {
            scores: out.reshape((batch_size, len))?,
            layout: StepScoreLayout::Final,
            heads: 1,
            len,
        }
    })
}

fn msg(m: String) -> RaggedError {
    RaggedError::Candle(candle_core::Error::Msg(format!("{OP}: {m}")))
}

/// The op behind [`step_scores`] for the scores computed from `qkv` (its second operand).
struct StepScoresOp {
    batch_size: usize,
    len: usize,
    c: usize,
    source: ScoreSource,
}

impl CustomOp2 for StepScoresOp {
    fn name(&self) -> &'static str {
        "step-scores"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        qkv: &CpuStorage,
        lq: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let span = lx.start_offset()..lx.start_offset() + lx.shape().elem_count();
        let qspan = lq.start_offset()..lq.start_offset() + lq.shape().elem_count();
        macro_rules! run {
            ($variant:ident, $v:expr) => {{
                let CpuStorage::$variant(q) = qkv else {
                    candle_core::bail!("{OP}: qkv must have x's dtype");
                };
                let (xs, qs) = (&$v[span], &q[qspan]);
                let mut out = Vec::with_capacity(self.batch_size * self.len);
                for b in 0..self.batch_size {
                    out.extend(crate::scores::sequence_scores(
                        self.source,
                        xs,
                        Some(qs),
                        None,
                        self.c,
                        b * self.len,
                        self.len,
                    )?);
                }
                out
            }};
        }
        let out = match x {
            CpuStorage::F32(v) => run!(F32, v),
            CpuStorage::F16(v) => run!(F16, v),
            CpuStorage::BF16(v) => run!(BF16, v),
            _ => candle_core::bail!("{OP}: unsupported dtype"),
        };
        Ok((
            CpuStorage::F32(out),
            Shape::from(self.batch_size * self.len),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _x: &candle_core::CudaStorage,
        _lx: &Layout,
        qkv: &candle_core::CudaStorage,
        lq: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (heads, scale) = match self.source {
            ScoreSource::ClsAttention { heads, scale }
            | ScoreSource::Significance { heads, scale } => (heads, scale),
            _ => candle_core::bail!("{OP}: only class-attention scores are computed here"),
        };
        // Row `heads` (the value rows' sums of squares) always: the tensor is wholly written.
        let buf = crate::cuda::class_attention_probs(
            (qkv, lq),
            self.batch_size,
            self.len,
            self.c,
            heads as i32,
            scale,
            true,
        )?;
        let elems = self.batch_size * (heads + 1) * self.len;
        Ok((
            candle_core::CudaStorage::wrap_cuda_slice(buf, qkv.device.clone()),
            Shape::from(elems),
        ))
    }
}
