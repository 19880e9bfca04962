// The elementwise activations that follow a linear layer, as `F::apply<T>(v)` in f32 on a
// value already rounded to T: fused.cu's in-place passes and gemm_wgmma.cu's epilogue share
// them, so the two paths give the same bits.
#pragma once

#include "float.cuh"

// quick_gelu: x · sigmoid(1.702 x), each op rounded as transformers' bf16 ops round. For
// 16-bit T the exponential and the reciprocal are the SFU's (relative error ~2^-21, far
// below the rounding to T that follows): less than half the instructions of expf and an
// exact division, which made gemm_wgmma's epilogue outlast the other group's main loop
// (the pass over CLIP's fc1 output: 108 → 101 µs on an H100). f32 keeps the accurate
// forms (the 1e-4 parity).
struct QuickGelu {
  template <typename T> __device__ static float apply(float v) {
    const float a = r<T>(1.702f * v);
    if constexpr (sizeof(T) == 2) return v * r<T>(__fdividef(1.f, 1.f + __expf(-a)));
    return v * r<T>(1.f / (1.f + expf(-a)));
  }
};

// gelu_erf: x · Φ(x) = 0.5 x (1 + erf(x / √2)) in f32, rounded once (torch's gelu in bf16).
struct GeluErf {
  template <typename T> __device__ static float apply(float v) {
    return 0.5f * v * (1.f + erff(v * 0.70710678118654752f));
  }
};
