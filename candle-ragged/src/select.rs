//! [`select_top_k`]: token pruning on the device. For `B` packed sequences of equal length, keep
//! each one's leading tokens and its `keep` best-scoring others, in ascending position, as one
//! op (one kernel on CUDA, replacing a sort, gathers and a concatenation), with no host sync: the
//! output size is known from the arguments alone.

use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};

use crate::batch::MAX_SEQ_LEN;
use crate::error::{RaggedError, Result};
use crate::scores::{
    given_dims, given_on_cpu, score_source, sequence_scores, token_dims, ScoreSource, TokenScores,
};

const OP: &str = "select_top_k";

/// The extra token built from the dropped ones (EViT's "fused" token).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DroppedFusion {
    /// `Σ w_j x_j / Σ w_j` over the dropped tokens, `w_j = max(score_j, 0)`; the plain mean when
    /// every weight is 0.
    WeightedMean,
    /// `Σ w_j x_j` over the dropped tokens.
    WeightedSum,
}

/// Per sequence of `len = x.dim(0) / B` tokens: rows `0..prefix`, then the `keep` rows of
/// `prefix..len` with the highest scores in ascending position, then (with `fusion`, when some
/// row is dropped) one row fusing the dropped ones.
///
/// * `x` - `[B·len, C]` packed tokens, f32 / f16 / bf16, rows contiguous.
/// * `scores` - `[B, len]` f32 (entries at prefix positions are ignored). Order: f32's total
///   order with NaN lowest, ties to the lower position (the host pruners' rule).
/// * `keep` - in `1..=len - prefix`.
///
/// Returns `[B·len', C]`, `len' = prefix + keep (+ 1)`, and `len'`.
pub fn select_top_k(
    x: &Tensor,
    scores: &Tensor,
    prefix: usize,
    keep: usize,
    fusion: Option<DroppedFusion>,
) -> Result<(Tensor, usize)> {
    // select_top_k_by checks the scores' rank and shape (a rank-0 tensor gets a batch of 0 here).
    let batch_size = scores.dims().first().copied().unwrap_or(0);
    select_top_k_by(
        x,
        batch_size,
        TokenScores::Given(scores),
        prefix,
        keep,
        fusion,
    )
}

/// [`select_top_k`] with the scores computed inside the op from `x` or from the attention's
/// `qkv` ([`TokenScores`]): one kernel on CUDA for a whole pruning step, where computing the
/// scores as tensor ops first would take four to eight more small launches.
///
/// * `x` - `[batch_size·len, C]` packed tokens, f32 / f16 / bf16.
///
/// Returns `[batch_size·len', C]` and `len'`, as [`select_top_k`].
pub fn select_top_k_by(
    x: &Tensor,
    batch_size: usize,
    scores: TokenScores<'_>,
    prefix: usize,
    keep: usize,
    fusion: Option<DroppedFusion>,
) -> Result<(Tensor, usize)> {
    let (op, x, aux, new_len) = select_op(x, batch_size, scores, prefix, keep, fusion)?;
    Ok((x.apply_op2_no_bwd(&aux, &op)?, new_len))
}

/// [`select_top_k_by`] without fusion that also gathers the same rows of a second tensor `also`
/// (`[batch_size·len, C2]`, x's dtype and device), in the same launch: e.g. the next block's qkv
/// projection of `x` when it was computed before the step (a LayerNorm and a Linear work row by
/// row, so the projection of the kept rows is the kept rows of the projection).
///
/// Returns `[batch_size·len', C]`, `[batch_size·len', C2]` and `len' = prefix + keep`.
pub fn select_top_k_gathering(
    x: &Tensor,
    also: &Tensor,
    batch_size: usize,
    scores: TokenScores<'_>,
    prefix: usize,
    keep: usize,
) -> Result<(Tensor, Tensor, usize)> {
    let (rows, c) = token_dims(OP, x)?;
    let (also_rows, c2) = token_dims(OP, also)?;
    if also_rows != rows || also.dtype() != x.dtype() || !also.device().same_device(x.device()) {
        return Err(msg(format!(
            "also [{also_rows}, {c2}] {:?} must have x's {rows} rows, dtype ({:?}) and device",
            also.dtype(),
            x.dtype()
        )));
    }
    let (mut op, x, aux, new_len) = select_op(x, batch_size, scores, prefix, keep, None)?;
    op.also = Some(also.contiguous()?);
    let both = x.apply_op2_no_bwd(&aux, &op)?;
    let out_rows = batch_size * new_len;
    let kept = both.narrow(0, 0, out_rows * c)?.reshape((out_rows, c))?;
    let kept_also = both
        .narrow(0, out_rows * c, out_rows * c2)?
        .reshape((out_rows, c2))?;
    Ok((kept, kept_also, new_len))
}

