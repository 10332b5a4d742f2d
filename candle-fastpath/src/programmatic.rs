//! Programmatic edges between kernel nodes of a captured CUDA graph (lever 124 in
//! docs/LEVERS.md).
//!
//! An ordinary graph edge starts the next kernel once the one before has drained; a
//! *programmatic* edge lets it be launched as soon as every CTA of the one before has run
//! `griddepcontrol.launch_dependents`, its CTAs taking the SMs that kernel leaves free. A kernel
//! that waits in `griddepcontrol.wait` before it reads another kernel's output or writes global
//! memory, and asks for its weights *before* that wait (kernels/dependent_launch.cuh), then
//! overlaps its weight loads with the kernel before's tail. stop 50's probe
//! (scripts/gpu/probes/phase_floor.cu) measured ~1 µs a boundary saved that way, against ~0.2 with
//! the wait at entry (lever 70, which changed nothing end to end); DeiT-S's batch-1 graph saves
//! ~0.3 µs a boundary, ~15 µs a forward (lever 125's A/B). The LayerNorm kernel, which has no
//! programmatic edge in, triggers at entry too, so that a thin GEMM after it (DeiT-B's batch-1
//! qkv and fc1, lever 130) asks for its weights while the rows are normalised: without that
//! trigger the edge only delayed the GEMM's activations behind its weights. The kernels take the
//! weights-first order only when told (`weights_first`, which each op sets exactly when
//! [`ProgrammaticEdge::before_outputs`] returned an edge): without one to overlap, asking for all
//! the weights before any activation only delays the first block.
//!
//! Stream capture alone does not give the edge here: candle allocates each op's output with
//! `cuMemAllocAsync` right before the launch and frees dropped tensors in between, so a capture
//! records kernel → free nodes → allocation node → kernel, and a programmatic edge only joins two
//! kernel nodes. So an op whose kernel waits that way calls [`ProgrammaticEdge::before_outputs`]
//! right before allocating its outputs: when the capture's tail leads back through free nodes to
//! one kernel node, the allocations made next become roots of the graph (the skipped free nodes
//! stay leaves: their memory is not reused within the graph), and
//! [`ProgrammaticEdge::before_launch`] gives the launch ordinary edges from those allocations and a
//! programmatic one from that kernel. Outside a capture, or with the switch off, nothing changes.
//! The cost is graph memory: those outputs' allocations, roots, cannot reuse memory the graph
//! freed before them (a DeiT-S batch-1 graph has 48 such outputs, ~1.7 MB a block by their
//! sizes: up to ~20 MB more, not measured).

use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::cuda_backend::cudarc::driver::sys;
use candle_core::cuda_backend::CudaDevice;

use crate::graph::node_type;
use crate::graph_nodes::{pdl_mode, programmatic_edges_enabled, PdlMode};

/// [`CapturedForward`](crate::CapturedForward) captures in progress, process-wide: outside them
/// [`ProgrammaticEdge::before_outputs`] returns at once, so an eager launch pays one atomic load,
/// not a driver query (eager batch-1 forwards are host-bound). Captures made by other means get
/// ordinary edges.
static CAPTURES: AtomicUsize = AtomicUsize::new(0);

/// Marks a [`CapturedForward`](crate::CapturedForward) capture in progress while alive.
pub(crate) struct CaptureInProgress(());

impl CaptureInProgress {
    pub(crate) fn start() -> Self {
        CAPTURES.fetch_add(1, Ordering::Relaxed);
        Self(())
    }
}

