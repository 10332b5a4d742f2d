//! [`GraphNodes`]: what a captured CUDA graph holds, by node type (`CapturedForward::nodes`), and
//! [`is_capturing`]: whether a device's stream is being captured right now;
//! [`graph_input_copy_in_graph`]: where a replay copies its inputs (a switch);
//! [`programmatic_edges_enabled`]: whether captures give programmatic edges (a switch).

/// A captured graph's nodes by type ([`crate::CapturedForward::nodes`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphNodes {
    pub kernels: usize,
    pub memcpy: usize,
    pub memset: usize,
    pub mem_alloc: usize,
    pub mem_free: usize,
    /// Any other type (events, host nodes, child graphs, ...).
    pub other: usize,
    /// Dependency edges (a pure chain of n nodes has n - 1).
    pub edges: usize,
    /// Of those, programmatic edges between two kernel nodes (lever 124: the second kernel may
    /// start while the first runs; `CANDLE_FASTPATH_PDL`).
    pub programmatic_edges: usize,
}

impl std::fmt::Display for GraphNodes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} kernel, {} memcpy, {} memset, {} mem-alloc, {} mem-free, {} other nodes; {} edges \
             ({} programmatic)",
            self.kernels,
            self.memcpy,
            self.memset,
            self.mem_alloc,
            self.mem_free,
            self.other,
            self.edges,
            self.programmatic_edges
        )
    }
}

/// Whether `device`'s stream is capturing a CUDA graph right now (always false off CUDA). For
/// caches that must not keep what a capture allocates: such memory belongs to the graph.
pub fn is_capturing(device: &candle_core::Device) -> bool {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(dev) = device {
        return crate::cuda::stream_is_capturing(dev);
    }
    let _ = device;
    false
}

/// `CANDLE_FASTPATH_GRAPH_INPUT_COPY` (read once): unset ([`crate::CapturedForward`]'s input
/// copies are its graph's first nodes, lever 123: a replay is one launch), or `stream` (each
/// replay copies its inputs on the stream, then launches the graph), for A/B measurements.
pub fn graph_input_copy_in_graph() -> bool {
    static IN_GRAPH: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::switches::read_once(&IN_GRAPH, "CANDLE_FASTPATH_GRAPH_INPUT_COPY", |v| {
        v != Some("stream")
    })
}

/// `CANDLE_FASTPATH_PDL` (read once): unset, graph captures give the kernels that wait for it a
/// programmatic edge from the kernel before (lever 124; src/programmatic.rs); `0` or `off`,
/// ordinary edges, for A/B measurements; `debug`, on, and each edge the driver refuses is
/// reported on stderr with its error.
#[derive(Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) enum PdlMode {
    Off,
    On,
    Debug,
}

pub(crate) fn pdl_mode() -> PdlMode {
    static MODE: std::sync::OnceLock<PdlMode> = std::sync::OnceLock::new();
    crate::switches::read_once(&MODE, "CANDLE_FASTPATH_PDL", |v| match v {
        Some("0") | Some("off") => PdlMode::Off,
        Some("debug") => PdlMode::Debug,
        _ => PdlMode::On,
    })
}

/// Whether graph captures give programmatic edges (`CANDLE_FASTPATH_PDL`, read once: off at `0`
/// or `off`, on otherwise; `debug` also reports refused edges). Always false in builds without
/// `cuda`.
pub fn programmatic_edges_enabled() -> bool {
    cfg!(feature = "cuda") && pdl_mode() != PdlMode::Off
}
