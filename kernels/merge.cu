// Input embeddings of a step (crates/ops/src/arena_rows.rs): one row per position,
// a text row of the embedding table or an item row of the embedding arena. The arena
// is host shared memory registered with the device (cuMemHostRegister), so item rows
// cross PCIe once, straight into `out`, with no staging copy.
#include "float.cuh"

// src[i] >= 0: row src[i] of `table`; src[i] < 0: slot -src[i] - 1 of `rows`,
// converted from the arena's dtype A to the model's T. One block per position.
template <typename T, typename A>
__device__ void gather_inputs(const T* table, const A* rows, const long long* src, T* out, int width) {
  const long long s = src[blockIdx.x];
  T* o = out + (size_t)blockIdx.x * width;
  if (s >= 0) {
    const T* t = table + (size_t)s * width;
    for (int c = threadIdx.x; c < width; c += blockDim.x) o[c] = t[c];
  } else {
    const A* a = rows + (size_t)(-s - 1) * width;
    for (int c = threadIdx.x; c < width; c += blockDim.x) o[c] = from_f32<T>(to_f32(a[c]));
  }
}

#define GATHER(suffix, T, A)                                                                                     \
  extern "C" __global__ void gather_inputs_##suffix(const T* table, const A* rows, const long long* src, T* out, \
                                                     int width) {                                               \
    gather_inputs<T, A>(table, rows, src, out, width);                                                          \
  }

GATHER(f32_f32, float, float)
GATHER(f32_bf16, float, __nv_bfloat16)
GATHER(f32_f16, float, __half)
GATHER(bf16_f32, __nv_bfloat16, float)
GATHER(bf16_bf16, __nv_bfloat16, __nv_bfloat16)
GATHER(bf16_f16, __nv_bfloat16, __half)
GATHER(f16_f32, __half, float)
GATHER(f16_bf16, __half, __nv_bfloat16)
GATHER(f16_f16, __half, __half)
