// Fused kernels of the decoder layer (Llama/Qwen2), each replacing several candle passes
// (and as many launches: a decode step at batch 1 is bound by launching ~20 kernels per
// layer). Rounding follows transformers' bf16 arithmetic, so that each kernel gives the
// same values as the ops it replaces; in f32 there is no difference.
//
// add_rmsnorm: out[0] = x + y (the residual stream, rounded to T); out[1] = RMSNorm of
//   it: round(round(s · rsqrt(mean(s²) + eps)) · w), as LlamaRMSNorm (f32 statistics, the
//   normalised row cast back, then the weight). One CTA per row, its elements in registers.
// silu_mul: gu [rows, 2I] (gate | up, one fused GEMM's output) → round(round(silu(g)) · u).
// rope_split: qkv [T, (H + 2K)·D] (one fused GEMM's output) → q [T, H, D] and k [T, K, D]
//   rotated (rotate_half convention, round(round(a·cos) ∓ round(b·sin))), v [T, K, D],
//   written one after the other into one buffer. One CTA per token and head.

#include "float.cuh"

// Each thread keeps its ADD_NORM_PER elements in registers: every load of the row is
// issued before any is waited on (one memory latency per row, not one per element; a
// batch-1 decode step has one row, so nothing else hides that latency), and the second
// pass reads no memory. The launch picks blockDim so that PER · blockDim >= h.
#define ADD_NORM_PER 8

template <typename T>
__device__ void add_rmsnorm(const T* __restrict__ x, const T* __restrict__ y, const T* __restrict__ w,
                            T* __restrict__ out, int rows, int h, float eps) {
  __shared__ float partial[32];
  const long row = blockIdx.x;
  const T* xr = x + row * h;
  const T* yr = y + row * h;
  T* sum = out + row * h;
  T* normed = out + (long)rows * h + row * h;
  float v[ADD_NORM_PER], g[ADD_NORM_PER];
  float ss = 0.f;
  // The weight is loaded with the row, not after the reduction: one latency, not two.
#pragma unroll
  for (int k = 0; k < ADD_NORM_PER; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    v[k] = i < h ? to_f32(from_f32<T>(to_f32(xr[i]) + to_f32(yr[i]))) : 0.f;
    g[k] = i < h ? to_f32(w[i]) : 0.f;
  }
#pragma unroll
  for (int k = 0; k < ADD_NORM_PER; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < h) sum[i] = from_f32<T>(v[k]);
    ss += v[k] * v[k];
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
#pragma unroll
  for (int k = 0; k < ADD_NORM_PER; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < h) normed[i] = from_f32<T>(r<T>(v[k] * inv) * g[k]);
  }
}

// Rows over grid y, a row's chunks of V elements over grid x (V = 16 / sizeof(T) when VEC:
// one 16-byte load of gate and of up per chunk; no division per element).
template <typename T, bool VEC>
__device__ void silu_mul(const T* __restrict__ gu, T* __restrict__ out, long rows, int inter) {
  constexpr int V = VEC ? 16 / sizeof(T) : 1;
  const int chunks = inter / V;
  for (long row = blockIdx.y; row < rows; row += gridDim.y) {
    const T* g_row = gu + row * 2 * inter;
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < chunks; c += gridDim.x * blockDim.x) {
      T g[V], u[V], o[V];
      if (VEC) {
        *reinterpret_cast<uint4*>(g) = *reinterpret_cast<const uint4*>(g_row + c * V);
        *reinterpret_cast<uint4*>(u) = *reinterpret_cast<const uint4*>(g_row + inter + c * V);
      } else {
        g[0] = g_row[c];
        u[0] = g_row[inter + c];
      }
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float x = to_f32(g[e]);
        o[e] = from_f32<T>(r<T>(x / (1.f + expf(-x))) * to_f32(u[e]));
      }
      if (VEC) *reinterpret_cast<uint4*>(out + row * inter + c * V) = *reinterpret_cast<const uint4*>(o);
      else out[row * inter + c] = o[0];
    }
  }
}

// One CTA per token and blockDim.y of the H + 2K heads, one thread per rotated pair: a
// decode step's single token still spreads over H + 2K CTAs (blockDim.y = 1), while a
// prefill's thousands of tokens take several heads per CTA.
template <typename T>
__device__ void rope_split(const T* __restrict__ qkv, const T* __restrict__ cos, const T* __restrict__ sin,
                           T* __restrict__ out, int tokens, int heads, int kv_heads, int hd) {
  const int t = blockIdx.x, head = blockIdx.y * blockDim.y + threadIdx.y, i = threadIdx.x;
  if (head >= heads + 2 * kv_heads) return;
  const int half = hd / 2;
  const T* src = qkv + (long)t * (heads + 2 * kv_heads) * hd + (long)head * hd;
  T* dst;
  if (head < heads) {
    dst = out + ((long)t * heads + head) * hd;
  } else if (head < heads + kv_heads) {
    dst = out + (long)tokens * heads * hd + ((long)t * kv_heads + head - heads) * hd;
  } else {
    dst = out + (long)tokens * (heads + kv_heads) * hd + ((long)t * kv_heads + head - heads - kv_heads) * hd;
    for (int j = i; j < hd; j += blockDim.x) dst[j] = src[j];
    return;
  }
  for (int j = i; j < half; j += blockDim.x) {
    const float a = to_f32(src[j]), b = to_f32(src[j + half]);
    const float cc = to_f32(cos[(long)t * half + j]), ss = to_f32(sin[(long)t * half + j]);
    dst[j] = from_f32<T>(r<T>(a * cc) - r<T>(b * ss));
    dst[j + half] = from_f32<T>(r<T>(b * cc) + r<T>(a * ss));
  }
}

#define DECODER(suffix, T)                                                                                   \
  extern "C" __global__ void add_rmsnorm_##suffix(const T* x, const T* y, const T* w, T* out, int rows,   \
                                                  int h, float eps) {                                      \
    add_rmsnorm<T>(x, y, w, out, rows, h, eps);                                                            \
  }                                                                                                        \
  extern "C" __global__ void silu_mul_##suffix(const T* gu, T* out, long rows, int inter) {                 \
    silu_mul<T, false>(gu, out, rows, inter);                                                              \
  }                                                                                                        \
  extern "C" __global__ void silu_mul_vec_##suffix(const T* gu, T* out, long rows, int inter) {             \
    silu_mul<T, true>(gu, out, rows, inter);                                                               \
  }                                                                                                        \
  extern "C" __global__ void rope_split_##suffix(const T* qkv, const T* cos, const T* sin, T* out,          \
                                                 int tokens, int heads, int kv_heads, int hd) {            \
    rope_split<T>(qkv, cos, sin, out, tokens, heads, kv_heads, hd);                                        \
  }

DECODER(f32, float)
DECODER(bf16, __nv_bfloat16)
DECODER(f16, __half)
