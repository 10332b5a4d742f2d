//! [`PooledMlpHead`]: a score head over packed rows whose input is each row's own features
//! beside its image's mean features: DynamicViT's `out_conv` (Linear → GELU → Linear → GELU →
//! Linear → log-softmax over `[local half; pooled half]`), for tokens packed as a
//! [`RaggedBatch`].
//!
//! The concatenation `[l; g]` is never formed: `W0·[l; g] + b0 = W0[:, :H]·l + (W0[:, H:]·g +
//! b0)`, the second term once per image. On CUDA, for f16 / bf16 rows at widths
//! [`POOLED_HEAD_WIDTHS`], two kernels compute it (lever 80 in docs/LEVERS.md): one pools
//! each image and forms its term, one takes 16 rows through the three layers in shared memory.
//! Everywhere else (the CPU, f32, other widths, or `CANDLE_FASTPATH_POOLED_HEAD=0`) it runs as
//! eight ops: [`sequence_mean`], the per-image product, its copy to every row ([`pack`] of a
//! broadcast view), the local product with that copy and the GELU in its epilogue, the middle
//! layer, and [`crate::linear_log_prob`]. Both have the same rounding points; only the GEMMs'
//! summation order differs.

use candle_core::{DType, Tensor};
use candle_ragged::{pack, sequence_mean, RaggedBatch};

use crate::error::{FastpathError, Result};
use crate::linear::{Epilogue, FusedLinear};

const OP: &str = "pooled_mlp_log_prob";

/// Pooled-half widths `H` (= C / 2) the CUDA kernels are built for: DeiT-T and DeiT-S. The tail
/// kernel keeps its layers' weights in shared memory (140 KB with its rows at H = 192); DeiT-B's (450 KB) do
/// not fit, and read from L2 instead its tail was slower than the composed ops (lever 80).
pub const POOLED_HEAD_WIDTHS: [usize; 2] = [96, 192];

/// Whether the two-kernel path may run, from `CANDLE_FASTPATH_POOLED_HEAD` (read once): unset
/// (yes, where it applies) or `0` / `off` (the composed ops everywhere, for A/B runs).
pub fn pooled_head_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::switches::read_once(&ON, "CANDLE_FASTPATH_POOLED_HEAD", |v| {
        !matches!(v, Some("0") | Some("off"))
    })
}

/// `log_softmax(W2·gelu(W1·gelu(W0·[h_r[:H]; mean_b(h[:, H:])] + b0) + b1) + b2)[class]` for
/// every packed row `r` of image `b`.
///
/// Weights (PyTorch layout, one dtype):
/// * `w0` `[H, 2H]`, `b0` `[H]`: the first layer, over `[local half; pooled half]`;
/// * `w1` `[Q, H]`, `b1` `[Q]`: the middle layer;
/// * `w2` `[K, Q]`, `b2` `[K]`: the classifier, 2 ≤ K ≤ [`crate::HEAD_MAX_CLASSES`].
#[derive(Debug, Clone)]
pub struct PooledMlpHead {
    w0: Tensor,
    // Read by the CUDA kernels only (the composed path holds them in its layers).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    b0: Tensor,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    w1: Tensor,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
    /// The composed path's layers: `W0[:, :H]` (no bias), `W0[:, H:]` with `b0`, and `W1`.
    local: FusedLinear,
    pooled: FusedLinear,
    middle: FusedLinear,
}

