//! [`TwoStageGraph`]: a pruned forward whose counts come from the scores, replayed from CUDA
//! graphs with one read of a single u32 per call.
//!
//! One captured graph ([`DeiT::forward_pruned_capturable`]) serves every keep pattern because its
//! packed tokens keep a capacity the host fixes beforehand; for the rules that may keep every
//! token (thresholds, mass shares) that capacity is every token, so every block after a step
//! still runs its matmuls over all `B·N` rows. Here the forward is cut right after its first
//! pruning step: the first graph runs the blocks before it and its selection, the host reads the
//! step's total (`cu_seqlens[B]`, one u32), and a second graph, captured for that total rounded
//! up to a bucket of rows, runs the rest over that many rows. Buckets are captured the first time
//! a total needs them, so a stream of inputs whose totals vary a little replays a few graphs.

use std::cell::RefCell;

use candle_core::Tensor;
use candle_fastpath::CapturedForward;

use crate::deit::DeiT;
use crate::error::ModelError;
use crate::on_device::PrunedTokens;
use crate::pruned::BlockPruner;

/// Buckets of rows over the first step's capacity (a bucket is `ceil(capacity / 32)` rows): the
/// rest of the forward runs over at most ~3 % of the capacity more rows than it needs.
const BUCKETS: usize = 32;

/// See the module docs. `replay` = [`DeiT::forward_pruned_capturable`]`(pixels).logits` (same
/// tokens kept; matmuls over fewer rows may round differently).
pub struct TwoStageGraph<'a> {
    model: &'a DeiT,
    pruners: &'a [BlockPruner],
    /// pixels → [the first step's tokens at its capacity, its `cu_seqlens`].
    first: CapturedForward,
    /// The first step's output as the eager warm-up made it: the block, site and length bound
    /// the second graphs continue from.
    step: PrunedTokens,
    bucket_rows: usize,
    /// Second graphs by their rows, [tokens, cu_seqlens] → [logits].
    rest: RefCell<Vec<(usize, CapturedForward)>>,
}

impl std::fmt::Debug for TwoStageGraph<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TwoStageGraph")
            .field("first", &self.first)
            .field("bucket_rows", &self.bucket_rows)
            .field("rest_graphs", &self.rest.borrow().len())
            .finish()
    }
}

impl<'a> TwoStageGraph<'a> {
    /// Captures the first graph for inputs shaped like `example` (`[B, 3, H, W]`, on a CUDA
    /// device); second graphs are captured on first need. An error off CUDA, for a schedule
    /// without a pruning step, and as [`DeiT::forward_pruned_capturable`].
    pub fn capture(
        model: &'a DeiT,
        example: &Tensor,
        pruners: &'a [BlockPruner],
    ) -> Result<Self, ModelError> {
        let step = model.forward_to_first_step(example, pruners)?;
        let first = CapturedForward::capture_many(std::slice::from_ref(example), |xs| {
            let t = model
                .forward_to_first_step(&xs[0], pruners)
                .map_err(candle_core::Error::wrap)?;
            Ok(vec![t.tokens().clone(), t.batch().cu_seqlens().clone()])
        })?;
        let bucket_rows = step.batch().total_tokens().div_ceil(BUCKETS).max(1);
        Ok(Self {
            model,
            pruners,
            first,
            step,
            bucket_rows,
            rest: RefCell::new(Vec::new()),
        })
    }

    /// Replays the forward on `pixels`: the first graph, one u32 read (waits for it), the
    /// second graph of the total's bucket (captured now if new). Returns the logits buffer,
    /// `[B, num_classes]`, which the next replay overwrites (copy it to keep it), and the rows
    /// the second graph ran over.
    pub fn replay(&self, pixels: &Tensor) -> Result<(Tensor, usize), ModelError> {
        self.first.replay(pixels)?;
        let [tokens, cu_seqlens] = self.first.outputs() else {
            unreachable!("the first graph has two outputs");
        };
        // SAFETY: both are the first graph's output buffers, which it has just written: the
        // selection's packed tokens at its capacity and its valid `cu_seqlens`.
        let step = unsafe { self.step.over(tokens.clone(), cu_seqlens.clone())? };
        let bucket = self.bucket_rows;
        let (fitted, _total) = step.fit(|total| total.div_ceil(bucket) * bucket)?;
        let rows = fitted.tokens().dim(0)?;
        let mut rest = self.rest.borrow_mut();
        let graph = match rest.iter().position(|(r, _)| *r == rows) {
            Some(i) => &rest[i].1,
            None => {
                let (model, pruners, step) = (self.model, self.pruners, &self.step);
                let examples = [fitted.tokens().clone(), cu_seqlens.clone()];
                let graph = CapturedForward::capture_many(&examples, |xs| {
                    // SAFETY: the graph's input buffers; every replay below fills them from
                    // the first graph's outputs, a valid `cu_seqlens` whose total (read above)
                    // is at most the rows of this bucket.
                    let t = unsafe { step.over(xs[0].clone(), xs[1].clone()) }
                        .map_err(candle_core::Error::wrap)?;
                    let logits = model
                        .forward_from_step(&t, pruners)
                        .map_err(candle_core::Error::wrap)?;
                    Ok(vec![logits])
                })?;
                rest.push((rows, graph));
                &rest[rest.len() - 1].1
            }
        };
        graph.replay_many(&[fitted.tokens(), cu_seqlens])?;
        Ok((graph.output().clone(), rows))
    }

    /// [`Self::replay`]'s logits, copied (later replays leave them alone).
    pub fn run(&self, pixels: &Tensor) -> Result<Tensor, ModelError> {
        Ok(self.replay(pixels)?.0.copy()?)
    }

    /// How many second graphs (buckets of rows) have been captured so far.
    pub fn captured_buckets(&self) -> usize {
        self.rest.borrow().len()
    }
}
