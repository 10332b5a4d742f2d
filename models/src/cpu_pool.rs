//! CPU forwards run inside candle's own rayon pool.
//!
//! On the CPU a forward is a chain of short parallel sections (candle's matmuls through `gemm`,
//! the ragged attention's heads, the GELU). Called from a thread outside any pool, each section
//! wakes the global pool's workers while the caller blocks, and the workers spin between
//! sections beside the threads that have work: on a machine with few cores that spinning takes
//! the cores the next section needs. [`candle_core::Device::with_context`] runs the whole forward
//! on one of candle's pool threads instead, which then takes part in every section itself.

use candle_core::Device;

/// Runs `f` (a forward on `device`) inside candle's CPU pool when `device` is the CPU and
/// `CANDLE_DEIT_CPU_POOL=0` is not set (read once; the forward as called, for A/B
/// measurements); other devices run `f` as called.
pub(crate) fn in_cpu_pool<R: Send>(device: &Device, f: impl FnOnce() -> R + Send) -> R {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if device.is_cpu() && !crate::env_switch(&OFF, "CANDLE_DEIT_CPU_POOL", "0") {
        device.with_context(f)
    } else {
        f()
    }
}
