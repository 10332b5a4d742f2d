//! [`select_by_rule`]: a token-pruning step on a ragged batch whose counts depend on the scores
//! (adaptive thresholds, attention-mass shares, ATS's sampling): scores, the keep decision, the
//! row gathers and EViT's fused token in two kernels on CUDA, with one host read in between (the
//! new lengths: the host must know the new total to allocate the output). At small batches the
//! class-attention scores get a kernel of their own first, spread over (sequence, head) blocks.
//!
//! [`select_by_rule_bounded`]: the same step without the host read, for graph capture: a third,
//! one-block kernel turns the new lengths into `cu_seqlens` on the device, and the output keeps a
//! capacity bounded on the host from the rule ([`KeepRule::max_kept`]).
//!
//! The decision is [`KeepRule::keep`] itself on the CPU, and the same rule repeated operation for
//! operation in the CUDA kernel, so a host pruner's decision over the same scores is the same.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Tensor, WithDType};

use crate::batch::{RaggedBatch, MAX_SEQ_LEN};
use crate::error::{RaggedError, Result};
use crate::keep::{fusion_weights, KeepRule};
use crate::scores::{
    given_dims, given_on_cpu, score_source, sequence_scores, token_dims, ScoreSource, TokenScores,
};
use crate::select::DroppedFusion;

const OP: &str = "select_by_rule";

/// Per sequence of `batch` (packed rows of `x`): rows `0..prefix`, then the rows of
/// `prefix..len` that `rule` keeps given the scores, in ascending position, then (with `fusion`,
/// when some row is dropped) one row fusing the dropped ones, weighted by `max(score, 0)`
/// (NaN: 0) as [`DroppedFusion`] says; the weights of a mean are summed in f64 in position order
/// (the EViT pruner's host rule), the fused row in f32.
///
/// * `x` - `[total, C]` packed tokens, f32 / f16 / bf16, `total = batch.total_tokens()`.
/// * `scores` - [`TokenScores::Given`] takes `[B, S]` f32 with `S >= batch.max_len()`, sequence
///   `b`'s scores leading row `b` (an image-shaped score tensor); the computed ones read `x` or
///   a `qkv` laid out like `x`.
/// * every sequence must be longer than `prefix` (it has a patch to keep); at most
///   [`MAX_SEQ_LEN`] tokens.
///
/// Returns the new packed tokens `[total', C]` and their [`RaggedBatch`]. Reads `B` u32 back from
/// the device (the one host sync); everything else stays on the device. See
/// [`select_by_rule_bounded`] for the same step without that read.
pub fn select_by_rule(
    x: &Tensor,
    batch: &RaggedBatch,
    scores: TokenScores<'_>,
    prefix: usize,
    rule: KeepRule,
    fusion: Option<DroppedFusion>,
) -> Result<(Tensor, RaggedBatch)> {
    let (x, plan) = decide(x, batch, scores, prefix, rule, fusion)?;
    let b = batch.batch_size();
    let lengths: Vec<usize> = read_lengths(&plan, b)?
        .into_iter()
        .map(|l| l as usize)
        .collect();
    let new_batch = RaggedBatch::from_lengths(&lengths, x.device())?;
    gather(&x, &plan, batch, new_batch)
}

