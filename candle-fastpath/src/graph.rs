//! [`CapturedForward`]: a whole candle forward captured once into a CUDA graph and replayed.
//!
//! A ViT forward through candle is a few hundred kernel launches, each costing several µs of host
//! work in candle's generic op path; at small batches that host work, not the GPU, sets the
//! latency. A CUDA graph replays all of them with one launch.
//!
//! How the capture stays valid across replays:
//! - the input lives in a buffer owned here (its address is baked into the graph); the graph's
//!   first node copies the call's input into it (a memcpy node whose source address a replay
//!   points at the new input's when it moved, `cuGraphExecMemcpyNodeSetParams`: no launch of its
//!   own), so a replay is one graph launch (`CANDLE_FASTPATH_GRAPH_INPUT_COPY=stream`: the copy
//!   as a separate stream-ordered copy before the launch, as before lever 123);
//! - the forward's output is copied, inside the graph, into a second buffer owned here, so the
//!   graph frees every allocation it makes (stream-ordered `cuMemAllocAsync`/`cuMemFreeAsync`
//!   captured as graph memory nodes) and can be relaunched any number of times;
//! - the forward runs once eagerly before the capture, with candle's host-to-device cache on, so
//!   kernels are loaded, cuBLASLt plans chosen and candle's small layout uploads cached: nothing
//!   inside the capture talks to the host;
//! - cudarc's per-buffer event tracking is switched off for the device (candle uses one stream
//!   per device, so it is not needed, and waiting on an event recorded before the capture is
//!   illegal inside it).
//!
//! The forward must not read anything back to the host (a `to_vec`, a data-dependent shape):
//! that fails the capture with an error, and nothing is left half-captured.

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::cuda_backend::cudarc::driver::{sys, CudaGraph};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{CpuStorage, CudaStorage, DType, Device, Layout, Tensor};

use crate::error::{FastpathError, Result};
use crate::{graph_input_copy_in_graph, GraphNodes};

/// A captured forward: `run(x)` = `forward(x)` for every `x` shaped like the example; or, through
/// [`Self::capture_many`], several inputs and outputs (a forward that continues from tensors an
/// earlier one produced).
pub struct CapturedForward {
    graph: CudaGraph,
    device: CudaDevice,
    inputs: Vec<Tensor>,
    outputs: Vec<Tensor>,
    /// Per input, the graph's node copying it into its buffer and the address it reads from now;
    /// empty when the copies run on the stream instead ([`graph_input_copy_in_graph`]).
    input_copies: Vec<InputCopy>,
}

/// The memcpy node that copies one input into its buffer at the start of every replay.
struct InputCopy {
    /// A node of the graph the executable was instantiated from (owned by `graph`).
    node: sys::CUgraphNode,
    /// The device address the node reads from in the executable graph now.
    source: std::cell::Cell<u64>,
}

impl std::fmt::Debug for CapturedForward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shapes = |ts: &[Tensor]| ts.iter().map(|t| t.shape().clone()).collect::<Vec<_>>();
        f.debug_struct("CapturedForward")
            .field("inputs", &shapes(&self.inputs))
            .field("outputs", &shapes(&self.outputs))
            .finish()
    }
}

fn graph_err(what: &str, e: impl std::fmt::Debug) -> FastpathError {
    FastpathError::Graph(format!("{what}: {e:?}"))
}

impl CapturedForward {
    /// Runs `forward` on `example` once (warm-up), then captures it into a CUDA graph.
    ///
    /// * `example` - an input of the shape and dtype every later [`Self::run`] will get, on a
    ///   CUDA device.
    /// * `forward` - any candle computation on that device that does not read back to the host.
    pub fn capture<F>(example: &Tensor, forward: F) -> Result<Self>
    where
        F: Fn(&Tensor) -> candle_core::Result<Tensor>,
    {
        Self::capture_many(std::slice::from_ref(example), |xs| {
            Ok(vec![forward(&xs[0])?])
        })
    }