impl PooledMlpHead {
    /// Checks the shapes, dtypes and devices described on [`PooledMlpHead`].
    pub fn new(
        w0: Tensor,
        b0: Tensor,
        w1: Tensor,
        b1: Tensor,
        w2: Tensor,
        b2: Tensor,
    ) -> Result<Self> {
        let (h, c) = w0.dims2()?;
        let (q, h1) = w1.dims2()?;
        let (k, q2) = w2.dims2()?;
        let shapes_ok = c == 2 * h
            && h > 0
            && h1 == h
            && q2 == q
            && q > 0
            && (2..=crate::HEAD_MAX_CLASSES).contains(&k)
            && b0.dims() == [h]
            && b1.dims() == [q]
            && b2.dims() == [k];
        if !shapes_ok {
            return Err(FastpathError::Candle(candle_core::Error::Msg(format!(
                "{OP}: layers must be W0 [H, 2H], b0 [H], W1 [Q, H], b1 [Q], W2 [K, Q], b2 [K] \
                 with 2 <= K <= {}, got {:?} {:?} {:?} {:?} {:?} {:?}",
                crate::HEAD_MAX_CLASSES,
                w0.dims(),
                b0.dims(),
                w1.dims(),
                b1.dims(),
                w2.dims(),
                b2.dims()
            ))));
        }
        for (what, t) in [
            ("b0", &b0),
            ("w1", &w1),
            ("b1", &b1),
            ("w2", &w2),
            ("b2", &b2),
        ] {
            crate::linear::check_like(OP, &w0, what, t, t.shape())?;
        }
        // The kernels read the weights as dense rows: views (a transposed or narrowed tensor)
        // are copied once here rather than refused at every call.
        let [w0, b0, w1, b1, w2, b2] = [w0, b0, w1, b1, w2, b2].map(|t| t.contiguous());
        let (w0, b0, w1, b1, w2, b2) = (w0?, b0?, w1?, b1?, w2?, b2?);
        let local = FusedLinear::new(w0.narrow(1, 0, h)?.contiguous()?, None)?;
        let pooled = FusedLinear::new(w0.narrow(1, h, h)?.contiguous()?, Some(b0.clone()))?;
        let middle = FusedLinear::new(w1.clone(), Some(b1.clone()))?;
        Ok(Self {
            w0,
            b0,
            w1,
            b1,
            w2,
            b2,
            local,
            pooled,
            middle,
        })
    }

    /// Input width `2H`.
    pub fn in_dim(&self) -> usize {
        self.w0.dim(1).unwrap_or(0)
    }

    /// The log-probability of `class` for every row of `h` (`[batch.total_tokens(), 2H]`, the
    /// weights' dtype and device), the mean of each image taken over its rows after the first
    /// `skip` (every image must have more). Returns `[rows]` f32: on CUDA where
    /// [`Self::fused_applies`] says so, from the two kernels, else from the composed ops.
    pub fn forward(
        &self,
        h: &Tensor,
        batch: &RaggedBatch,
        skip: usize,
        class: usize,
    ) -> Result<Tensor> {
        self.check_input(h, batch, skip, class)?;
        #[cfg(feature = "cuda")]
        if self.fused_applies(h) {
            let op = crate::cuda::PooledHeadOp {
                w0: &self.w0,
                b0: &self.b0,
                w1: &self.w1,
                b1: &self.b1,
                w2: &self.w2,
                b2: &self.b2,
                skip,
                class,
            };
            return Ok(h.apply_op2_no_bwd(batch.cu_seqlens(), &op)?);
        }
        self.composed(h, batch, skip, class)
    }

    /// The same as eight ops on any device (what the CUDA kernels are tested against).
    pub fn forward_composed(
        &self,
        h: &Tensor,
        batch: &RaggedBatch,
        skip: usize,
        class: usize,
    ) -> Result<Tensor> {
        self.check_input(h, batch, skip, class)?;
        self.composed(h, batch, skip, class)
    }

    /// [`Self::forward_composed`] on checked inputs.
    fn composed(
        &self,
        h: &Tensor,
        batch: &RaggedBatch,
        skip: usize,
        class: usize,
    ) -> Result<Tensor> {
        let half = self.w0.dim(0)?;
        let pooled = sequence_mean(&h.narrow(1, half, half)?, batch, skip)
            .map_err(candle_core::Error::from)?;
        let per_image = self.pooled.forward_with(&pooled, Epilogue::Plain)?;
        // Each image's term on each of its rows: pack reads the broadcast view in place.
        let (b, width) = per_image.dims2()?;
        let tokens = if batch.positions().is_some() {
            batch.min_tokens_per_image()
        } else {
            batch.max_len()
        };
        let per_row = pack(
            &per_image.unsqueeze(1)?.broadcast_as((b, tokens, width))?,
            batch,
        )
        .map_err(candle_core::Error::from)?;
        let y = self
            .local
            .forward_with(&h.narrow(1, 0, half)?, Epilogue::ResidualGelu(&per_row))?;
        let y = self.middle.forward_gelu(&y)?;
        crate::linear_log_prob(&y, &self.w2, &self.b2, class)
    }