/// The checks of [`select_top_k_by`] and its op (without `also`), with x contiguous, the op's
/// second operand and the new length.
fn select_op(
    x: &Tensor,
    batch_size: usize,
    scores: TokenScores<'_>,
    prefix: usize,
    keep: usize,
    fusion: Option<DroppedFusion>,
) -> Result<(SelectTopK, Tensor, Tensor, usize)> {
    let (rows, c) = token_dims(OP, x)?;
    // Given scores fix the layout themselves: checked first, so a mismatch names their shape.
    if let TokenScores::Given(s) = scores {
        let (b, len) = given_dims(OP, s)?;
        if rows != b * len || b != batch_size {
            return Err(RaggedError::ShapeMismatch {
                op: OP,
                what: "x",
                expected: Shape::from((b * len, c)),
                found: x.shape().clone(),
            });
        }
    }
    if batch_size == 0 || rows == 0 || rows % batch_size != 0 {
        return Err(msg(format!(
            "x [{rows}, {c}] does not split into {batch_size} sequences of equal length"
        )));
    }
    let len = rows / batch_size;
    let (source, aux) = score_source(OP, scores, x, rows, c)?;
    if len > MAX_SEQ_LEN {
        return Err(RaggedError::SequenceTooLong {
            op: OP,
            len,
            limit: MAX_SEQ_LEN,
        });
    }
    if prefix >= len || keep == 0 || keep > len - prefix {
        return Err(msg(format!(
            "need prefix < len and 1 <= keep <= len - prefix, got prefix {prefix}, keep {keep}, \
             len {len}"
        )));
    }
    let fuse = fusion.filter(|_| keep < len - prefix);
    let new_len = prefix + keep + fuse.is_some() as usize;
    let op = SelectTopK {
        len,
        prefix,
        keep,
        fusion: fuse,
        source,
        also: None,
    };
    let x = x.contiguous()?;
    // RowL2Norm reads only x; the op still takes two operands, so x stands in for the second.
    let aux = match aux {
        Some(a) => a.contiguous()?,
        None => x.clone(),
    };
    Ok((op, x, aux, new_len))
}

fn msg(m: String) -> RaggedError {
    RaggedError::Candle(candle_core::Error::Msg(format!("{OP}: {m}")))
}

/// The op behind [`select_top_k`] (arguments checked there).
pub(crate) struct SelectTopK {
    pub len: usize,
    pub prefix: usize,
    pub keep: usize,
    pub fusion: Option<DroppedFusion>,
    pub source: ScoreSource,
    /// [`select_top_k_gathering`]'s second tensor `[B·len, C2]` (contiguous, x's dtype and
    /// device): its kept rows follow x's in the output (one 1-D buffer), never with `fusion`.
    pub also: Option<Tensor>,
}

impl SelectTopK {
    pub(crate) fn out_len(&self) -> usize {
        self.prefix + self.keep + self.fusion.is_some() as usize
    }

    /// Output row (within the sequence) of every input row, `None` when dropped.
    fn rows(&self, s: &[f32]) -> Vec<Option<usize>> {
        let key = |j: usize| {
            let v = if s[j].is_nan() {
                f32::NEG_INFINITY
            } else {
                s[j]
            };
            (v, j)
        };
        let mut order: Vec<usize> = (self.prefix..self.len).collect();
        // Descending total order, ties to the lower position.
        order.sort_unstable_by(|&a, &b| {
            let (ka, kb) = (key(a), key(b));
            kb.0.total_cmp(&ka.0).then(ka.1.cmp(&kb.1))
        });
        let mut kept = vec![false; self.len];
        for &j in &order[..self.keep] {
            kept[j] = true;
        }
        let mut next = self.prefix;
        (0..self.len)
            .map(|j| {
                if j < self.prefix {
                    Some(j)
                } else if kept[j] {
                    next += 1;
                    Some(next - 1)
                } else {
                    None
                }
            })
            .collect()
    }

    /// The `[B·len]` scores of the CPU path: given, or computed as the CUDA kernel does.
    fn cpu_scores<T: candle_core::WithDType>(
        &self,
        x: &[T],
        aux: Option<&[T]>,
        given: Option<&[f32]>,
        c: usize,
    ) -> candle_core::Result<Vec<f32>> {
        let b_count = x.len() / c / self.len;
        let mut out = Vec::with_capacity(b_count * self.len);
        for b in 0..b_count {
            let given = given.map(|g| &g[b * self.len..]);
            out.extend(sequence_scores(
                self.source,
                x,
                aux,
                given,
                c,
                b * self.len,
                self.len,
            )?);
        }
        Ok(out)
    }

