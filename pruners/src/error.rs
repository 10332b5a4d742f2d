//! Typed errors of the pruning crate. Bad input never panics: it returns one of these.

/// Everything that can go wrong while validating an input, loading weights or making a plan.
#[derive(Debug, thiserror::Error)]
pub enum PruneError {
    /// The input tensors or lengths are inconsistent (ranks, batch sizes, token counts).
    #[error("invalid pruning input: {0}")]
    InvalidInput(String),
    /// An image has no patch token (or more tokens than the padded tensor holds).
    #[error(
        "image {image} has length {length}; it needs between {min} (num_prefix + 1 patch token) and {max} (padded length) tokens"
    )]
    BadLength {
        image: usize,
        length: usize,
        min: usize,
        max: usize,
    },
    /// The pruner needs an input (class-token attention, values) the caller did not give.
    #[error("pruner `{pruner}` needs {what}, but the input has none")]
    MissingInput {
        pruner: &'static str,
        what: &'static str,
    },
    /// A tensor has the wrong rank or dimensions.
    #[error("{what}: expected shape {expected}, got {got:?}")]
    Shape {
        what: &'static str,
        expected: String,
        got: Vec<usize>,
    },
    /// A configuration value is out of range.
    #[error("invalid pruner config: {0}")]
    InvalidConfig(String),
    /// A checkpoint lacks a tensor the module needs.
    #[error("checkpoint has no tensor `{name}`")]
    MissingWeight { name: String },
    /// A checkpoint tensor has the wrong shape.
    #[error("checkpoint tensor `{name}` has shape {got:?}, expected {expected:?}")]
    WeightShape {
        name: String,
        expected: Vec<usize>,
        got: Vec<usize>,
    },
    /// A pruner name (e.g. from the CLI) is not known.
    #[error("unknown pruner `{name}`; valid names: {valid}")]
    UnknownPruner { name: String, valid: String },
    /// A tensor operation failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// A packed-token op of candle-ragged refused its input or failed.
    #[error(transparent)]
    Ragged(#[from] candle_ragged::RaggedError),
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, PruneError>;