impl Drop for CaptureInProgress {
    fn drop(&mut self) {
        CAPTURES.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The capture's current dependencies of `stream`; `None` when it is not capturing.
///
/// # Safety
/// `stream` must be a live stream of the current context.
unsafe fn capture_tail(stream: sys::CUstream) -> Option<Vec<sys::CUgraphNode>> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut deps: *const sys::CUgraphNode = std::ptr::null();
    let mut n = 0usize;
    let r = sys::cuStreamGetCaptureInfo_v3(
        stream,
        &mut status,
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        &mut deps,
        std::ptr::null_mut(),
        &mut n,
    );
    if r != sys::CUresult::CUDA_SUCCESS
        || status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE
    {
        return None;
    }
    if n == 0 || deps.is_null() {
        return Some(Vec::new());
    }
    // SAFETY: the driver's array of `n` nodes, valid until the next capture call on the stream.
    Some(std::slice::from_raw_parts(deps, n).to_vec())
}

/// `node`'s dependencies. The edge data are read too: without them the driver refuses the query
/// (`CUDA_ERROR_LOSSY_QUERY`) for a node with a programmatic edge in.
///
/// # Safety
/// `node` must belong to a live graph.
unsafe fn dependencies(node: sys::CUgraphNode) -> Option<Vec<sys::CUgraphNode>> {
    let mut n = 0usize;
    let none = std::ptr::null_mut();
    if sys::cuGraphNodeGetDependencies_v2(node, none, none.cast(), &mut n)
        != sys::CUresult::CUDA_SUCCESS
    {
        return None;
    }
    let mut deps = vec![std::ptr::null_mut(); n];
    let mut edges: Vec<sys::CUgraphEdgeData> = vec![std::mem::zeroed(); n];
    if n > 0 {
        let r =
            sys::cuGraphNodeGetDependencies_v2(node, deps.as_mut_ptr(), edges.as_mut_ptr(), &mut n);
        if r != sys::CUresult::CUDA_SUCCESS {
            return None;
        }
        deps.truncate(n);
    }
    Some(deps)
}

/// Replaces the capture's dependencies of `stream` with `deps`, `edges` their edge data (or
/// ordinary edges when `None`).
///
/// # Safety
/// `stream` must be capturing, `deps` nodes of its graph, `edges` as long as `deps`.
unsafe fn set_tail(
    stream: sys::CUstream,
    deps: &mut [sys::CUgraphNode],
    edges: Option<&[sys::CUgraphEdgeData]>,
) -> sys::CUresult {
    sys::cuStreamUpdateCaptureDependencies_v2(
        stream,
        if deps.is_empty() {
            std::ptr::null_mut()
        } else {
            deps.as_mut_ptr()
        },
        edges.map_or(std::ptr::null(), |e| e.as_ptr()),
        deps.len(),
        sys::CUstreamUpdateCaptureDependencies_flags::CU_STREAM_SET_CAPTURE_DEPENDENCIES as u32,
    )
}

/// The kernel node a launch being captured will depend on programmatically.
pub(crate) struct ProgrammaticEdge {
    prev: sys::CUgraphNode,
}

impl ProgrammaticEdge {
    /// Call right before allocating the outputs of a kernel that waits in `griddepcontrol.wait`
    /// before it reads anything another kernel wrote or writes global memory. When the crate's
    /// kernels were built for compute capability 9.0 (build.rs's `fastpath_dependent_launch`:
    /// below it the wait compiles to nothing), `dev`'s stream is capturing (a
    /// [`CapturedForward`](crate::CapturedForward) capture), the switch is on and the capture's
    /// tail is one kernel node, or free nodes that lead back to exactly one, the allocations made
    /// next become roots of the graph and that kernel node is returned, for
    /// [`Self::before_launch`]. Otherwise nothing changes (an ordinary launch follows).
    pub(crate) fn before_outputs(dev: &CudaDevice) -> Option<Self> {
        if !cfg!(fastpath_dependent_launch)
            || CAPTURES.load(Ordering::Relaxed) == 0
            || !programmatic_edges_enabled()
        {
            return None;
        }
        let stream = dev.cuda_stream().cu_stream();
        // SAFETY: candle's live stream; the nodes come from its capture's graph.
        unsafe {
            let mut tail = capture_tail(stream)?;
            let prev = loop {
                let [node] = tail[..] else { return None };
                match node_type(node).ok()? {
                    sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL => break node,
                    sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_FREE => tail = dependencies(node)?,
                    _ => return None,
                }
            };
            (set_tail(stream, &mut [], None) == sys::CUresult::CUDA_SUCCESS)
                .then_some(Self { prev })
        }
    }

    /// Call after the outputs are allocated, right before the launch: the launch then depends on
    /// those allocations (ordinary edges) and programmatically on the kernel node found by
    /// [`Self::before_outputs`]. If the driver refuses the programmatic edge, the launch depends
    /// on that kernel ordinarily (still correct, just not early); if it refuses that too, an
    /// error (the launch would otherwise depend on the allocations alone).
    pub(crate) fn before_launch(self, dev: &CudaDevice) -> candle_core::Result<()> {
        let stream = dev.cuda_stream().cu_stream();
        // SAFETY: candle's live stream, capturing (before_outputs checked it); the nodes are its
        // graph's; the edge data are plain C structs, all-zero an ordinary edge.
        unsafe {
            let Some(mut deps) = capture_tail(stream) else {
                candle_core::bail!("capture: the stream stopped capturing before a launch");
            };
            let mut edges: Vec<sys::CUgraphEdgeData> = vec![std::mem::zeroed(); deps.len()];
            let mut programmatic: sys::CUgraphEdgeData = std::mem::zeroed();
            programmatic.from_port = sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8;
            programmatic.type_ =
                sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8;
            deps.push(self.prev);
            edges.push(programmatic);
            let r = set_tail(stream, &mut deps, Some(&edges));
            if r != sys::CUresult::CUDA_SUCCESS {
                if pdl_mode() == PdlMode::Debug {
                    eprintln!("candle-fastpath: programmatic edge refused (error {r:?})");
                }
                let n = deps.len();
                edges[n - 1] = std::mem::zeroed();
                let r = set_tail(stream, &mut deps, Some(&edges));
                if r != sys::CUresult::CUDA_SUCCESS {
                    candle_core::bail!(
                        "capture: cannot make a launch depend on the kernel before it ({r:?})"
                    );
                }
            }
        }
        Ok(())
    }
}
