// LayerNorm over the last dim (the encoders': CLIP, Whisper), optionally with the residual
// add before it fused in:
//
// layer_norm:     out = (x − mean) · rsqrt(var + eps) · w + b, statistics in f32 and one
//                 rounding at the end, as torch's LayerNorm in bf16.
// add_layer_norm: sum = round(x + y) (the residual stream, as transformers' bf16 add) and
//                 out = layer_norm(sum), in one pass instead of an add and a norm.
//
// One warp per row, LN_WARPS rows per CTA. Each lane keeps its chunks of the row (16 bytes
// each: CH chunks, lanes interleaved so that a warp's loads are contiguous) in registers, so
// the row is read once and both statistics are exact two-pass sums. cols must be a multiple
// of the chunk and at most 32 · CH chunks.

#include "common.cuh"

#define LN_WARPS 4

template <typename T, int CH>
__device__ void layer_norm(const T* __restrict__ x, const T* __restrict__ y, const T* __restrict__ w,
                           const T* __restrict__ b, T* __restrict__ sum, T* __restrict__ out, long rows, int cols,
                           float eps) {
  constexpr int V = 16 / sizeof(T);
  const long row = (long)blockIdx.x * LN_WARPS + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int lane = threadIdx.x & 31, chunks = cols / V;
  const long at = row * cols;
  float v[CH][V];
  float s = 0.f;
#pragma unroll
  for (int c = 0; c < CH; ++c) {
    const int i = lane + 32 * c;
    T xv[V], yv[V];
    if (i < chunks) {
      *reinterpret_cast<uint4*>(xv) = *reinterpret_cast<const uint4*>(x + at + i * V);
      if (y) *reinterpret_cast<uint4*>(yv) = *reinterpret_cast<const uint4*>(y + at + i * V);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        if (y) xv[e] = from_f32<T>(to_f32(xv[e]) + to_f32(yv[e]));
        v[c][e] = to_f32(xv[e]);
        s += v[c][e];
      }
      if (y) *reinterpret_cast<uint4*>(sum + at + i * V) = *reinterpret_cast<const uint4*>(xv);
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) v[c][e] = 0.f;
    }
  }
  const float mean = warp_sum(s) / cols;
  float q = 0.f;
#pragma unroll
  for (int c = 0; c < CH; ++c) {
    if (lane + 32 * c < chunks) {
#pragma unroll
      for (int e = 0; e < V; ++e) q += (v[c][e] - mean) * (v[c][e] - mean);
    }
  }
  const float rstd = rsqrtf(warp_sum(q) / cols + eps);
#pragma unroll
  for (int c = 0; c < CH; ++c) {
    const int i = lane + 32 * c;
    if (i >= chunks) continue;
    T wv[V], bv[V], o[V];
    *reinterpret_cast<uint4*>(wv) = *reinterpret_cast<const uint4*>(w + i * V);
    *reinterpret_cast<uint4*>(bv) = *reinterpret_cast<const uint4*>(b + i * V);
#pragma unroll
    for (int e = 0; e < V; ++e) o[e] = from_f32<T>((v[c][e] - mean) * rstd * to_f32(wv[e]) + to_f32(bv[e]));
    *reinterpret_cast<uint4*>(out + at + i * V) = *reinterpret_cast<const uint4*>(o);
  }
}

#define LAYER_NORM(suffix, T, CH)                                                                               \
  extern "C" __global__ void layer_norm_##suffix##_##CH(const T* x, const T* y, const T* w, const T* b, T* sum, \
                                                        T* out, long rows, int cols, float eps) {               \
    layer_norm<T, CH>(x, y, w, b, sum, out, rows, cols, eps);                                                   \
  }
#define LAYER_NORMS(suffix, T) \
  LAYER_NORM(suffix, T, 1)     \
  LAYER_NORM(suffix, T, 2)     \
  LAYER_NORM(suffix, T, 4)     \
  LAYER_NORM(suffix, T, 8)

LAYER_NORMS(f32, float)
LAYER_NORMS(bf16, __nv_bfloat16)
LAYER_NORMS(f16, __half)