    /// Whether [`Self::forward`] runs the two CUDA kernels for `h`: on CUDA, f16 / bf16, `H` in
    /// [`POOLED_HEAD_WIDTHS`] with `Q = H / 2`, the GELU in its default Φ form (the kernels
    /// have no other), `h`, `W0` and `W1` contiguous and 16-byte aligned (the kernels move them
    /// in 16-byte pieces; a weight view at an odd offset takes the composed ops), the tail
    /// kernel's shared memory within what the GPU lets a block opt into, and the switch on.
    pub fn fused_applies(&self, h: &Tensor) -> bool {
        #[cfg(not(feature = "cuda"))]
        {
            let _ = h;
            false
        }
        #[cfg(feature = "cuda")]
        {
            let half = self.w0.dims()[0];
            let candle_core::Device::Cuda(dev) = h.device() else {
                return false;
            };
            let Some(width) = POOLED_HEAD_WIDTHS.iter().position(|&w| w == half) else {
                return false;
            };
            // The tail kernel's shared memory (~140 KB at H = 192) must fit a block's opt-in;
            // asked last: the device's state is behind a lock, the other checks read the tensors.
            let fits =
                || crate::cuda::fixed_kernels_fit(dev).is_ok_and(|fit| fit.pooled_head[width]);
            matches!(h.dtype(), DType::F16 | DType::BF16)
                && self.w1.dims()[0] * 2 == half
                && crate::gelu_form::gelu_form() == crate::gelu_form::GeluForm::Phi
                && [h, &self.w0, &self.w1]
                    .iter()
                    .all(|t| crate::cuda::contiguous_16b(t.layout(), t.dtype().size_in_bytes()))
                && pooled_head_enabled()
                && fits()
        }
    }

    fn check_input(
        &self,
        h: &Tensor,
        batch: &RaggedBatch,
        skip: usize,
        class: usize,
    ) -> Result<()> {
        let c = self.in_dim();
        let rows = batch.total_tokens();
        if h.dims() != [rows, c] {
            return Err(FastpathError::ShapeMismatch {
                op: OP,
                what: "h (packed rows of the batch)",
                expected: (rows, c).into(),
                found: h.shape().clone(),
            });
        }
        crate::linear::check_like(OP, &self.w0, "h", h, h.shape())?;
        if !batch.device().same_device(h.device()) {
            return Err(FastpathError::Candle(candle_core::Error::Msg(format!(
                "{OP}: cu_seqlens is on {:?}, h on {:?}",
                batch.device().location(),
                h.device().location()
            ))));
        }
        // Lengths the host knows; a batch whose lengths live on the device comes from a
        // selection that keeps a patch in every image.
        if let Some((index, len)) = batch.first_sequence_at_most(skip) {
            return Err(FastpathError::Candle(candle_core::Error::Msg(format!(
                "{OP}: image {index} has {len} rows, none after its {skip} prefix rows to pool"
            ))));
        }
        let k = self.w2.dim(0)?;
        if class >= k {
            return Err(FastpathError::Candle(candle_core::Error::Msg(format!(
                "{OP}: class {class} of {k}"
            ))));
        }
        if h.dtype() != DType::F32 && h.dtype() != DType::F16 && h.dtype() != DType::BF16 {
            return Err(FastpathError::UnsupportedDType {
                op: OP,
                dtype: h.dtype(),
            });
        }
        Ok(())
    }
}
