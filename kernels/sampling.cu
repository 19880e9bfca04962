// Sampling on the device (crates/ops/src/sampling.rs): temperature, top-k, min-p and
// top-p over one row of f32 logits per block, then a draw with the host's uniform `u`.
// It makes the engine's host sampler's choice (which sorts the row) without sorting:
// - every token has a unique key, (weight bits << 32) | (~id), which orders tokens as
//   the host sorts them (weight descending, then id ascending), so each filter keeps
//   the keys at or above a bound;
// - weights become integer masses (2^40 per unit), so sums are exact whatever order
//   the threads add in, and a seeded request draws the same token run after run;
// - "the key where the cumulative mass (or count) from the top reaches a target" is
//   a radix select over the 64-bit keys: 8 passes of a 256-bin histogram. Lanes of a
//   warp with the same digit add once (warp-aggregated), into one of 16 copies of the
//   histogram: the first passes' digits are a float's exponent, the same for most tokens,
//   and one shared histogram serialised every thread on a few bins.
#include <stdint.h>

#include "common.cuh"

#define THREADS 1024
#define SCALE 1099511627776.0  // 2^40

typedef unsigned long long u64;

// exp in f64, rounded once to f32: the CPU twin computes the same value. NaN is zero
// (never kept), as the host drops it.
__device__ __forceinline__ float weight(float l, float m, double inv_t) {
  const float w = (float)exp((double)(l - m) * inv_t);
  return w > 0.0f ? w : 0.0f;
}
__device__ __forceinline__ u64 key_of(float w, int i) {
  return ((u64)__float_as_uint(w) << 32) | (u64)(0xFFFFFFFFu - (unsigned)i);
}
__device__ __forceinline__ u64 mass_of(float w) { return (u64)((double)w * SCALE); }

__device__ float block_max(float v, float* scratch) {
  v = warp_max(v);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    v = scratch[threadIdx.x];
    v = warp_max(v);
    if (threadIdx.x == 0) scratch[0] = v;
  }
  __syncthreads();
  v = scratch[0];
  __syncthreads();
  return v;
}

__device__ u64 block_sum(u64 v, u64* scratch) {
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    v = scratch[threadIdx.x];
    v = warp_sum(v);
    if (threadIdx.x == 0) scratch[0] = v;
  }
  __syncthreads();
  v = scratch[0];
  __syncthreads();
  return v;
}

// A row's weights (written once per launch into scratch; L2-resident after).
struct Row {
  const float* w;
  int n;
};

// Mass (or count) of the keys at or above `bound`.
__device__ u64 total(const Row& r, u64 bound, bool count, u64* scratch) {
  u64 s = 0;
  for (int i = threadIdx.x; i < r.n; i += THREADS) {
    const float w = r.w[i];
    if (key_of(w, i) >= bound) s += count ? 1 : mass_of(w);
  }
  return block_sum(s, scratch);
}

// Histogram copies: warps 2c and 2c + 1 share copy c, so few atomics ever collide.
#define COPIES 16

// The key K (at or above `bound`) where the mass (or count) of the keys from the top
// first reaches `target` (1 <= target <= total): mass(> K) < target <= mass(>= K).
// hist: COPIES × 256 bins.
__device__ u64 crossing(const Row& r, u64 bound, bool count, u64 target, u64* hist, u64* shared) {
  const int lane = threadIdx.x & 31;
  u64* mine = hist + 256 * ((threadIdx.x >> 5) % COPIES);
  u64 prefix = 0, above = 0;  // above: the mass of keys above the prefix's range
  for (int pass = 0; pass < 8; ++pass) {
    const int shift = 56 - 8 * pass;
    for (int d = threadIdx.x; d < 256 * COPIES; d += THREADS) hist[d] = 0;
    __syncthreads();
    // Every lane runs every round, so the warp's collective ops see the whole warp.
    for (int base = 0; base < r.n; base += THREADS) {
      const int i = base + threadIdx.x;
      bool live = false;
      unsigned digit = 0;
      u64 v = 0;
      if (i < r.n) {
        const float w = r.w[i];
        const u64 k = key_of(w, i);
        if (k >= bound && (pass == 0 || (k >> (shift + 8)) == prefix)) {
          live = true;
          digit = (unsigned)(k >> shift) & 255;
          v = count ? 1 : mass_of(w);
        }
      }
      const unsigned active = __ballot_sync(0xffffffff, live);
      if (live) {
        // Lanes with the same digit add once: in two 20-bit halves (a mass is at most
        // 2^40, so each half's sum over a warp fits in 32 bits).
        const unsigned group = __match_any_sync(active, digit);
        const unsigned lo = __reduce_add_sync(group, (unsigned)(v & 0xFFFFF));
        const unsigned hi = __reduce_add_sync(group, (unsigned)(v >> 20));
        if (lane == __ffs(group) - 1) atomicAdd(&mine[digit], ((u64)hi << 20) + lo);
      }
    }
    __syncthreads();
    if (threadIdx.x < 256) {
      u64 s = 0;
      for (int c = 0; c < COPIES; ++c) s += hist[256 * c + threadIdx.x];
      hist[threadIdx.x] = s;  // copy 0 only ever read its own bin above: safe in place
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      // Lane j holds digits 255 - 8j down to 248 - 8j: a scan from the top digit.
      u64 part = 0;
      for (int d = 0; d < 8; ++d) part += hist[255 - 8 * lane - d];
      u64 incl = part;
      for (int o = 1; o < 32; o <<= 1) {
        u64 v = __shfl_up_sync(0xffffffff, incl, o);
        if (lane >= o) incl += v;
      }
      const u64 excl = incl - part;
      const unsigned hit = __ballot_sync(0xffffffff, above + incl >= target);
      // No lane reaches the target only if it exceeds the total: take the lowest digit.
      const int first = hit ? __ffs(hit) - 1 : 31;
      if (lane == first) {
        u64 acc = above + excl;
        int digit = 0;
        for (int d = 0; d < 8; ++d) {
          digit = 255 - 8 * lane - d;
          if (acc + hist[digit] >= target) break;
          acc += hist[digit];
        }
        shared[0] = (prefix << 8) | (u64)digit;
        shared[1] = acc;
      }
    }
    __syncthreads();
    prefix = shared[0];
    above = shared[1];
    __syncthreads();
  }
  return prefix;
}

