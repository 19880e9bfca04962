// Programmatic dependent launch (sm_90+; crates/ops/src/pdl.rs launches the kernels
// that include this). Both instructions are no-ops in a grid not launched as a
// programmatic dependent.
//
// pdl_launch_dependents: lets the stream's next kernel start its CTAs once every CTA of
//   this grid has executed it (or exited); it says nothing about this grid's writes.
// pdl_wait: blocks until the stream's previous grid has completed and its writes are
//   visible. A kernel reads nothing but weights, and writes nothing, before it.
#pragma once

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
