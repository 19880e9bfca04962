// What both flash kernels (flash_attention.cu, flash_wgmma.cu) share: the online softmax
// of one 16-row tile's scores against 64 keys, in the accumulator layout of mma.sync's
// m16n8 (and of wgmma's per warp): register 4j + e is key 8j + 2·(lane % 4) + (e & 1) of
// row g + 8·(e >> 1), g = lane / 4.
#pragma once

// A compile-time bool as a value, to instantiate a generic lambda twice.
template <bool B> struct Bool {
  static constexpr bool value = B;
};

// 2^x by the SFU (approximate, flushing subnormals; 2^-inf = 0).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// The online softmax of one tile's raw scores in base 2 (scale > 0 commutes with the max,
// so p = 2^(s·scale_log2 − m·scale_log2): one FFMA and one EX2 a score): masks keys >=
// n_k and, with past >= 0, keys > past + row; updates the running max m and sum l of rows
// `row` and `row` + 8; turns s into probabilities and returns in alpha the factor the
// accumulated output must be scaled by.
// MASKED: the tile has hidden keys (past n_k, or causal); a separate instantiation, since
// the compiler turns the masking into four instructions a score even where it is off.
// NB: the 8-key column blocks computed (the rest of s is left alone and ignored).
template <bool MASKED, int NB = 8>
__device__ __forceinline__ void softmax_tile(float (&s)[32], float (&m)[2], float (&l)[2], float (&alpha)[2], int kbase, int n_k, int past, int row, int t4,
                                             float scale_log2) {
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int j = 0; j < NB; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (MASKED) {
        const int key = kbase + 8 * j + 2 * t4 + (e & 1), r = row + ((e >> 1) << 3);
        if (key >= n_k || (past >= 0 && key > past + r)) s[4 * j + e] = -INFINITY;
      }
      mx[e >> 1] = fmaxf(mx[e >> 1], s[4 * j + e]);
    }
  }
  float base[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    const float mnew = fmaxf(m[r], mx[r]);
    base[r] = mnew == -INFINITY ? 0.f : mnew * scale_log2;  // every key so far hidden
    alpha[r] = fast_exp2(m[r] * scale_log2 - base[r]);
    m[r] = mnew;
    l[r] *= alpha[r];
  }
#pragma unroll
  for (int j = 0; j < NB; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float p = fast_exp2(fmaf(s[4 * j + e], scale_log2, -base[e >> 1]));
      s[4 * j + e] = p;
      l[e >> 1] += p;
    }
  }
}

