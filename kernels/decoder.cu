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
//   written one after the other into one buffer, or k and v into their paged-pool slots
//   (rope_split_kv). One CTA per token and head.

#include "common.cuh"
#include "pdl.cuh"

// Each thread keeps its ADD_NORM_PER elements in registers: every load of the row is
// issued before any is waited on (one memory latency per row, not one per element; a
// batch-1 decode step has one row, so nothing else hides that latency), and the second
// pass reads no memory. The launch picks blockDim so that PER · blockDim >= h.
#define ADD_NORM_PER 8

// ADD_NORM_PER elements of T through 16-byte accesses (VEC rows only).
template <typename T> struct NormChunk {
  __align__(16) T v[ADD_NORM_PER];
  __device__ __forceinline__ void load(const T* p) {
#pragma unroll
    for (int c = 0; c < (int)(ADD_NORM_PER * sizeof(T) / 16); ++c)
      reinterpret_cast<uint4*>(v)[c] = reinterpret_cast<const uint4*>(p)[c];
  }
  __device__ __forceinline__ void store(T* p) const {
#pragma unroll
    for (int c = 0; c < (int)(ADD_NORM_PER * sizeof(T) / 16); ++c)
      reinterpret_cast<uint4*>(p)[c] = reinterpret_cast<const uint4*>(v)[c];
  }
};

// VEC: thread i owns the contiguous elements 8i..8i+7 (h a multiple of 8, rows 16-byte
// aligned), moved in 16-byte accesses; else elements i + k · blockDim (any h).
template <typename T, bool VEC>
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
  const int i0 = threadIdx.x * ADD_NORM_PER;
  // The weight is loaded with the row, not after the reduction: one latency, not two;
  // and before the PDL wait (pdl.cuh), as it is no output of the previous kernel.
  pdl_launch_dependents();
  if (VEC) {
    NormChunk<T> xc, yc, wc;
    if (i0 < h) wc.load(w + i0);
    pdl_wait();
    if (i0 < h) {
      xc.load(xr + i0);
      yc.load(yr + i0);
    }
#pragma unroll
    for (int k = 0; k < ADD_NORM_PER; ++k) {
      v[k] = i0 < h ? to_f32(from_f32<T>(to_f32(xc.v[k]) + to_f32(yc.v[k]))) : 0.f;
      g[k] = i0 < h ? to_f32(wc.v[k]) : 0.f;
      xc.v[k] = from_f32<T>(v[k]);
      ss += v[k] * v[k];
    }
    if (i0 < h) xc.store(sum + i0);
  } else {
    pdl_wait();
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
  }
  ss = warp_sum(ss);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) partial[warp] = ss;
  __syncthreads();
  if (warp == 0) {
    ss = lane < (int)(blockDim.x >> 5) ? partial[lane] : 0.f;
    ss = warp_sum(ss);
    if (lane == 0) partial[0] = ss;
  }
  __syncthreads();
  const float inv = rsqrtf(partial[0] / (float)h + eps);
  if (VEC) {
    if (i0 < h) {
      NormChunk<T> o;
#pragma unroll
      for (int k = 0; k < ADD_NORM_PER; ++k) o.v[k] = from_f32<T>(r<T>(v[k] * inv) * g[k]);
      o.store(normed + i0);
    }
  } else {
#pragma unroll
    for (int k = 0; k < ADD_NORM_PER; ++k) {
      const int i = threadIdx.x + k * blockDim.x;
      if (i < h) normed[i] = from_f32<T>(r<T>(v[k] * inv) * g[k]);
    }
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
// prefill's thousands of tokens take several heads per CTA. VEC (prefill, D/2 a multiple
// of 8): a thread takes 8 consecutive pairs in 16-byte accesses.
// KV: k and v go straight to their slots in the paged pool (kpool, vpool [blocks, K,
// block_size, D]; token t's slot is slots[t] = block · block_size + row) and `out` holds
// q only: the step's two write_kv launches and the k, v round trip disappear.
template <typename T, bool VEC, bool KV>
__device__ void rope_split(const T* __restrict__ qkv, const T* __restrict__ cos, const T* __restrict__ sin,
                           T* __restrict__ out, int tokens, int heads, int kv_heads, int hd,
                           T* __restrict__ kpool, T* __restrict__ vpool, const unsigned* __restrict__ slots,
                           int block_size) {
  constexpr int E = VEC ? ADD_NORM_PER : 1;
  const int t = blockIdx.x, head = blockIdx.y * blockDim.y + threadIdx.y, i = threadIdx.x * E;
  pdl_launch_dependents();
  if (head >= heads + 2 * kv_heads) return;
  pdl_wait();
  const int half = hd / 2;
  const T* src = qkv + (long)t * (heads + 2 * kv_heads) * hd + (long)head * hd;
  T* dst;
  // Where token t's row of kv head `kh` goes in a pool.
  auto pool_row = [&](T* pool, int kh) {
    const unsigned slot = slots[t];
    return pool + (((long)(slot / block_size) * kv_heads + kh) * block_size + slot % block_size) * hd;
  };
  if (head < heads) {
    dst = out + ((long)t * heads + head) * hd;
  } else if (head < heads + kv_heads) {
    dst = KV ? pool_row(kpool, head - heads)
             : out + (long)tokens * heads * hd + ((long)t * kv_heads + head - heads) * hd;
  } else {
    dst = KV ? pool_row(vpool, head - heads - kv_heads)
             : out + (long)tokens * (heads + kv_heads) * hd + ((long)t * kv_heads + head - heads - kv_heads) * hd;
    for (int j = i; j < hd; j += blockDim.x * E) {
      if (VEC) {
        NormChunk<T> c;
        c.load(src + j);
        c.store(dst + j);
      } else {
        dst[j] = src[j];
      }
    }
    return;
  }
  const T* cs = cos + (long)t * half;
  const T* sn = sin + (long)t * half;
  for (int j = i; j < half; j += blockDim.x * E) {
    if (VEC) {
      NormChunk<T> a, b, cc, ss, lo, hi;
      a.load(src + j);
      b.load(src + j + half);
      cc.load(cs + j);
      ss.load(sn + j);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const float x = to_f32(a.v[e]), y = to_f32(b.v[e]), c = to_f32(cc.v[e]), s = to_f32(ss.v[e]);
        lo.v[e] = from_f32<T>(r<T>(x * c) - r<T>(y * s));
        hi.v[e] = from_f32<T>(r<T>(y * c) + r<T>(x * s));
      }
      lo.store(dst + j);
      hi.store(dst + j + half);
    } else {
      const float a = to_f32(src[j]), b = to_f32(src[j + half]);
      const float cc = to_f32(cs[j]), ss = to_f32(sn[j]);
      dst[j] = from_f32<T>(r<T>(a * cc) - r<T>(b * ss));
      dst[j + half] = from_f32<T>(r<T>(b * cc) + r<T>(a * ss));
    }
  }
}

