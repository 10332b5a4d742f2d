//! [`TokenScores`]: where a token-selection op ([`crate::select_top_k_by`],
//! [`crate::select_by_rule`]) takes each token's score from: given, or computed inside the op (one
//! kernel on CUDA for a whole pruning step, where computing the scores as tensor ops first would
//! take four to eight more small launches).

use candle_core::{DType, Shape, Tensor, WithDType};

use crate::batch::MAX_SEQ_LEN;
use crate::error::{RaggedError, Result};

/// Where a selection op takes each token's score from.
#[derive(Debug, Clone, Copy)]
pub enum TokenScores<'a> {
    /// `[B, S]` f32, image-shaped: row `b` holds sequence `b`'s scores in its leading entries
    /// (each op says which `S` it takes).
    Given(&'a Tensor),
    /// The L2 norm of each row of `x`, summed in f32 (Threshold-L2's score).
    RowL2Norm,
    /// The class token's attention averaged over heads (EViT's score), from the fused
    /// projection `qkv` (`[rows, 3·C]`, rows laid out as `x`'s: q, k, v blocks of
    /// `C = heads · head_dim` columns, `C` the width of `x`, the class token first in each
    /// sequence): per head `softmax_j(r(r(q_cls · scale) · k_j))`, `r` rounding to the dtype of
    /// `qkv` as that dtype's matmul would, softmax in f32, then the mean over heads.
    ClsAttention {
        qkv: &'a Tensor,
        heads: usize,
        scale: f32,
    },
    /// ATS's significance: the same class-token attention summed over heads (in head order),
    /// times the L2 norm of each token's value vector (the `v` block of `qkv`, all heads), in f32.
    Significance {
        qkv: &'a Tensor,
        heads: usize,
        scale: f32,
    },
}

/// How an op gets its scores; its second operand is the scores, `qkv`, or unused.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum ScoreSource {
    Given,
    RowL2Norm,
    ClsAttention { heads: usize, scale: f32 },
    Significance { heads: usize, scale: f32 },
}

impl ScoreSource {
    /// The kernels' `mode` and its `heads` / `scale` arguments.
    #[cfg(feature = "cuda")]
    pub(crate) fn kernel_args(self) -> (i32, i32, f32) {
        match self {
            ScoreSource::Given => (0, 1, 1.0),
            ScoreSource::RowL2Norm => (1, 1, 1.0),
            ScoreSource::ClsAttention { heads, scale } => (2, heads as i32, scale),
            ScoreSource::Significance { heads, scale } => (3, heads as i32, scale),
        }
    }

    /// Whether the second operand is `qkv` (same dtype as `x`).
    pub(crate) fn reads_qkv(self) -> bool {
        matches!(
            self,
            ScoreSource::ClsAttention { .. } | ScoreSource::Significance { .. }
        )
    }
}

/// The `[rows, C]` of a selection op's tokens `x`, which must be rank 2 and f32 / f16 / bf16.
pub(crate) fn token_dims(op: &'static str, x: &Tensor) -> Result<(usize, usize)> {
    if x.rank() != 2 {
        return Err(RaggedError::Rank {
            op,
            what: "x",
            expected: 2,
            shape: x.shape().clone(),
        });
    }
    if !matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        return Err(RaggedError::UnsupportedDType {
            op,
            dtype: x.dtype(),
        });
    }
    Ok(x.dims2()?)
}

/// The `[B, S]` of given scores, which must be rank 2.
pub(crate) fn given_dims(op: &'static str, s: &Tensor) -> Result<(usize, usize)> {
    s.dims2().map_err(|_| RaggedError::Rank {
        op,
        what: "scores",
        expected: 2,
        shape: s.shape().clone(),
    })
}

