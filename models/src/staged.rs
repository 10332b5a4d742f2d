//! [`StagedGraph`]: a pruned forward whose counts come from the scores, replayed from CUDA
//! graphs with a read of one u32 after its first pruning step, or after every step.
//!
//! One captured graph ([`DeiT::forward_pruned_capturable`]) serves every keep pattern because its
//! packed tokens keep a capacity the host fixes beforehand; for the rules that may keep every
//! token (thresholds, mass shares) that capacity is every token, so every block after a step
//! still runs its matmuls over all `B·N` rows. Here the forward is cut right after a step's
//! selection: one graph runs up to it, the host reads the step's total (`cu_seqlens[B]`), and the
//! next graph, captured for that total rounded up to a bucket of rows, continues over that many
//! rows. [`Reads::First`] cuts after the first step only (two graphs per call); with
//! [`Reads::EveryStep`] each later step is cut the same way (one graph and one read per step,
//! plus the last graph), so every block runs over about the rows it needs, as the eager path
//! with exact counts does, without its host launch cost. Each read waits for the GPU, which then
//! idles until the host launches the next graph (a few µs): a cost at batch 1, not at 64.
//!
//! Buckets are captured the first time a total needs them, so a stream of inputs whose totals
//! vary a little replays a few graphs per stage.

use std::cell::RefCell;
use std::rc::Rc;

use candle_core::Tensor;
use candle_fastpath::CapturedForward;

use crate::deit::DeiT;
use crate::error::ModelError;
use crate::on_device::PrunedTokens;
use crate::pruned::BlockPruner;

/// A bucket is `ceil(capacity / BUCKETS)` rows of the first step's capacity: a stage runs over
/// at most that many rows more than its total.
const BUCKETS: usize = 32;

/// `total` rounded up to a multiple of `bucket_rows`: the rows a stage runs over.
fn bucket_of(total: usize, bucket_rows: usize) -> usize {
    total.div_ceil(bucket_rows) * bucket_rows
}

/// A step's output as a graph returns it: [tokens, cu_seqlens].
fn step_outputs(t: &PrunedTokens) -> Vec<Tensor> {
    vec![t.tokens().clone(), t.batch().cu_seqlens().clone()]
}

/// One stage's captured graphs, by the rows of their input.
type StageGraphs = Vec<(usize, Rc<CapturedForward>)>;

/// After which pruning steps a [`StagedGraph`] reads the total back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reads {
    /// After the first step only: two graphs per call; later steps keep its capacity.
    First,
    /// After every step: one graph per step plus one, a read between each two.
    EveryStep,
}

/// See the module docs. `replay` = [`DeiT::forward_pruned_capturable`]`(pixels).logits` (same
/// tokens kept; matmuls over fewer rows may round differently).
pub struct StagedGraph<'a> {
    model: &'a DeiT,
    pruners: &'a [BlockPruner],
    /// pixels → [the first step's tokens at its capacity, its `cu_seqlens`].
    first: CapturedForward,
    /// Per stage (the step read after), that step's output as an eager warm-up made it: the
    /// block, site and length bound the stage's graphs continue from.
    steps: Vec<PrunedTokens>,
    bucket_rows: usize,
    /// Per stage, graphs by their input rows: [tokens, cu_seqlens] → the next step's [tokens,
    /// cu_seqlens], or [logits] for the last stage.
    graphs: RefCell<Vec<StageGraphs>>,
}

impl std::fmt::Debug for StagedGraph<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagedGraph")
            .field("first", &self.first)
            .field("stages", &self.steps.len())
            .field("bucket_rows", &self.bucket_rows)
            .field("captured", &self.captured_graphs())
            .finish()
    }
}

