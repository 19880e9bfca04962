// Hopper's warp-group MMA (sm_90a): shared-memory descriptors and the fence, commit and
// wait that bracket wgmma.mma_async, shared by flash_wgmma.cu and gemm_wgmma.cu.
#pragma once

#include <stdint.h>

// A shared-memory matrix descriptor: 128-byte swizzle, 8-row groups 1024 bytes apart (the
// stride byte offset). The leading byte offset only matters where an operand spans more
// than one swizzle atom along its leading dimension, which none here does.
__device__ __forceinline__ uint64_t descriptor(uint32_t addr, uint32_t lbo) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(1024 >> 4) << 32) |
         (1ull << 62);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving reads or writes of accumulators across a wait.
template <int N> __device__ __forceinline__ void pin(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
