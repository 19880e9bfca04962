// Helpers several kernels share: warp-wide reductions and unpacking a 16-byte chunk of
// 16-bit floats (written once here; each kernel file used to carry its own copy).
#pragma once

#include "float.cuh"

// The sum over the 32 lanes of a warp, in every lane (a butterfly: every lane adds the same
// values in the same order, so all lanes hold the same bits).
template <typename V> __device__ __forceinline__ V warp_sum(V x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// The largest value over the 32 lanes of a warp, in every lane.
template <typename V> __device__ __forceinline__ V warp_max(V x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = max(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// The 8 values of a 16-byte chunk of bf16 or f16 (the pointer argument picks the type).
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8], const __nv_bfloat16*) {
  const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(p[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8], const __half*) {
  const __half2* p = reinterpret_cast<const __half2*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __half22float2(p[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}
