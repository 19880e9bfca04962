// Fused kernels of the decoder layer (Llama/Qwen2), each replacing several candle passes
// (and as many launches: a decode step at batch 1 is bound by launching ~20 kernels per
// layer). Rounding follows transformers' bf16 arithmetic, so that each kernel gives the
// same values as the ops it replaces; in f32 there is no difference.
//
// add_rmsnorm: out[0] = x + y (the residual stream, rounded to T); out[1] = RMSNorm of
//   it: round(round(s · rsqrt(mean(s²) + eps)) · w), as LlamaRMSNorm (f32 statistics, the
//   normalised row cast back, then the weight). One CTA per row.
// silu_mul: gu [rows, 2I] (gate | up, one fused GEMM's output) → round(round(silu(g)) · u).
// rope_split: qkv [T, (H + 2K)·D] (one fused GEMM's output) → q [T, H, D] and k [T, K, D]
//   rotated (rotate_half convention, round(round(a·cos) ∓ round(b·sin))), v [T, K, D],
//   written one after the other into one buffer. One CTA per token.

#include "float.cuh"

template <typename T>
__device__ void add_rmsnorm(const T* __restrict__ x, const T* __restrict__ y, const T* __restrict__ w,
                            T* __restrict__ out, int rows, int h, float eps) {
  __shared__ float partial[32];
  const long row = blockIdx.x;
  const T* xr = x + row * h;
  const T* yr = y + row * h;
  T* sum = out + row * h;
  T* normed = out + (long)rows * h + row * h;
  float ss = 0.f;
  for (int i = threadIdx.x; i < h; i += blockDim.x) {
    const T s = from_f32<T>(to_f32(xr[i]) + to_f32(yr[i]));
    sum[i] = s;
    const float f = to_f32(s);
    ss += f * f;
  }
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) partial[warp] = ss;
  __syncthreads();
  if (warp == 0) {
    ss = lane < (int)(blockDim.x >> 5) ? partial[lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (lane == 0) partial[0] = ss;
  }
  __syncthreads();
  const float inv = rsqrtf(partial[0] / (float)h + eps);
  for (int i = threadIdx.x; i < h; i += blockDim.x) {
    normed[i] = from_f32<T>(r<T>(to_f32(sum[i]) * inv) * to_f32(w[i]));
  }
}

template <typename T>
__device__ void silu_mul(const T* __restrict__ gu, T* __restrict__ out, long rows, int inter) {
  const long n = rows * inter;
  for (long idx = (long)blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += (long)gridDim.x * blockDim.x) {
    const long row = idx / inter;
    const int i = (int)(idx - row * inter);
    const float g = to_f32(gu[row * 2 * inter + i]);
    const float u = to_f32(gu[row * 2 * inter + inter + i]);
    out[idx] = from_f32<T>(r<T>(g / (1.f + expf(-g))) * u);
  }
}

template <typename T>
__device__ void rope_split(const T* __restrict__ qkv, const T* __restrict__ cos, const T* __restrict__ sin,
                           T* __restrict__ out, int tokens, int heads, int kv_heads, int hd) {
  const int t = blockIdx.x;
  const int half = hd / 2;
  const int width = (heads + 2 * kv_heads) * hd;
  const T* row = qkv + (long)t * width;
  const T* c = cos + (long)t * half;
  const T* s = sin + (long)t * half;
  T* q_out = out + (long)t * heads * hd;
  T* k_out = out + (long)tokens * heads * hd + (long)t * kv_heads * hd;
  T* v_out = out + (long)tokens * (heads + kv_heads) * hd + (long)t * kv_heads * hd;
  // Rotations of the H query heads and K key heads, pair (i, i + D/2) at a time.
  for (int p = threadIdx.x; p < (heads + kv_heads) * half; p += blockDim.x) {
    const int head = p / half, i = p - head * half;
    const T* src = row + head * hd;
    T* dst = head < heads ? q_out + head * hd : k_out + (head - heads) * hd;
    const float a = to_f32(src[i]), b = to_f32(src[i + half]);
    const float cc = to_f32(c[i]), ss = to_f32(s[i]);
    dst[i] = from_f32<T>(r<T>(a * cc) - r<T>(b * ss));
    dst[i + half] = from_f32<T>(r<T>(b * cc) + r<T>(a * ss));
  }
  const T* v = row + (heads + kv_heads) * hd;
  for (int i = threadIdx.x; i < kv_heads * hd; i += blockDim.x) v_out[i] = v[i];
}

#define DECODER(suffix, T)                                                                                   \
  extern "C" __global__ void add_rmsnorm_##suffix(const T* x, const T* y, const T* w, T* out, int rows,   \
                                                  int h, float eps) {                                      \
    add_rmsnorm<T>(x, y, w, out, rows, h, eps);                                                            \
  }                                                                                                        \
  extern "C" __global__ void silu_mul_##suffix(const T* gu, T* out, long rows, int inter) {                 \
    silu_mul<T>(gu, out, rows, inter);                                                                     \
  }                                                                                                        \
  extern "C" __global__ void rope_split_##suffix(const T* qkv, const T* cos, const T* sin, T* out,          \
                                                 int tokens, int heads, int kv_heads, int hd) {            \
    rope_split<T>(qkv, cos, sin, out, tokens, heads, kv_heads, hd);                                        \
  }

DECODER(f32, float)
DECODER(bf16, __nv_bfloat16)
DECODER(f16, __half)