    /// The kept rows of `x` (`[B·len, c]`), then those of `also` (`[B·len, c2]`) when given.
    fn cpu<T: candle_core::WithDType>(
        &self,
        x: &[T],
        scores: &[f32],
        c: usize,
        also: Option<(&[T], usize)>,
    ) -> Vec<T> {
        let b_count = scores.len() / self.len;
        let out_len = self.out_len();
        let c2 = also.map_or(0, |(_, c2)| c2);
        let mut out = vec![T::zero(); b_count * out_len * (c + c2)];
        let (main, rest) = out.split_at_mut(b_count * out_len * c);
        for b in 0..b_count {
            let s = &scores[b * self.len..(b + 1) * self.len];
            let xb = &x[b * self.len * c..(b + 1) * self.len * c];
            let ob = &mut main[b * out_len * c..(b + 1) * out_len * c];
            let rows = self.rows(s);
            for (j, r) in rows.iter().enumerate() {
                if let Some(r) = r {
                    ob[r * c..(r + 1) * c].copy_from_slice(&xb[j * c..(j + 1) * c]);
                    if let Some((a, c2)) = also {
                        let src = (b * self.len + j) * c2;
                        let dst = (b * out_len + r) * c2;
                        rest[dst..dst + c2].copy_from_slice(&a[src..src + c2]);
                    }
                }
            }
            let Some(fusion) = self.fusion else { continue };
            let weight = |v: f32| if v.is_nan() { 0.0 } else { v.max(0.0) };
            let dropped: Vec<usize> = (self.prefix..self.len)
                .filter(|&j| rows[j].is_none())
                .collect();
            let total: f32 = dropped.iter().map(|&j| weight(s[j])).sum();
            let dst = (self.prefix + self.keep) * c;
            for ch in 0..c {
                let (mut acc, mut plain) = (0f32, 0f32);
                for &j in &dropped {
                    let v = xb[j * c + ch].to_f64() as f32;
                    acc += weight(s[j]) * v;
                    plain += v;
                }
                let f = match fusion {
                    DroppedFusion::WeightedSum => acc,
                    DroppedFusion::WeightedMean if total > 0.0 => acc / total,
                    DroppedFusion::WeightedMean => plain / dropped.len() as f32,
                };
                ob[dst + ch] = T::from_f64(f as f64);
            }
        }
        out
    }
}

impl CustomOp2 for SelectTopK {
    fn name(&self) -> &'static str {
        "select-top-k"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        s: &CpuStorage,
        ls: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, c) = lx.shape().dims2()?;
        let b = rows / self.len;
        let span = lx.start_offset()..lx.start_offset() + rows * c;
        let aux_span = ls.start_offset()..ls.start_offset() + ls.shape().elem_count();
        let given = given_on_cpu(OP, self.source, s, ls)?;
        let also_guard = self.also.as_ref().map(|t| t.storage_and_layout());
        macro_rules! run {
            ($variant:ident, $v:expr) => {{
                let xs = &$v[span];
                let aux = match s {
                    CpuStorage::$variant(a) => Some(&a[aux_span.clone()]),
                    _ => None,
                };
                let scores = self.cpu_scores(xs, aux, given, c)?;
                let also = match &also_guard {
                    Some((storage, layout)) => match &**storage {
                        candle_core::Storage::Cpu(CpuStorage::$variant(a)) => {
                            let (r, c2) = layout.shape().dims2()?;
                            let start = layout.start_offset();
                            Some((&a[start..start + r * c2], c2))
                        }
                        _ => candle_core::bail!("{OP}: `also` must be a CPU tensor of x's dtype"),
                    },
                    None => None,
                };
                CpuStorage::$variant(self.cpu(xs, &scores, c, also))
            }};
        }
        let out = match x {
            CpuStorage::F32(v) => run!(F32, v),
            CpuStorage::F16(v) => run!(F16, v),
            CpuStorage::BF16(v) => run!(BF16, v),
            _ => candle_core::bail!("{OP}: unsupported dtype"),
        };
        let shape = match &self.also {
            Some(a) => Shape::from(b * self.out_len() * (c + a.dim(1)?)),
            None => Shape::from((b * self.out_len(), c)),
        };
        Ok((out, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        s: &candle_core::CudaStorage,
        ls: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::select_top_k(self, (x, lx), (s, ls))
    }
}