    /// [`Self::capture`] for a forward of several inputs and outputs.
    ///
    /// * `examples` - one tensor per input, each of the shape and dtype (any, u32 included) that
    ///   later replays give in its place, all on one CUDA device; at least one.
    /// * `forward` - gets the graph's own input buffers, in `examples`' order, and returns the
    ///   outputs (at least one); it must not read back to the host.
    pub fn capture_many<F>(examples: &[Tensor], forward: F) -> Result<Self>
    where
        F: Fn(&[Tensor]) -> candle_core::Result<Vec<Tensor>>,
    {
        let first = examples.first().ok_or_else(|| {
            FastpathError::Graph("capture: a forward needs at least one input".into())
        })?;
        let Device::Cuda(device) = first.device() else {
            return Err(FastpathError::NotCuda {
                op: "CapturedForward::capture",
                device: format!("{:?}", first.device().location()),
            });
        };
        let device = device.clone();
        for x in examples {
            FastpathError::check_same_device(
                "CapturedForward::capture",
                "example",
                x.device(),
                first.device(),
            )?;
        }
        // SAFETY: candle issues all work of a device on its one stream, so the cross-stream
        // events cudarc records per buffer carry no ordering that the stream does not already.
        unsafe { device.disable_event_tracking() };
        let _htod_cache = device.enable_cuda_graph_htod_cache();
        // Fresh buffers owned by the graph's user: nobody else holds their storage.
        let inputs = examples
            .iter()
            .map(|x| x.contiguous()?.copy())
            .collect::<candle_core::Result<Vec<_>>>()?;
        // What the captured input copies read from: the examples, contiguous (a view of their
        // storage when they already are).
        let in_graph = graph_input_copy_in_graph();
        let sources = examples
            .iter()
            .map(|x| x.contiguous())
            .collect::<candle_core::Result<Vec<_>>>()?;
        let outputs = forward(&inputs)?
            .iter()
            .map(|y| y.contiguous()?.copy())
            .collect::<candle_core::Result<Vec<_>>>()?;
        if outputs.is_empty() {
            return Err(FastpathError::Graph(
                "capture: the forward returned no output".into(),
            ));
        }
        device.synchronize()?;

        let stream = device.cuda_stream();
        let _in_progress = crate::programmatic::CaptureInProgress::start();
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| graph_err("begin capture", e))?;
        let copied = if in_graph {
            inputs
                .iter()
                .zip(&sources)
                .try_for_each(|(buffer, source)| buffer.inplace_op2(source, &CopyInto))
        } else {
            Ok(())
        };
        let captured = copied.and_then(|()| forward(&inputs)).and_then(|ys| {
            if ys.len() != outputs.len() {
                candle_core::bail!(
                    "capture: the forward returned {} outputs, {} in its warm-up",
                    ys.len(),
                    outputs.len()
                );
            }
            for (o, y) in outputs.iter().zip(&ys) {
                o.inplace_op2(y, &CopyInto)?;
            }
            Ok(())
        });
        // Always end the capture, so that a failed forward leaves the stream usable.
        let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        captured?;
        let graph = graph
            .map_err(|e| graph_err("end capture", e))?
            .ok_or_else(|| FastpathError::Graph("the capture recorded nothing".into()))?;
        graph.upload().map_err(|e| graph_err("upload", e))?;
        let input_copies = if in_graph {
            input_copy_nodes(&graph, &inputs, &sources)?
        } else {
            Vec::new()
        };
        Ok(Self {
            graph,
            device,
            inputs,
            outputs,
            input_copies,
        })
    }

    /// `forward(input)` by replaying the graph: one graph launch (whose first node copies the input
    /// into the graph's buffer), then one copy of the output buffer into a fresh tensor (so that
    /// later replays do not change the returned value). Does not wait on the GPU.
    pub fn run(&self, input: &Tensor) -> Result<Tensor> {
        self.replay(input)?;
        Ok(self.outputs[0].copy()?)
    }

    /// Replays the graph on `input` without copying the output: the result is then in
    /// [`Self::output`] until the next replay. For benchmarks and callers that consume the output
    /// before the next call.
    pub fn replay(&self, input: &Tensor) -> Result<()> {
        self.replay_many(&[input])
    }

    /// Replays a graph of several inputs: each copied into its buffer (same shape and dtype as
    /// its example) by the graph's first nodes, in one launch; the results are in
    /// [`Self::outputs`] until the next replay. An input at the address the last replay read
    /// (the same tensor again, or a graph's output buffer) costs nothing more; one elsewhere costs
    /// one update of its copy node (host work only, no launch).
    pub fn replay_many(&self, inputs: &[&Tensor]) -> Result<()> {
        if inputs.len() != self.inputs.len() {
            return Err(FastpathError::Graph(format!(
                "replay: {} inputs given, the graph was captured with {}",
                inputs.len(),
                self.inputs.len()
            )));
        }
        for (buffer, input) in self.inputs.iter().zip(inputs) {
            if input.shape() != buffer.shape() || input.dtype() != buffer.dtype() {
                return Err(FastpathError::ShapeMismatch {
                    op: "CapturedForward::run",
                    what: "input",
                    expected: buffer.shape().clone(),
                    found: input.shape().clone(),
                });
            }
            FastpathError::check_same_device(
                "CapturedForward::run",
                "input",
                input.device(),
                buffer.device(),
            )?;
        }
        if self.input_copies.is_empty() {
            for (buffer, input) in self.inputs.iter().zip(inputs) {
                buffer.inplace_op2(&input.contiguous()?, &CopyInto)?;
            }
            self.graph.launch().map_err(|e| graph_err("launch", e))?;
            return Ok(());
        }
        // The graph copies each input itself: point its copy at the input where it moved (a
        // contiguous copy of a strided input is a new tensor, freed on the stream after the
        // launch that reads it).
        let sources = inputs
            .iter()
            .map(|x| x.contiguous())
            .collect::<candle_core::Result<Vec<_>>>()?;
        for (copy, source) in self.input_copies.iter().zip(&sources) {
            let address = device_address(source)?;
            if address != copy.source.get() {
                self.point_copy_at(copy, address)?;
            }
        }
        self.graph.launch().map_err(|e| graph_err("launch", e))?;
        drop(sources);
        Ok(())
    }

    /// `copy`'s node in the executable graph reading from `address` from the next launch on.
    fn point_copy_at(&self, copy: &InputCopy, address: u64) -> Result<()> {
        let mut params = std::mem::MaybeUninit::<sys::CUDA_MEMCPY3D>::zeroed();
        // SAFETY: the node belongs to the live graph the executable was made from; `params` is
        // written by the call before it is read.
        let r = unsafe { sys::cuGraphMemcpyNodeGetParams(copy.node, params.as_mut_ptr()) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(graph_err("cuGraphMemcpyNodeGetParams", r));
        }
        // SAFETY: initialised by the successful call above.
        let mut params = unsafe { params.assume_init() };
        params.srcDevice = address;
        let ctx = self.device.cuda_stream().context().cu_ctx();
        // SAFETY: the executable graph and its node are alive; the copy stays 1-D, device to
        // device, of the same width, from a live allocation of the same context (the input).
        let r = unsafe {
            sys::cuGraphExecMemcpyNodeSetParams(self.graph.cu_graph_exec(), copy.node, &params, ctx)
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(graph_err("cuGraphExecMemcpyNodeSetParams", r));
        }
        copy.source.set(address);
        Ok(())
    }

    /// What the captured graph holds, by node type: a diagnostic for where a replay's time can go
    /// besides its kernels (candle's allocations become memory nodes, its contiguous copies
    /// memcpy nodes).
    pub fn nodes(&self) -> Result<GraphNodes> {
        use sys::CUgraphNodeType as T;
        let err = |what: &str, r: sys::CUresult| graph_err(what, r);
        let mut out = GraphNodes::default();
        for (_, kind) in typed_nodes(&self.graph)? {
            match kind {
                T::CU_GRAPH_NODE_TYPE_KERNEL => out.kernels += 1,
                T::CU_GRAPH_NODE_TYPE_MEMCPY => out.memcpy += 1,
                T::CU_GRAPH_NODE_TYPE_MEMSET => out.memset += 1,
                T::CU_GRAPH_NODE_TYPE_MEM_ALLOC => out.mem_alloc += 1,
                T::CU_GRAPH_NODE_TYPE_MEM_FREE => out.mem_free += 1,
                _ => out.other += 1,
            }
        }
        let graph = self.graph.cu_graph();
        let mut edges = 0usize;
        // SAFETY: the graph is alive (owned by self.graph) and only read here; null arrays ask for
        // the count only.
        let r = unsafe {
            sys::cuGraphGetEdges_v2(
                graph,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                &mut edges,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(err("cuGraphGetEdges_v2", r));
        }
        let mut from = vec![std::ptr::null_mut(); edges];
        let mut to = vec![std::ptr::null_mut(); edges];
        // SAFETY: plain C structs, all-zero valid (overwritten by the call).
        let mut data: Vec<sys::CUgraphEdgeData> = vec![unsafe { std::mem::zeroed() }; edges];
        // SAFETY: as above; the arrays hold the `edges` entries the first call reported.
        let r = unsafe {
            sys::cuGraphGetEdges_v2(
                graph,
                from.as_mut_ptr(),
                to.as_mut_ptr(),
                data.as_mut_ptr(),
                &mut edges,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(err("cuGraphGetEdges_v2", r));
        }
        let programmatic = sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8;
        out.edges = edges;
        out.programmatic_edges = data[..edges.min(data.len())]
            .iter()
            .filter(|e| e.type_ == programmatic)
            .count();
        Ok(out)
    }

    /// The buffer the graph writes its (first) output into (overwritten by every replay).
    pub fn output(&self) -> &Tensor {
        &self.outputs[0]
    }

    /// The buffers the graph writes its outputs into, in the forward's order (overwritten by
    /// every replay).
    pub fn outputs(&self) -> &[Tensor] {
        &self.outputs
    }

    pub fn device(&self) -> &CudaDevice {
        &self.device
    }
}

/// The device address of a contiguous CUDA tensor's first element.
fn device_address(t: &Tensor) -> Result<u64> {
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cuda(s) = &*storage else {
        return Err(FastpathError::Graph(
            "replay: an input is not on the CUDA device".into(),
        ));
    };
    let stream = s.device.cuda_stream();
    macro_rules! address {
        ($t:ty) => {{
            let (ptr, _sync) = s.as_cuda_slice::<$t>()?.device_ptr(&stream);
            ptr + (layout.start_offset() * std::mem::size_of::<$t>()) as u64
        }};
    }
    Ok(match s.dtype() {
        DType::F32 => address!(f32),
        DType::F16 => address!(half::f16),
        DType::BF16 => address!(half::bf16),
        DType::U32 => address!(u32),
        DType::I64 => address!(i64),
        DType::U8 => address!(u8),
        other => {
            return Err(FastpathError::Graph(format!(
                "replay: unsupported input dtype {other:?}"
            )))
        }
    })
}

/// `node`'s type.
///
/// # Safety
/// `node` must belong to a live graph.
pub(crate) unsafe fn node_type(node: sys::CUgraphNode) -> Result<sys::CUgraphNodeType> {
    let mut kind = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
    let r = sys::cuGraphNodeGetType(node, &mut kind);
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(graph_err("cuGraphNodeGetType", r));
    }
    Ok(kind)
}