impl<'a> StagedGraph<'a> {
    /// Captures the first graph for inputs shaped like `example` (`[B, 3, H, W]`, on a CUDA
    /// device); the later graphs are captured on first need. An error off CUDA, for a schedule
    /// without a pruning step, and as [`DeiT::forward_pruned_capturable`].
    pub fn capture(
        model: &'a DeiT,
        example: &Tensor,
        pruners: &'a [BlockPruner],
        reads: Reads,
    ) -> Result<Self, ModelError> {
        // An eager pass over the example, fitting as the replays will: each stage's step.
        let mut step = model.forward_to_first_step(example, pruners)?;
        let bucket_rows = step.batch().total_tokens().div_ceil(BUCKETS).max(1);
        let stages = match reads {
            Reads::First => 1,
            Reads::EveryStep => pruners.len(),
        };
        let mut steps = vec![step.clone()];
        while steps.len() < stages {
            let (fitted, _) = step.fit(|t| bucket_of(t, bucket_rows))?;
            step = model.forward_to_next_step(&fitted, pruners)?;
            steps.push(step.clone());
        }
        let first = CapturedForward::capture_many(std::slice::from_ref(example), |xs| {
            let t = model
                .forward_to_first_step(&xs[0], pruners)
                .map_err(candle_core::Error::wrap)?;
            Ok(step_outputs(&t))
        })?;
        Ok(Self {
            model,
            pruners,
            first,
            graphs: RefCell::new(vec![Vec::new(); steps.len()]),
            steps,
            bucket_rows,
        })
    }

    /// Replays the forward on `pixels`: the first graph, then per stage one u32 read (waits for
    /// the GPU) and the graph of the total's bucket (captured now if new). Returns the logits
    /// buffer, `[B, num_classes]`, which the next replay overwrites (copy it to keep it), and
    /// the rows each stage ran over.
    pub fn replay(&self, pixels: &Tensor) -> Result<(Tensor, Vec<usize>), ModelError> {
        self.first.replay(pixels)?;
        let mut outputs = self.first.outputs().to_vec();
        let mut rows_per_stage = Vec::with_capacity(self.steps.len());
        for (stage, template) in self.steps.iter().enumerate() {
            let [tokens, cu_seqlens] = &outputs[..] else {
                unreachable!("every graph before the last has two outputs");
            };
            // SAFETY: the previous graph's output buffers, which it has just written: a
            // selection's packed tokens at its capacity and its valid `cu_seqlens`.
            let step = unsafe { template.over(tokens.clone(), cu_seqlens.clone())? };
            let (fitted, _total) = step.fit(|total| bucket_of(total, self.bucket_rows))?;
            let rows = fitted.tokens().dim(0)?;
            let graph = self.graph(stage, rows, &fitted, cu_seqlens)?;
            graph.replay_many(&[fitted.tokens(), cu_seqlens])?;
            outputs = graph.outputs().to_vec();
            rows_per_stage.push(rows);
        }
        Ok((outputs[0].clone(), rows_per_stage))
    }

    /// [`Self::replay`]'s logits, copied (later replays leave them alone).
    pub fn run(&self, pixels: &Tensor) -> Result<Tensor, ModelError> {
        Ok(self.replay(pixels)?.0.copy()?)
    }

    /// How many graphs after the first have been captured so far (buckets over all stages).
    pub fn captured_graphs(&self) -> usize {
        self.graphs.borrow().iter().map(Vec::len).sum()
    }

    /// Stage `stage`'s graph over `rows` input rows, captured now (from `fitted`, whose rows
    /// total at most `rows`) if new.
    fn graph(
        &self,
        stage: usize,
        rows: usize,
        fitted: &PrunedTokens,
        cu_seqlens: &Tensor,
    ) -> Result<Rc<CapturedForward>, ModelError> {
        if let Some((_, g)) = self.graphs.borrow()[stage].iter().find(|(r, _)| *r == rows) {
            return Ok(g.clone());
        }
        let (model, pruners, template) = (self.model, self.pruners, &self.steps[stage]);
        let last = stage + 1 == self.steps.len();
        let examples = [fitted.tokens().clone(), cu_seqlens.clone()];
        let graph = CapturedForward::capture_many(&examples, |xs| {
            // SAFETY: the graph's input buffers; every replay fills them from the previous
            // graph's outputs, a valid `cu_seqlens` whose total (read before) is at most the
            // rows of this bucket.
            let t = unsafe { template.over(xs[0].clone(), xs[1].clone()) }
                .map_err(candle_core::Error::wrap)?;
            if last {
                let logits = model
                    .forward_from_step(&t, pruners)
                    .map_err(candle_core::Error::wrap)?;
                Ok(vec![logits])
            } else {
                let next = model
                    .forward_to_next_step(&t, pruners)
                    .map_err(candle_core::Error::wrap)?;
                Ok(step_outputs(&next))
            }
        })?;
        let graph = Rc::new(graph);
        self.graphs.borrow_mut()[stage].push((rows, graph.clone()));
        Ok(graph)
    }
}