/// Checks `scores` against `x` (`[rows, c]`) apart from a given tensor's shape, which each op
/// checks itself, and returns the source and the op's second operand.
pub(crate) fn score_source<'a>(
    op: &'static str,
    scores: TokenScores<'a>,
    x: &Tensor,
    rows: usize,
    c: usize,
) -> Result<(ScoreSource, Option<&'a Tensor>)> {
    let msg = |m: String| RaggedError::Candle(candle_core::Error::Msg(format!("{op}: {m}")));
    let (source, aux) = match scores {
        TokenScores::Given(s) => {
            if s.dtype() != DType::F32 {
                return Err(msg(format!("scores must be f32, got {:?}", s.dtype())));
            }
            (ScoreSource::Given, Some(s))
        }
        TokenScores::RowL2Norm => (ScoreSource::RowL2Norm, None),
        TokenScores::ClsAttention { qkv, heads, scale }
        | TokenScores::Significance { qkv, heads, scale } => {
            if qkv.dims() != [rows, 3 * c] {
                return Err(RaggedError::ShapeMismatch {
                    op,
                    what: "qkv",
                    expected: Shape::from((rows, 3 * c)),
                    found: qkv.shape().clone(),
                });
            }
            if qkv.dtype() != x.dtype() {
                return Err(msg(format!(
                    "qkv is {:?} but x is {:?}",
                    qkv.dtype(),
                    x.dtype()
                )));
            }
            if heads == 0 || !c.is_multiple_of(heads) {
                return Err(msg(format!("{heads} heads do not divide {c} channels")));
            }
            // The CUDA kernel keeps one head's query (and its logits) in shared memory.
            if c / heads > MAX_SEQ_LEN {
                return Err(msg(format!(
                    "head_dim {} is over the supported {MAX_SEQ_LEN}",
                    c / heads
                )));
            }
            if !scale.is_finite() {
                return Err(msg(format!("softmax scale must be finite, got {scale}")));
            }
            let source = match scores {
                TokenScores::ClsAttention { .. } => ScoreSource::ClsAttention { heads, scale },
                _ => ScoreSource::Significance { heads, scale },
            };
            (source, Some(qkv))
        }
    };
    if let Some(a) = aux {
        if !a.device().same_device(x.device()) {
            return Err(msg(format!(
                "scores are on {:?} but x is on {:?}",
                a.device().location(),
                x.device().location()
            )));
        }
    }
    Ok((source, aux))
}

/// On the CPU: the given scores of a selection op's second operand (the whole `[B, S]` f32
/// slice), `None` for computed scores.
pub(crate) fn given_on_cpu<'a>(
    op: &str,
    source: ScoreSource,
    s: &'a candle_core::CpuStorage,
    ls: &candle_core::Layout,
) -> candle_core::Result<Option<&'a [f32]>> {
    let span = ls.start_offset()..ls.start_offset() + ls.shape().elem_count();
    match (source, s) {
        (ScoreSource::Given, candle_core::CpuStorage::F32(v)) => Ok(Some(&v[span])),
        (ScoreSource::Given, _) => candle_core::bail!("{op}: scores must be f32"),
        _ => Ok(None),
    }
}

/// One sequence's scores on the CPU, computed as the CUDA kernel computes them: the `len` rows
/// from `start` of the packed `x` (`[rows, c]`) or of `qkv` (`[rows, 3c]`), or `given`, that
/// sequence's row of given scores.
pub(crate) fn sequence_scores<T: WithDType>(
    source: ScoreSource,
    x: &[T],
    qkv: Option<&[T]>,
    given: Option<&[f32]>,
    c: usize,
    start: usize,
    len: usize,
) -> candle_core::Result<Vec<f32>> {
    let f = |v: T| v.to_f64() as f32;
    // Rounding to T, as a T matmul's output or a T product is rounded.
    let r = |v: f32| T::from_f64(v as f64).to_f64() as f32;
    let missing = |what: &str| candle_core::Error::Msg(format!("token scores: no {what}"));
    Ok(match source {
        ScoreSource::Given => given.ok_or_else(|| missing("scores"))?[..len].to_vec(),
        ScoreSource::RowL2Norm => x[start * c..(start + len) * c]
            .chunks(c)
            .map(|row| row.iter().map(|&v| f(v) * f(v)).sum::<f32>().sqrt())
            .collect(),
        ScoreSource::ClsAttention { heads, scale } | ScoreSource::Significance { heads, scale } => {
            let qkv = qkv.ok_or_else(|| missing("qkv"))?;
            let d = c / heads;
            let seq = &qkv[start * 3 * c..(start + len) * 3 * c];
            let mut sc = vec![0f32; len];
            let mut logits = vec![0f32; len];
            for h in 0..heads {
                let q: Vec<f32> = (0..d).map(|i| r(f(seq[h * d + i]) * scale)).collect();
                for (j, l) in logits.iter_mut().enumerate() {
                    let k = &seq[j * 3 * c + c + h * d..j * 3 * c + c + (h + 1) * d];
                    *l = r(q.iter().zip(k).map(|(&a, &b)| a * f(b)).sum());
                }
                let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let sum: f32 = logits.iter().map(|&l| (l - m).exp()).sum();
                for (s, &l) in sc.iter_mut().zip(&logits) {
                    *s += (l - m).exp() / sum;
                }
            }
            if matches!(source, ScoreSource::ClsAttention { .. }) {
                let inv = 1.0 / heads as f32;
                sc.iter_mut().for_each(|s| *s *= inv);
            } else {
                for (j, s) in sc.iter_mut().enumerate() {
                    let v = &seq[j * 3 * c + 2 * c..(j + 1) * 3 * c];
                    *s *= v.iter().map(|&e| f(e) * f(e)).sum::<f32>().sqrt();
                }
            }
            sc
        }
    })
}