/// Every node of `graph` with its type.
fn typed_nodes(graph: &CudaGraph) -> Result<Vec<(sys::CUgraphNode, sys::CUgraphNodeType)>> {
    let graph = graph.cu_graph();
    let mut count = 0usize;
    // SAFETY: the graph is alive (borrowed) and only read; the node array has the length the
    // first call reported, and its nodes belong to it.
    unsafe {
        let r = sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut count);
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(graph_err("cuGraphGetNodes", r));
        }
        let mut nodes = vec![std::ptr::null_mut(); count];
        let r = sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut count);
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(graph_err("cuGraphGetNodes", r));
        }
        nodes[..count]
            .iter()
            .map(|&node| Ok((node, node_type(node)?)))
            .collect()
    }
}

/// The memcpy nodes of `graph` that copy `sources[i]` into `inputs[i]` (the capture's first
/// nodes), found by their destination addresses.
fn input_copy_nodes(
    graph: &CudaGraph,
    inputs: &[Tensor],
    sources: &[Tensor],
) -> Result<Vec<InputCopy>> {
    // Each memcpy node's destination.
    let mut copies = Vec::new();
    for (node, kind) in typed_nodes(graph)? {
        if kind != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMCPY {
            continue;
        }
        let mut params = std::mem::MaybeUninit::<sys::CUDA_MEMCPY3D>::zeroed();
        // SAFETY: a memcpy node of the live graph; `params` is written before it is read.
        let r = unsafe { sys::cuGraphMemcpyNodeGetParams(node, params.as_mut_ptr()) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(graph_err("cuGraphMemcpyNodeGetParams", r));
        }
        // SAFETY: initialised by the successful call above.
        let params = unsafe { params.assume_init() };
        copies.push((node, params.dstDevice));
    }
    inputs
        .iter()
        .zip(sources)
        .map(|(buffer, source)| {
            let dst = device_address(buffer)?;
            let node = copies
                .iter()
                .find(|(_, d)| *d == dst)
                .map(|(n, _)| *n)
                .ok_or_else(|| {
                    FastpathError::Graph("capture: an input's copy node is missing".into())
                })?;
            Ok(InputCopy {
                node,
                source: std::cell::Cell::new(device_address(source)?),
            })
        })
        .collect()
}

