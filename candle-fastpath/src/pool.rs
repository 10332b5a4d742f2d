//! The CUDA memory pool candle allocates from (its CUDA allocations are stream-ordered,
//! `cuMemAllocAsync`, from the device's default pool): keep freed memory cached across
//! synchronisations ([`retain_freed_memory`]) and measure the most memory in use
//! ([`PeakMemory`]); and skip cudarc's per-buffer events ([`track_buffer_events`]). All are
//! no-ops on the CPU and in builds without `cuda`.

use candle_core::Device;

use crate::error::Result;

/// Keeps memory that candle frees on `device` cached in the CUDA memory pool across
/// synchronisations, instead of returning it to the driver.
///
/// The default pool's release threshold is 0: at every synchronisation (a read-back, a
/// `Device::synchronize`) the pool hands all free memory back, and the next allocations map
/// fresh pages. A forward with a read-back per pruning step then pays that mapping again after
/// every step. With the threshold at its maximum the pool behaves like PyTorch's caching
/// allocator. `retain = false` restores the driver's default (release at every sync).
/// Process-wide for the device.
pub fn retain_freed_memory(device: &Device, retain: bool) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Some(pool) = cuda::default_pool(device)? {
        use candle_core::cuda_backend::cudarc::driver::sys::CUmemPool_attribute as A;
        let threshold = if retain { u64::MAX } else { 0 };
        cuda::set(
            pool,
            A::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            threshold,
            "release threshold",
        )?;
    }
    let _ = (device, retain);
    Ok(())
}

/// Whether buffers allocated on `device` from now on carry cudarc's stream-ordering events.
///
/// With tracking on (candle's default) every allocation creates two CUDA events (a free destroys
/// them), and because candle makes its stream with `CudaContext::new_stream`, which puts the
/// context in cudarc's multi-stream mode, every buffer a kernel reads or writes also costs a
/// `cuStreamWaitEvent` before the launch and a `cuEventRecord` after it: a dozen driver calls of
/// host time for an op with four operands. candle issues all work of a device on that one
/// stream, where the events order nothing. Turning tracking off skips the waits and records for
/// every buffer at once and the event creation for buffers allocated afterwards. Process-wide
/// for the device.
/// [`CapturedForward::capture`](crate::CapturedForward::capture) turns it off as well.
///
/// # Safety
/// With tracking off, nothing orders a buffer between streams: the caller must not use this
/// device's buffers from any stream but candle's own (for instance from their own cudarc
/// streams) without synchronising by hand.
pub unsafe fn track_buffer_events(device: &Device, track: bool) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        // SAFETY: the caller's contract above.
        unsafe {
            if track {
                dev.cuda_stream().context().enable_event_tracking();
            } else {
                dev.disable_event_tracking();
            }
        }
    }
    let _ = (device, track);
    Ok(())
}

/// Peak device memory of a stretch of work: the high-water mark of the device's default memory
/// pool. `None` on the CPU.
pub struct PeakMemory {
    #[cfg(feature = "cuda")]
    pool: Option<candle_core::cuda_backend::cudarc::driver::sys::CUmemoryPool>,
}

impl PeakMemory {
    /// Starts measuring on `device` (resets the pool's high-water mark to what is in use now).
    pub fn start(device: &Device) -> Result<Self> {
        #[cfg(feature = "cuda")]
        {
            use candle_core::cuda_backend::cudarc::driver::sys::CUmemPool_attribute as A;
            let pool = cuda::default_pool(device)?;
            if let Some(pool) = pool {
                cuda::set(pool, A::CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0, "high-water mark")?;
            }
            Ok(Self { pool })
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = device;
            Ok(Self {})
        }
    }

    /// The most memory in use at once since [`Self::start`], in MiB (synchronise first).
    pub fn peak_mb(&self) -> Result<Option<f64>> {
        #[cfg(feature = "cuda")]
        if let Some(pool) = self.pool {
            use candle_core::cuda_backend::cudarc::driver::sys::CUmemPool_attribute as A;
            let high = cuda::get(pool, A::CU_MEMPOOL_ATTR_USED_MEM_HIGH, "high-water mark")?;
            return Ok(Some(high as f64 / (1024.0 * 1024.0)));
        }
        Ok(None)
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::cuda_backend::cudarc::driver::sys;
    use candle_core::Device;

    use crate::error::{FastpathError, Result};

    fn check(r: sys::CUresult, what: &str) -> Result<()> {
        if r == sys::CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(FastpathError::Pool {
                what: what.to_string(),
                code: format!("{r:?}"),
            })
        }
    }

    /// The default memory pool of `device`'s GPU, `None` on the CPU.
    pub(super) fn default_pool(device: &Device) -> Result<Option<sys::CUmemoryPool>> {
        let Device::Cuda(dev) = device else {
            return Ok(None);
        };
        let cu_dev = dev.cuda_stream().context().cu_device();
        let mut pool = std::mem::MaybeUninit::uninit();
        // SAFETY: a driver query on a valid device; `pool` is written on success.
        unsafe {
            check(
                sys::cuDeviceGetDefaultMemPool(pool.as_mut_ptr(), cu_dev),
                "lookup",
            )?;
            Ok(Some(pool.assume_init()))
        }
    }

    /// Sets a u64 attribute (all the ones used here are u64, as the driver expects).
    pub(super) fn set(
        pool: sys::CUmemoryPool,
        attr: sys::CUmemPool_attribute,
        mut value: u64,
        what: &str,
    ) -> Result<()> {
        // SAFETY: writes one u64 attribute of a live pool.
        let r = unsafe {
            sys::cuMemPoolSetAttribute(pool, attr, &mut value as *mut u64 as *mut std::ffi::c_void)
        };
        check(r, what)
    }

    pub(super) fn get(
        pool: sys::CUmemoryPool,
        attr: sys::CUmemPool_attribute,
        what: &str,
    ) -> Result<u64> {
        let mut value: u64 = 0;
        // SAFETY: reads one u64 attribute of a live pool.
        let r = unsafe {
            sys::cuMemPoolGetAttribute(pool, attr, &mut value as *mut u64 as *mut std::ffi::c_void)
        };
        check(r, what)?;
        Ok(value)
    }
}
