//! [`GraphNodes`]: what a captured CUDA graph holds, by node type (`CapturedForward::nodes`).

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
}

impl std::fmt::Display for GraphNodes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} kernel, {} memcpy, {} memset, {} mem-alloc, {} mem-free, {} other nodes; {} edges",
            self.kernels,
            self.memcpy,
            self.memset,
            self.mem_alloc,
            self.mem_free,
            self.other,
            self.edges
        )
    }
}
