// The vision tower's patch embedding as a GEMM (ViT's conv with stride = kernel = patch):
//
// unfold_patches: pixels [B, C, S, S] (f32) → rows [B·P², Kp] in T, P = S / patch patches a
//   side, row (b, py, px), column (c · patch + ky) · patch + kx; columns from C · patch²
//   to Kp are zero (Kp, a multiple of 8, keeps the GEMM's rows 16-byte aligned). Pixels
//   are rounded to T first, as transformers casts them to the conv's dtype.
// add_positions: out [B, 1 + P², D] = cat(class row, patch rows) + positions, in one pass
//   where candle ran a transpose copy, a cat and a broadcast add.

#include "float.cuh"

template <typename T>
__device__ void unfold_patches(const float* __restrict__ px, T* __restrict__ out, int channels, int size, int patch,
                               int kp) {
  const int side = size / patch, area = patch * patch;
  const long row = blockIdx.x;
  const int b = (int)(row / (side * side)), rem = (int)(row % (side * side));
  const int py = rem / side, pxi = rem % side;
  for (int col = threadIdx.x; col < kp; col += blockDim.x) {
    float v = 0.f;
    if (col < channels * area) {
      const int c = col / area, r = col % area, ky = r / patch, kx = r % patch;
      v = px[(((long)b * channels + c) * size + py * patch + ky) * size + pxi * patch + kx];
    }
    out[row * kp + col] = from_f32<T>(v);
  }
}

// Rows over grid y, a row's columns over grid x.
template <typename T>
__device__ void add_positions(const T* __restrict__ patches, const T* __restrict__ cls, const T* __restrict__ pos,
                              T* __restrict__ out, long rows, int tokens, int d) {
  for (long row = blockIdx.y; row < rows; row += gridDim.y) {
    const long b = row / tokens;
    const int t = (int)(row % tokens);
    const T* src = t == 0 ? cls : patches + (b * (tokens - 1) + t - 1) * d;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < d; i += gridDim.x * blockDim.x)
      out[row * d + i] = from_f32<T>(to_f32(src[i]) + to_f32(pos[(long)t * d + i]));
  }
}

#define PATCH_EMBED(suffix, T)                                                                                \
  extern "C" __global__ void unfold_patches_##suffix(const float* px, T* out, int channels, int size,       \
                                                     int patch, int kp) {                                   \
    unfold_patches<T>(px, out, channels, size, patch, kp);                                                  \
  }                                                                                                         \
  extern "C" __global__ void add_positions_##suffix(const T* patches, const T* cls, const T* pos, T* out,   \
                                                    long rows, int tokens, int d) {                         \
    add_positions<T>(patches, cls, pos, out, rows, tokens, d);                                              \
  }

PATCH_EMBED(f32, float)
PATCH_EMBED(bf16, __nv_bfloat16)
PATCH_EMBED(f16, __half)
