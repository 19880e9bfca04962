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
// add_bias: x [rows, cols] + b [cols] for contiguous x. candle's broadcast add computes a
//   strided index per element; this is one read of x and one write.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half(x); }

#define SOFTMAX_WARPS 8

template <typename T>
__device__ void scaled_softmax(const T* __restrict__ x, T* __restrict__ out, long rows, int cols, float scale,
                               int causal_n, int past) {
  const int lane = threadIdx.x & 31;
  const long row = (long)blockIdx.x * SOFTMAX_WARPS + (threadIdx.x >> 5);
  if (row >= rows) return;
  const T* in = x + row * cols;
  T* o = out + row * cols;
  const int visible = causal_n > 0 ? min(cols, past + (int)(row % causal_n) + 1) : cols;
  float m = -INFINITY;
  for (int j = lane; j < visible; j += 32) m = fmaxf(m, to_f32(in[j]) * scale);
  for (int s = 16; s > 0; s >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, s));
  float sum = 0.f;
  for (int j = lane; j < visible; j += 32) sum += expf(to_f32(in[j]) * scale - m);
  for (int s = 16; s > 0; s >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, s);
  const float inv = 1.f / sum;
  for (int j = lane; j < cols; j += 32) o[j] = from_f32<T>(j < visible ? expf(to_f32(in[j]) * scale - m) * inv : 0.f);
}

template <typename T>
__device__ void add_bias(const T* __restrict__ x, const T* __restrict__ b, T* __restrict__ out, long n, int cols) {
  for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
    out[i] = from_f32<T>(to_f32(x[i]) + to_f32(b[i % cols]));
  }
}

#define FUSED(suffix, T)                                                                                       \
  extern "C" __global__ void scaled_softmax_##suffix(const T* x, T* out, long rows, int cols, float scale,  \
                                                     int causal_n, int past) {                              \
    scaled_softmax<T>(x, out, rows, cols, scale, causal_n, past);                                           \
  }                                                                                                          \
  extern "C" __global__ void add_bias_##suffix(const T* x, const T* b, T* out, long n, int cols) {            \
    add_bias<T>(x, b, out, n, cols);                                                                         \
  }

FUSED(f32, float)
FUSED(bf16, __nv_bfloat16)
FUSED(f16, __half)
