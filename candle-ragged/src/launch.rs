//! Kernel launches that may overlap the previous kernel's tail: programmatic dependent launch
//! (PDL, compute capability 9.0 and up).
//!
//! At small batches a ViT forward is ~100 kernels of a few µs each, and every kernel boundary
//! costs the GPU a drain of the previous grid and a ramp-up of the next one. A kernel launched
//! with the `PROGRAMMATIC_STREAM_SERIALIZATION` attribute may be scheduled as soon as every block
//! of the kernel before it has executed `griddepcontrol.launch_dependents` (or exited); it then
//! waits in `griddepcontrol.wait` until that kernel has completed and its writes are visible.
//! Correctness therefore needs one thing from the kernel: it executes `griddepcontrol.wait`
//! before it touches memory another kernel wrote. Every kernel this crate and `candle-fastpath`
//! launch through [`Launch`] starts with it (`PDL_WAIT` in their `.cu` files). CUDA graphs keep
//! the attribute when a stream is captured.
//!
//! [`Launch`] mirrors cudarc's `LaunchArgs` (device buffers recorded as read on the stream, as
//! cudarc does) but goes through `cuLaunchKernelEx`, so the attribute can be set.
//! Off unless `CANDLE_PDL=1`: measured alone (lever 17) it gained nothing, because the kernels
//! around ours were cuBLASLt's; it is here for the A/B with CUTLASS GEMMs (which support it).

use candle_core::cuda_backend::cudarc::driver::{
    sys, CudaFunction, CudaStream, DevicePtr, DeviceRepr, DriverError, LaunchConfig, SyncOnDrop,
};
use std::ffi::c_void;
use std::sync::OnceLock;

/// Whether launches on this stream's device may use programmatic dependent launch: compute
/// capability 9.0 or newer, and asked for by `CANDLE_PDL=1`.
pub fn pdl_supported(stream: &CudaStream) -> Result<bool, DriverError> {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    if !*ENABLED.get_or_init(|| std::env::var("CANDLE_PDL").as_deref() == Ok("1")) {
        return Ok(false);
    }
    let major = stream
        .context()
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    Ok(major >= 9)
}

enum Arg<'a> {
    /// A device buffer's address, held here so the parameter array can point at it; the guard
    /// records the read on the stream once the launch is queued (when event tracking is on).
    Device {
        ptr: sys::CUdeviceptr,
        _guard: SyncOnDrop<'a>,
    },
    /// A value the caller keeps alive until the launch returns.
    Host(*const c_void),
}

/// One kernel launch: arguments in the kernel's parameter order, then [`Launch::launch`].
pub struct Launch<'a> {
    stream: &'a CudaStream,
    func: &'a CudaFunction,
    args: Vec<Arg<'a>>,
}

impl<'a> Launch<'a> {
    pub fn new(stream: &'a CudaStream, func: &'a CudaFunction) -> Self {
        Self {
            stream,
            func,
            args: Vec::with_capacity(16),
        }
    }

    /// A device buffer (slice or view) passed as a pointer parameter.
    pub fn buffer<T>(&mut self, buf: &'a impl DevicePtr<T>) -> &mut Self {
        let (ptr, guard) = buf.device_ptr(self.stream);
        self.args.push(Arg::Device { ptr, _guard: guard });
        self
    }

    /// A scalar parameter.
    pub fn value<T: DeviceRepr>(&mut self, v: &'a T) -> &mut Self {
        self.args.push(Arg::Host(v as *const T as *const c_void));
        self
    }

    /// Queues the kernel; with `pdl` it may start while the previous kernel on the stream is
    /// finishing (see the module documentation).
    ///
    /// # Safety
    /// The arguments must match the kernel's parameter list in number, order and type, the
    /// buffers must be large enough for what the kernel reads and writes under `cfg`, and with
    /// `pdl` the kernel must execute `griddepcontrol.wait` before reading or writing memory.
    pub unsafe fn launch(&mut self, cfg: LaunchConfig, pdl: bool) -> Result<(), DriverError> {
        self.stream.context().bind_to_thread()?;
        let mut params: Vec<*mut c_void> = self
            .args
            .iter()
            .map(|a| match a {
                Arg::Device { ptr, .. } => ptr as *const sys::CUdeviceptr as *mut c_void,
                Arg::Host(v) => *v as *mut c_void,
            })
            .collect();
        let mut attr: sys::CUlaunchAttribute = std::mem::zeroed();
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(pdl),
        };
        sys::cuLaunchKernelEx(
            &config,
            self.func.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
        .result()
    }
}