/// [`select_by_rule`] without the host read: the new lengths and `cu_seqlens` stay on the device
/// (a third, one-block kernel turns the lengths into offsets), and the new tokens get as many rows
/// as the host can bound without looking, so a forward built of these steps never waits on the GPU
/// and one CUDA graph of it serves every keep pattern.
///
/// Same arguments and the same kept rows, in the same order, as [`select_by_rule`]; `batch` may
/// itself have its lengths on the device only (the output of an earlier step). The returned batch
/// has its lengths on the device only ([`RaggedBatch::lengths_on_host`] is false):
/// * [`RaggedBatch::max_len`] = `prefix + min(n, m + fused)`, `n = batch.max_len() - prefix`, `m`
///   the most patches `rule` can keep out of `n` ([`KeepRule::max_kept`]), `fused` 1 with `fusion`;
/// * [`RaggedBatch::total_tokens`] (the rows of the returned tensor) = `min(batch.total_tokens(),
///   B · max_len)`; rows past the new `cu_seqlens[B]` hold zeros on the CPU and unspecified values
///   on CUDA.
///
/// With rules that can keep every token (thresholds, mass shares) the capacity does not shrink:
/// the following per-token ops then run over as many rows as before the step.
pub fn select_by_rule_bounded(
    x: &Tensor,
    batch: &RaggedBatch,
    scores: TokenScores<'_>,
    prefix: usize,
    rule: KeepRule,
    fusion: Option<DroppedFusion>,
) -> Result<(Tensor, RaggedBatch)> {
    let (x, plan) = decide(x, batch, scores, prefix, rule, fusion)?;
    let b = batch.batch_size();
    let n = batch.max_len() - prefix;
    let fused = fusion.is_some() as usize;
    let max_len = prefix + n.min(rule.max_kept(n) + fused);
    let rows = batch.total_tokens().min(b * max_len);
    let cu_seqlens = plan.apply_op1_no_bwd(&LengthsToOffsets { batch_size: b })?;
    let new_batch = RaggedBatch::with_device_lengths(cu_seqlens, b, rows, max_len);
    gather(&x, &plan, batch, new_batch)
}

/// The second kernel: `x`'s kept rows (and fused rows) per `plan` into `new_batch`'s layout.
fn gather(
    x: &Tensor,
    plan: &Tensor,
    batch: &RaggedBatch,
    new_batch: RaggedBatch,
) -> Result<(Tensor, RaggedBatch)> {
    let gather = Gather {
        batch: batch.clone(),
        new_batch,
    };
    let out = x.apply_op2_no_bwd(plan, &gather)?;
    Ok((out, gather.new_batch))
}

/// Checks, then the first kernel: `x` made contiguous and the plan (see [`plan_len`]).
fn decide(
    x: &Tensor,
    batch: &RaggedBatch,
    scores: TokenScores<'_>,
    prefix: usize,
    rule: KeepRule,
    fusion: Option<DroppedFusion>,
) -> Result<(Tensor, Tensor)> {
    let (rows, c) = token_dims(OP, x)?;
    if rows != batch.total_tokens() {
        return Err(RaggedError::TotalMismatch {
            op: OP,
            what: "x",
            expected: batch.total_tokens(),
            found: rows,
        });
    }
    if !batch.device().same_device(x.device()) {
        return Err(msg(format!(
            "x is on {:?} but the batch's cu_seqlens are on {:?}",
            x.device().location(),
            batch.device().location()
        )));
    }
    if c == 0 {
        return Err(msg("x has no channels".into()));
    }
    let b = batch.batch_size();
    // Lengths on the device only are not checked one by one (see first_sequence_at_most); their
    // bound still has to leave room for a patch.
    if let Some((index, len)) = batch.first_sequence_at_most(prefix) {
        return Err(msg(format!(
            "sequence {index} has {len} tokens: it needs more than the {prefix} prefix tokens"
        )));
    }
    if batch.max_len() <= prefix {
        return Err(msg(format!(
            "sequences of at most {} tokens: they need more than the {prefix} prefix tokens",
            batch.max_len()
        )));
    }
    if batch.max_len() > MAX_SEQ_LEN {
        return Err(RaggedError::SequenceTooLong {
            op: OP,
            len: batch.max_len(),
            limit: MAX_SEQ_LEN,
        });
    }
    let mut score_stride = 0;
    if let TokenScores::Given(s) = scores {
        let (sb, ss) = given_dims(OP, s)?;
        if sb != b || ss < batch.max_len() {
            return Err(RaggedError::ShapeMismatch {
                op: OP,
                what: "scores",
                expected: Shape::from((b, batch.max_len())),
                found: s.shape().clone(),
            });
        }
        score_stride = ss;
    }
    let (source, aux) = score_source(OP, scores, x, rows, c)?;
    rule.validate()?;

    let x = x.contiguous()?;
    // RowL2Norm reads only x; the op still takes two operands, so x stands in for the second.
    let aux = match aux {
        Some(a) => a.contiguous()?,
        None => x.clone(),
    };
    let decide = Decide {
        batch: batch.clone(),
        prefix,
        rule,
        fusion,
        source,
        score_stride,
    };
    let plan = x.apply_op2_no_bwd(&aux, &decide)?;
    Ok((x, plan))
}

