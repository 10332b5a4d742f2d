// Programmatic dependent launch (PDL) from the kernel's side (lever 124 in docs/LEVERS.md).
//
// Inside a CUDA graph, candle-fastpath gives some kernel nodes a *programmatic* edge from the
// kernel before them (src/programmatic.rs): such a kernel may be launched, and its CTAs become
// resident, while the kernel before still runs. Everything it does before `dl_wait` therefore
// races with that kernel: it may only read what no kernel of the graph writes (weights, biases,
// LayerNorm parameters, tensor-map descriptors) and write its own shared memory. `dl_wait`
// returns once every kernel it depends on has completed and its writes are visible; each thread
// that reads another kernel's output or writes global memory must have called it. Outside such a
// graph (eager launches, ordinary edges) both instructions are no-ops.
//
// `dl_launch_dependents` lets the next kernel be scheduled as soon as every CTA of this one has
// run it; called at entry, the next kernel's CTAs fill the SMs this one leaves free and issue
// their own weight loads early.
//
// Only for code compiled for compute capability 9.0 and up (the host gives programmatic edges only
// into kernels built that way); below it they compile to nothing.
#pragma once

__device__ __forceinline__ void dl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void dl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