#define DECODER(suffix, T)                                                                                   \
  extern "C" __global__ void add_rmsnorm_##suffix(const T* x, const T* y, const T* w, T* out, int rows,   \
                                                  int h, float eps) {                                      \
    add_rmsnorm<T, false>(x, y, w, out, rows, h, eps);                                                     \
  }                                                                                                        \
  extern "C" __global__ void add_rmsnorm_vec_##suffix(const T* x, const T* y, const T* w, T* out, int rows, \
                                                      int h, float eps) {                                  \
    add_rmsnorm<T, true>(x, y, w, out, rows, h, eps);                                                      \
  }                                                                                                        \
  extern "C" __global__ void silu_mul_##suffix(const T* gu, T* out, long rows, int inter) {                 \
    silu_mul<T, false>(gu, out, rows, inter);                                                              \
  }                                                                                                        \
  extern "C" __global__ void silu_mul_vec_##suffix(const T* gu, T* out, long rows, int inter) {             \
    silu_mul<T, true>(gu, out, rows, inter);                                                               \
  }                                                                                                        \
  extern "C" __global__ void rope_split_##suffix(const T* qkv, const T* cos, const T* sin, T* out,          \
                                                 int tokens, int heads, int kv_heads, int hd) {            \
    rope_split<T, false, false>(qkv, cos, sin, out, tokens, heads, kv_heads, hd, nullptr, nullptr, nullptr, 1); \
  }                                                                                                        \
  extern "C" __global__ void rope_split_vec_##suffix(const T* qkv, const T* cos, const T* sin, T* out,      \
                                                     int tokens, int heads, int kv_heads, int hd) {        \
    rope_split<T, true, false>(qkv, cos, sin, out, tokens, heads, kv_heads, hd, nullptr, nullptr, nullptr, 1); \
  }                                                                                                        \
  extern "C" __global__ void rope_split_kv_##suffix(const T* qkv, const T* cos, const T* sin, T* out,       \
                                                    int tokens, int heads, int kv_heads, int hd, T* kpool,  \
                                                    T* vpool, const unsigned* slots, int block_size) {      \
    rope_split<T, false, true>(qkv, cos, sin, out, tokens, heads, kv_heads, hd, kpool, vpool, slots,       \
                               block_size);                                                                \
  }                                                                                                        \
  extern "C" __global__ void rope_split_kv_vec_##suffix(const T* qkv, const T* cos, const T* sin, T* out,   \
                                                        int tokens, int heads, int kv_heads, int hd,        \
                                                        T* kpool, T* vpool, const unsigned* slots,          \
                                                        int block_size) {                                   \
    rope_split<T, true, true>(qkv, cos, sin, out, tokens, heads, kv_heads, hd, kpool, vpool, slots,        \
                              block_size);                                                                 \
  }

DECODER(f32, float)
DECODER(bf16, __nv_bfloat16)
DECODER(f16, __half)