fn msg(m: String) -> RaggedError {
    RaggedError::Candle(candle_core::Error::Msg(format!("{OP}: {m}")))
}

/// The plan's leading `b` entries (the new lengths), and nothing more, read back to the host.
fn read_lengths(plan: &Tensor, b: usize) -> Result<Vec<u32>> {
    #[cfg(feature = "cuda")]
    if plan.device().is_cuda() {
        return Ok(crate::cuda::read_u32_prefix(plan, b)?);
    }
    Ok(plan.narrow(0, 0, b)?.to_vec1::<u32>()?)
}

/// The plan's layout (u32, shared with the CUDA kernels): `[0, B)` new lengths, `[B, 2B)` 1 where
/// a fused row ends the sequence, `[2B, 2B + total)` each input row's slot in its sequence's
/// output (`-1` as u32: dropped), `[2B + total, 2B + 2·total)` the f32 bits of each row's weight
/// in the fused row (0 for kept rows).
pub(crate) fn plan_len(batch: usize, total: usize) -> usize {
    2 * batch + 2 * total
}

/// First kernel: scores, rule, plan (see [`plan_len`]).
pub(crate) struct Decide {
    pub batch: RaggedBatch,
    pub prefix: usize,
    pub rule: KeepRule,
    pub fusion: Option<DroppedFusion>,
    pub source: ScoreSource,
    /// Row stride of given scores (unused otherwise).
    pub score_stride: usize,
}

impl Decide {
    fn cpu<T: WithDType>(
        &self,
        x: &[T],
        qkv: Option<&[T]>,
        given: Option<&[f32]>,
        c: usize,
    ) -> candle_core::Result<Vec<u32>> {
        let b_count = self.batch.batch_size();
        let total = self.batch.total_tokens();
        let mut plan = vec![0u32; plan_len(b_count, total)];
        let (head, rest) = plan.split_at_mut(2 * b_count);
        let (slots, weights) = rest.split_at_mut(total);
        let p = self.prefix;
        for (b, w) in self.batch.offsets()?.windows(2).enumerate() {
            let (start, len) = (w[0] as usize, (w[1] - w[0]) as usize);
            let given = given.map(|g| &g[b * self.score_stride..]);
            let s = sequence_scores(self.source, x, qkv, given, c, start, len)?;
            let kept = self.rule.keep(&s, p, len);
            let mut flag = vec![false; len];
            kept.iter().for_each(|&j| flag[j] = true);
            let mut next = p;
            for j in 0..len {
                slots[start + j] = if j < p {
                    j as u32
                } else if flag[j] {
                    next += 1;
                    (next - 1) as u32
                } else {
                    u32::MAX
                };
            }
            let fused = self.fusion.filter(|_| kept.len() < len - p);
            head[b] = (p + kept.len() + fused.is_some() as usize) as u32;
            head[b_count + b] = fused.is_some() as u32;
            let Some(fusion) = fused else { continue };
            let dropped: Vec<usize> = (p..len).filter(|&j| !flag[j]).collect();
            for (&j, v) in dropped.iter().zip(fusion_weights(&s, &dropped, fusion)) {
                weights[start + j] = v.to_bits();
            }
        }
        Ok(plan)
    }
}

