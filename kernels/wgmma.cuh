// Hopper's warp-group MMA (sm_90a): shared-memory descriptors, the accumulators' operand
// lists, and the fence, commit and wait that bracket wgmma.mma_async, shared by
// flash_wgmma.cu and gemm_wgmma.cu.
#pragma once

#include <stdint.h>

// A shared-memory matrix descriptor: 128-byte swizzle, 8-row groups 1024 bytes apart (the
// stride byte offset). The leading byte offset only matters where an operand spans more
// than one swizzle atom along its leading dimension, which none here does.
__device__ __forceinline__ uint64_t descriptor(uint32_t addr, uint32_t lbo) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(1024 >> 4) << 32) |
         (1ull << 62);
}

// An MMA's f32 accumulators as inline-asm operands: their register list in the instruction
// text (operands %0 … %N-1, N = 32 or 64) and the matching "+f" constraints of d[0 … N-1].
#define WG_REGS_0_31 "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
#define WG_REGS_32_63 "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
#define WG_ACC32 "{" WG_REGS_0_31 "}"
#define WG_ACC64 "{" WG_REGS_0_31 "," WG_REGS_32_63 "}"
#define WG_OPS8(d, i) \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define WG_ACC32_OPS(d) WG_OPS8(d, 0), WG_OPS8(d, 8), WG_OPS8(d, 16), WG_OPS8(d, 24)
#define WG_ACC64_OPS(d) WG_ACC32_OPS(d), WG_OPS8(d, 32), WG_OPS8(d, 40), WG_OPS8(d, 48), WG_OPS8(d, 56)

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