// params: per row (1/temperature, top_k (0: all), min_p in [0, 1], top_p, u in [0, 1)).
// weights: scratch of the logits' shape.
extern "C" __global__ void sample_rows(const float* logits, int n, const double* params, float* weights,
                                       unsigned* out) {
  __shared__ float fscratch[32];
  __shared__ u64 scratch[32];
  __shared__ u64 hist[256 * COPIES];
  __shared__ u64 shared[2];
  const double* p = params + 5 * blockIdx.x;
  const float* l = logits + (size_t)blockIdx.x * n;
  float m = -INFINITY;
  for (int i = threadIdx.x; i < n; i += THREADS) m = fmaxf(m, l[i]);
  m = block_max(m, fscratch);
  if (!isfinite(m)) {
    // No finite best: the host falls back to the first largest logit; so do we.
    if (threadIdx.x == 0) {
      int i = 0;
      while (i < n - 1 && !(l[i] == m)) ++i;
      out[blockIdx.x] = i;
    }
    return;
  }
  float* w = weights + (size_t)blockIdx.x * n;
  for (int i = threadIdx.x; i < n; i += THREADS) w[i] = weight(l[i], m, p[0]);
  __syncthreads();
  const Row r = {w, n};
  // Zero weights (masked logits) are never kept: their keys are below 2^32.
  u64 bound = 1ull << 32;
  const u64 top_k = (u64)p[1];
  if (top_k > 0 && top_k < total(r, bound, true, scratch)) bound = crossing(r, bound, true, top_k, hist, shared);
  if (p[2] > 0.0) {
    const u64 floor = (u64)__float_as_uint((float)p[2]) << 32;
    bound = floor > bound ? floor : bound;
  }
  if (p[3] < 1.0) {
    const u64 q = total(r, bound, false, scratch);
    double t = ceil(p[3] * (double)q);
    const u64 target = t < 1.0 ? 1 : (t > (double)q ? q : (u64)t);
    bound = crossing(r, bound, false, target, hist, shared);
  }
  const u64 q = total(r, bound, false, scratch);
  u64 draw = (u64)(p[4] * (double)q);
  if (draw >= q) draw = q - 1;
  const u64 key = crossing(r, bound, false, draw + 1, hist, shared);
  if (threadIdx.x == 0) out[blockIdx.x] = 0xFFFFFFFFu - (unsigned)(key & 0xFFFFFFFFull);
}

// The argmax of each row of f32 logits [rows, n], one block a row: the first index on ties
// (as torch.argmax and the host's argmax). Keys (order-preserving bits << 32) | ~id make
// one max reduction do both; NaN gets the lowest key.
__device__ __forceinline__ u64 argmax_key(float x, unsigned i) {
  const unsigned b = __float_as_uint(x);
  const unsigned ordered = x != x ? 0u : (b & 0x80000000u) ? ~b : b | 0x80000000u;
  return ((u64)ordered << 32) | (u64)(0xFFFFFFFFu - i);
}

extern "C" __global__ void __launch_bounds__(THREADS) argmax_rows(const float* logits, int n, unsigned* out) {
  const float* row = logits + (size_t)blockIdx.x * n;
  u64 best = 0;
  // 16-byte loads where the row starts aligned (rows of a multiple of 4); else scalar.
  int i0 = 0;
  if ((reinterpret_cast<size_t>(row) & 15) == 0) {
    const int vecs = n / 4;
    for (int v = threadIdx.x; v < vecs; v += THREADS) {
      const float4 x = reinterpret_cast<const float4*>(row)[v];
      const u64 a = max(argmax_key(x.x, 4 * v), argmax_key(x.y, 4 * v + 1));
      const u64 b = max(argmax_key(x.z, 4 * v + 2), argmax_key(x.w, 4 * v + 3));
      best = max(best, max(a, b));
    }
    i0 = vecs * 4;
  }
  for (int i = i0 + threadIdx.x; i < n; i += THREADS) best = max(best, argmax_key(row[i], i));
  __shared__ u64 scratch[THREADS / 32];
  best = warp_max(best);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = best;
  __syncthreads();
  if (threadIdx.x < 32) {
    best = scratch[threadIdx.x];
    best = warp_max(best);
    if (threadIdx.x == 0) out[blockIdx.x] = 0xFFFFFFFFu - (unsigned)(best & 0xFFFFFFFFu);
  }
}