impl CustomOp2 for Decide {
    fn name(&self) -> &'static str {
        "select-by-rule-decide"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        s: &CpuStorage,
        ls: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, c) = lx.shape().dims2()?;
        let span = lx.start_offset()..lx.start_offset() + rows * c;
        let aux_span = ls.start_offset()..ls.start_offset() + ls.shape().elem_count();
        let given = given_on_cpu(OP, self.source, s, ls)?;
        macro_rules! run {
            ($variant:ident, $v:expr) => {{
                let qkv = match s {
                    CpuStorage::$variant(a) if self.source.reads_qkv() => Some(&a[aux_span]),
                    _ => None,
                };
                self.cpu(&$v[span], qkv, given, c)?
            }};
        }
        let plan = match x {
            CpuStorage::F32(v) => run!(F32, v),
            CpuStorage::F16(v) => run!(F16, v),
            CpuStorage::BF16(v) => run!(BF16, v),
            _ => candle_core::bail!("{OP}: unsupported dtype"),
        };
        let n = plan.len();
        Ok((CpuStorage::U32(plan), Shape::from(n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        s: &candle_core::CudaStorage,
        ls: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::select_decide(self, (x, lx), (s, ls))
    }
}

/// Second kernel: the kept rows to their slots and the fused rows, from the plan.
pub(crate) struct Gather {
    pub batch: RaggedBatch,
    pub new_batch: RaggedBatch,
}

impl Gather {
    fn cpu<T: WithDType>(&self, x: &[T], plan: &[u32], c: usize) -> candle_core::Result<Vec<T>> {
        let b_count = self.batch.batch_size();
        let total = self.batch.total_tokens();
        let slots = &plan[2 * b_count..2 * b_count + total];
        let weights = &plan[2 * b_count + total..];
        let mut out = vec![T::zero(); self.new_batch.total_tokens() * c];
        let (old, new) = (self.batch.offsets()?, self.new_batch.offsets()?);
        for b in 0..b_count {
            let (start, end, dst) = (old[b] as usize, old[b + 1] as usize, new[b] as usize);
            for j in start..end {
                if slots[j] != u32::MAX {
                    let r = dst + slots[j] as usize;
                    out[r * c..(r + 1) * c].copy_from_slice(&x[j * c..(j + 1) * c]);
                }
            }
            if plan[b_count + b] == 0 {
                continue;
            }
            let r = new[b + 1] as usize - 1;
            for ch in 0..c {
                let mut acc = 0f32;
                for j in (start..end).filter(|&j| slots[j] == u32::MAX) {
                    acc += f32::from_bits(weights[j]) * x[j * c + ch].to_f64() as f32;
                }
                out[r * c + ch] = T::from_f64(acc as f64);
            }
        }
        Ok(out)
    }
}

impl CustomOp2 for Gather {
    fn name(&self) -> &'static str {
        "select-by-rule-gather"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        plan: &CpuStorage,
        lp: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, c) = lx.shape().dims2()?;
        let x_span = lx.start_offset()..lx.start_offset() + rows * c;
        let plan = match plan {
            CpuStorage::U32(p) => {
                &p[lp.start_offset()..lp.start_offset() + lp.shape().elem_count()]
            }
            _ => candle_core::bail!("{OP}: the plan must be u32"),
        };
        let out = match x {
            CpuStorage::F32(v) => CpuStorage::F32(self.cpu(&v[x_span], plan, c)?),
            CpuStorage::F16(v) => CpuStorage::F16(self.cpu(&v[x_span], plan, c)?),
            CpuStorage::BF16(v) => CpuStorage::BF16(self.cpu(&v[x_span], plan, c)?),
            _ => candle_core::bail!("{OP}: unsupported dtype"),
        };
        Ok((out, Shape::from((self.new_batch.total_tokens(), c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        plan: &candle_core::CudaStorage,
        lp: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::select_gather(self, (x, lx), (plan, lp))
    }
}

/// Between the two kernels of [`select_by_rule_bounded`]: the plan's leading `B` new lengths to
/// the new `cu_seqlens` (`[B + 1]`, u32, starting at 0), on the device.
pub(crate) struct LengthsToOffsets {
    pub batch_size: usize,
}

impl CustomOp1 for LengthsToOffsets {
    fn name(&self) -> &'static str {
        "select-by-rule-offsets"
    }

    fn cpu_fwd(&self, plan: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let b = self.batch_size;
        let plan = match plan {
            CpuStorage::U32(p) => &p[l.start_offset()..l.start_offset() + b],
            _ => candle_core::bail!("{OP}: the plan must be u32"),
        };
        let mut offsets = Vec::with_capacity(b + 1);
        offsets.push(0u32);
        let mut total = 0u32;
        for &len in plan {
            total += len;
            offsets.push(total);
        }
        Ok((CpuStorage::U32(offsets), Shape::from(b + 1)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        plan: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::lengths_to_offsets(self.batch_size, plan, l)
    }
}
