// Fused elementwise kernels of the attention and linear layers, where candle would run a
// chain of separate passes (each a full read and write of the tensor):
//
// scaled_softmax: softmax(scale · x) over the last dim of x [rows, cols], in f32, written
//   back in x's dtype; with `causal_n` > 0 the rows are queries folded as [groups, causal_n]
//   and row r (query i = r % causal_n, at position past + i) sees columns j <= past + i
//   only (the others are written as 0). Replaces candle's scale, cast to f32, mask add,
//   softmax and cast back (five passes, two of them in f32).
//   One warp per row; lanes stride the row (coalesced), three sweeps (max, sum, write)
//   that after the first are served from L1/L2.
//
//   `valid` < cols also hides the columns from `valid` on (keys padded for alignment).
//
// add_bias: x [rows, cols] + b [cols] for contiguous x. candle's broadcast add computes a
//   strided index per element; this is one read of x and one write, in 16-byte chunks
//   when the row width and offsets allow (`_vec`).
//
// split_heads, quick_gelu: the encoder layer's head split of a stacked q/k/v GEMM (with the
//   keys padded to a multiple of 8), and CLIP's activation in one pass instead of three.

#include "activations.cuh"
#include "float.cuh"

#define SOFTMAX_WARPS 8

template <typename T>
__device__ void scaled_softmax(const T* __restrict__ x, T* __restrict__ out, long rows, int cols, float scale,
                               int causal_n, int past, int valid) {
  const int lane = threadIdx.x & 31;
  const long row = (long)blockIdx.x * SOFTMAX_WARPS + (threadIdx.x >> 5);
  if (row >= rows) return;
  const T* in = x + row * cols;
  T* o = out + row * cols;
  const int visible = min(valid, causal_n > 0 ? min(cols, past + (int)(row % causal_n) + 1) : cols);
  float m = -INFINITY;
  for (int j = lane; j < visible; j += 32) m = fmaxf(m, to_f32(in[j]) * scale);
  for (int s = 16; s > 0; s >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, s));
  float sum = 0.f;
  for (int j = lane; j < visible; j += 32) sum += expf(to_f32(in[j]) * scale - m);
  for (int s = 16; s > 0; s >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, s);
  const float inv = 1.f / sum;
  for (int j = lane; j < cols; j += 32) o[j] = from_f32<T>(j < visible ? expf(to_f32(in[j]) * scale - m) * inv : 0.f);
}

// V consecutive elements through one 16-byte access when VEC (V = 16 / sizeof(T)).
template <typename T, bool VEC> struct Chunk {
  static constexpr int V = VEC ? 16 / sizeof(T) : 1;
  T v[V];
  __device__ __forceinline__ void load(const T* p) {
    if (VEC) *reinterpret_cast<uint4*>(v) = *reinterpret_cast<const uint4*>(p);
    else v[0] = p[0];
  }
  __device__ __forceinline__ void store(T* p) const {
    if (VEC) *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(v);
    else p[0] = v[0];
  }
};

// Rows strided over grid y, a row's chunks over grid x (no division per element).
template <typename T, bool VEC>
__device__ void add_bias(const T* __restrict__ x, const T* __restrict__ b, T* __restrict__ out, long rows,
                         int cols) {
  using C = Chunk<T, VEC>;
  const int chunks = cols / C::V;
  for (long row = blockIdx.y; row < rows; row += gridDim.y) {
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < chunks; c += gridDim.x * blockDim.x) {
      C xv, bv;
      xv.load(x + row * cols + c * C::V);
      bv.load(b + c * C::V);
#pragma unroll
      for (int e = 0; e < C::V; ++e) xv.v[e] = from_f32<T>(to_f32(xv.v[e]) + to_f32(bv.v[e]));
      xv.store(out + row * cols + c * C::V);
    }
  }
}

// split_heads: qkv [B·N, 3·H·D] (one GEMM of stacked q/k/v weights) → [3, B, H, Np, D],
// rows n >= N zero (Np, a multiple of 8, keeps the attention GEMMs' leading dims aligned).
template <typename T>
__device__ void split_heads(const T* __restrict__ qkv, T* __restrict__ out, int batch, int n, int np, int heads,
                            int hd) {
  const int row = blockIdx.x;
  const int b = row / np, t = row - b * np;
  const int width = heads * hd;
  const T* src = qkv + ((long)b * n + t) * 3 * width;
  for (int i = threadIdx.x; i < 3 * width; i += blockDim.x) {
    const int part = i / width, rem = i - part * width, h = rem / hd, d = rem - h * hd;
    out[((((long)part * batch + b) * heads + h) * np + t) * hd + d] = t < n ? src[i] : from_f32<T>(0.f);
  }
}

// An elementwise activation over n chunks (grid-stride), `F::apply(v)` on each value in f32.
template <typename T, bool VEC, typename F>
__device__ void activation(const T* __restrict__ x, T* __restrict__ out, long chunks) {
  using C = Chunk<T, VEC>;
  for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < chunks; i += (long)gridDim.x * blockDim.x) {
    C c;
    c.load(x + i * C::V);
#pragma unroll
    for (int e = 0; e < C::V; ++e) c.v[e] = from_f32<T>(F::template apply<T>(to_f32(c.v[e])));
    c.store(out + i * C::V);
  }
}

#define FUSED(suffix, T)                                                                                       \
  extern "C" __global__ void scaled_softmax_##suffix(const T* x, T* out, long rows, int cols, float scale,  \
                                                     int causal_n, int past, int valid) {                   \
    scaled_softmax<T>(x, out, rows, cols, scale, causal_n, past, valid);                                    \
  }                                                                                                          \
  extern "C" __global__ void split_heads_##suffix(const T* qkv, T* out, int batch, int n, int np, int heads, \
                                                  int hd) {                                                  \
    split_heads<T>(qkv, out, batch, n, np, heads, hd);                                                       \
  }                                                                                                          \
  extern "C" __global__ void quick_gelu_##suffix(const T* x, T* out, long n) {                              \
    activation<T, false, QuickGelu>(x, out, n);                                                                         \
  }                                                                                                          \
  extern "C" __global__ void quick_gelu_vec_##suffix(const T* x, T* out, long chunks) {                      \
    activation<T, true, QuickGelu>(x, out, chunks);                                                                     \
  }                                                                                                          \
  extern "C" __global__ void gelu_erf_##suffix(const T* x, T* out, long n) { activation<T, false, GeluErf>(x, out, n); } \
  extern "C" __global__ void gelu_erf_vec_##suffix(const T* x, T* out, long chunks) {                        \
    activation<T, true, GeluErf>(x, out, chunks);                                                                       \
  }                                                                                                          \
  extern "C" __global__ void add_bias_##suffix(const T* x, const T* b, T* out, long rows, int cols) {         \
    add_bias<T, false>(x, b, out, rows, cols);                                                               \
  }                                                                                                          \
  extern "C" __global__ void add_bias_vec_##suffix(const T* x, const T* b, T* out, long rows, int cols) {     \
    add_bias<T, true>(x, b, out, rows, cols);                                                                \
  }

FUSED(f32, float)
FUSED(bf16, __nv_bfloat16)
FUSED(f16, __half)
