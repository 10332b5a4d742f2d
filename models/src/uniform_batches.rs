//! [`UniformBatches`]: the batch descriptions of equal-length sequences a model reuses.
//!
//! Why: building a [`RaggedBatch`] uploads its `cu_seqlens` (a host-to-device copy). The dense
//! forward (B sequences of N tokens) and every fixed-ratio pruning step (B sequences of
//! `prefix + keep` tokens) use equal lengths, whose offsets depend on (B, length) alone. Eagerly
//! each upload is a driver call on the host's hot path; inside a captured CUDA graph it is a
//! host-to-device memcpy node on the forward's chain, which the GPU waits for between two
//! kernels at every replay. Built once per shape and device, then shared, neither happens.

use std::sync::{Arc, Mutex};

use candle_core::Device;
use candle_ragged::RaggedBatch;

/// A cache of `RaggedBatch::from_lengths(&vec![len; batch], device)` per (batch, len, device).
/// Clones share one cache.
///
/// Entries are never evicted: a CUDA graph captured from a forward points at the `cu_seqlens` it
/// was given (without holding the tensor), so an entry must live as long as the model. Each is
/// a `[batch + 1]` u32 tensor, and a process sees few (batch, length) pairs. A miss while the
/// device's stream is being captured is built but not kept: its memory belongs to the graph.
#[derive(Debug, Clone, Default)]
pub struct UniformBatches {
    entries: Arc<Mutex<Vec<Entry>>>,
}

#[derive(Debug)]
struct Entry {
    batch: usize,
    len: usize,
    device: Device,
    built: RaggedBatch,
}

impl UniformBatches {
    /// The batch of `batch` sequences of `len` tokens each on `device`, built on first use.
    /// Errors as [`RaggedBatch::from_lengths`] does (an empty batch, a zero length).
    pub fn get(
        &self,
        batch: usize,
        len: usize,
        device: &Device,
    ) -> candle_ragged::Result<RaggedBatch> {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(found) = entries
            .iter()
            .find(|e| e.batch == batch && e.len == len && e.device.same_device(device))
        {
            return Ok(found.built.clone());
        }
        let built = RaggedBatch::from_lengths(&vec![len; batch], device)?;
        if candle_fastpath::is_capturing(device) {
            return Ok(built);
        }
        entries.push(Entry {
            batch,
            len,
            device: device.clone(),
            built: built.clone(),
        });
        Ok(built)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reuses_per_shape_and_refuses_what_from_lengths_refuses() {
        let cache = UniformBatches::default();
        let dev = Device::Cpu;
        let a = cache.get(3, 5, &dev).unwrap();
        assert_eq!(a.host_offsets(), Some(&[0u32, 5, 10, 15][..]));
        assert_eq!(a.uniform_len(), Some(5));
        let again = cache.get(3, 5, &dev).unwrap();
        // The same device tensor, not a new upload.
        assert_eq!(
            again.cu_seqlens().id(),
            a.cu_seqlens().id(),
            "a second get must reuse the first batch"
        );
        let other = cache.clone().get(3, 4, &dev).unwrap();
        assert_eq!(other.host_offsets(), Some(&[0u32, 4, 8, 12][..]));
        assert_ne!(other.cu_seqlens().id(), a.cu_seqlens().id());
        assert!(cache.get(0, 5, &dev).is_err());
        assert!(cache.get(2, 0, &dev).is_err());
        // Many shapes: every one answered correctly, the first still the same tensor.
        for len in 1..=100 {
            let b = cache.get(2, len, &dev).unwrap();
            assert_eq!(
                b.host_offsets(),
                Some(&[0u32, len as u32, 2 * len as u32][..])
            );
        }
    }
}
