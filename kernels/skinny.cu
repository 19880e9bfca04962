// y = x·Wᵀ (+ b) for a few rows of x (a decode step's batch): x [M, K], W [N, K], y [M, N],
// bf16 or f16 with f32 sums, M <= 2, K a multiple of 8 (crates/ops/src/skinny.rs).
// cuBLAS runs these shapes at 55-90% of HBM bandwidth (split-K plus a reduce kernel for
// the narrow ones); here every warp streams R whole rows of W in 16-byte loads, once, and
// applies each to all M rows of x, so W crosses HBM once at close to full bandwidth.
// Rounding: the dot product rounded to T, then the bias added and rounded again (the
// GEMM-then-bias-kernel path this replaces).
// PDL (pdl.cuh): the grid may start while the previous kernel finishes and waits for it
// before reading anything. (Pulling the first lines of the weight rows into L2 before the
// wait was measured: 16 lines a row cost 4% at batch 1, 64 lines 25%.)
#include "common.cuh"
#include "pdl.cuh"

// Each warp takes R rows of W: R = 2 for wide layers (fewer x loads per weight byte),
// R = 1 for narrow ones (N <= 8192), where two rows a warp left too few warps per SM to
// keep enough loads in flight.
// SILU: W is a gate and an up projection stacked ([2I, K]); warp w takes the R / 2 gate
// rows j = w · R/2 … and their up rows I + j, and writes y [M, I] = silu_mul's
// round(round(silu(g)) · u) of each pair, rounded to T as the GEMV-then-silu_mul path
// rounds them: no second launch, no [M, 2I] round trip.
template <typename T, int M, int R, bool SILU>
__device__ void skinny(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias,
                       T* __restrict__ y, int n, int k) {
  static_assert(!SILU || R % 2 == 0, "the gate and up rows come in pairs");
  constexpr int P = SILU ? R / 2 : R;  // outputs a warp writes per row of x
  const int lane = threadIdx.x & 31;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int half = n / 2;
  const int row0 = warp * P;
  const int outs = SILU ? half : n;
  // Row r of the warp's R: gate rows row0.., then (SILU) up rows half + row0..
  auto row_of = [&](int r) { return SILU && r >= P ? half + row0 + r - P : row0 + r; };
  pdl_launch_dependents();
  if (row0 >= outs) return;
  pdl_wait();
  float acc[M][R];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[m][r] = 0.f;
  const int chunks = k >> 3;
#pragma unroll 4
  for (int c = lane; c < chunks; c += 32) {
    float wf[R][8];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      uint4 v = make_uint4(0, 0, 0, 0);
      // Weights are read once: streamed past L1, which keeps x.
      if (row0 + (r % P) < outs) v = __ldcs(reinterpret_cast<const uint4*>(w + (size_t)row_of(r) * k) + c);
      unpack8(v, wf[r], (const T*)nullptr);
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float xf[8];
      unpack8(__ldg(reinterpret_cast<const uint4*>(x + (size_t)m * k) + c), xf, (const T*)nullptr);
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[m][r] = fmaf(xf[e], wf[r][e], acc[m][r]);
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    float out[R];
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const float v = warp_sum(acc[m][i]);
      out[i] = r<T>(v);
      if (bias && row0 + (i % P) < outs) out[i] = r<T>(out[i] + to_f32(bias[row_of(i)]));
    }
    if (lane != 0) continue;
    if (SILU) {
#pragma unroll
      for (int i = 0; i < P; ++i) {
        const float g = out[i];
        if (row0 + i < outs) y[(size_t)m * half + row0 + i] = from_f32<T>(r<T>(g / (1.f + expf(-g))) * out[P + i]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < R; ++i)
        if (row0 + i < n) y[(size_t)m * n + row0 + i] = from_f32<T>(out[i]);
    }
  }
}

#define SKINNY_M(suffix, T, M)                                                                             \
  extern "C" __global__ void skinny_##suffix##_##M##_1(const T* x, const T* w, const T* bias, T* y, int n, \
                                                        int k) {                                         \
    skinny<T, M, 1, false>(x, w, bias, y, n, k);                                                         \
  }                                                                                                      \
  extern "C" __global__ void skinny_##suffix##_##M##_2(const T* x, const T* w, const T* bias, T* y, int n, \
                                                        int k) {                                         \
    skinny<T, M, 2, false>(x, w, bias, y, n, k);                                                         \
  }                                                                                                      \
  extern "C" __global__ void skinny_silu_##suffix##_##M##_2(const T* x, const T* w, const T* bias, T* y,    \
                                                           int n, int k) {                               \
    skinny<T, M, 4, true>(x, w, bias, y, n, k);                                                          \
  }
// One or two rows of x (at four cuBLAS was as fast, at eight far faster: not compiled).
#define SKINNY(suffix, T) \
  SKINNY_M(suffix, T, 1)  \
  SKINNY_M(suffix, T, 2)

SKINNY(bf16, __nv_bfloat16)
SKINNY(f16, __half)