/// `dst ← src` (same element count, both contiguous) as one stream-ordered device copy.
struct CopyInto;

impl candle_core::InplaceOp2 for CopyInto {
    fn name(&self) -> &'static str {
        "copy-into"
    }

    fn cpu_fwd(
        &self,
        _: &mut CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<()> {
        candle_core::bail!("copy-into: CUDA only")
    }

    fn cuda_fwd(
        &self,
        dst: &mut CudaStorage,
        ld: &Layout,
        src: &CudaStorage,
        ls: &Layout,
    ) -> candle_core::Result<()> {
        if !ld.is_contiguous()
            || !ls.is_contiguous()
            || ld.shape().elem_count() != ls.shape().elem_count()
        {
            candle_core::bail!(
                "copy-into: needs contiguous tensors of equal size, got {:?} and {:?}",
                ld.shape(),
                ls.shape()
            );
        }
        if dst.dtype() != src.dtype() {
            candle_core::bail!("copy-into: dtype {:?} into {:?}", src.dtype(), dst.dtype());
        }
        let n = ld.shape().elem_count();
        let stream = src.device.cuda_stream();
        macro_rules! copy {
            ($t:ty) => {{
                let s = src
                    .as_cuda_slice::<$t>()?
                    .slice(ls.start_offset()..ls.start_offset() + n);
                let start = ld.start_offset();
                let mut d = dst.as_cuda_slice_mut::<$t>()?.slice_mut(start..start + n);
                stream
                    .memcpy_dtod(&s, &mut d)
                    .map_err(candle_core::Error::wrap)
            }};
        }
        match dst.dtype() {
            DType::F32 => copy!(f32),
            DType::F16 => copy!(half::f16),
            DType::BF16 => copy!(half::bf16),
            DType::U32 => copy!(u32),
            DType::I64 => copy!(i64),
            DType::U8 => copy!(u8),
            other => candle_core::bail!("copy-into: unsupported dtype {other:?}"),
        }
    }
}
