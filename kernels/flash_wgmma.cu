// Flash attention on Hopper's warp-group MMA (sm_90a; Shah et al. 2024, "FlashAttention-3"):
// the encoders' dense attention at head dim 64, where the mma.sync kernel of
// flash_attention.cu is latency-bound (255 registers, one issue every 4 cycles a warp).
// Same contract as flash_dense there: q, k and v rows at q + b·q_batch + i·q_row + h·64 (k
// and v with kv_batch, kv_row and the kv head), output likewise (o_batch, o_row); keys >=
// n_k hidden; with past >= 0, query i sees keys <= past + i; `group` query heads a kv head.
//
// A CTA is FW_GROUPS (2) warp groups of 128 threads, each owning 64 query rows. Q (loaded once)
// and a ring of K/V tiles of 64 keys (FW_STAGES) live in shared memory in the layout the
// tensor cores read through descriptors: 128-byte rows (64 16-bit values, one head), the
// 16-byte chunk c of row r stored at chunk c ^ (r % 8) (the 128-byte swizzle, which keeps
// the 8 rows a core matrix reads in distinct banks), tiles 1024-byte aligned.
//
// Per tile of keys, a warp group issues S = Q·Kᵀ as four wgmma m64n64k16 (Q and K both
// K-major from shared memory) and O += P·V as four more (P from registers, the scores'
// accumulators rounded to 16 bits; V "MN-major", i.e. transposed by the instruction).
//
// Accumulator layout (as mma.sync's m16n8 per 8 columns): warp w of the group holds rows
// 16w + g and 16w + g + 8 (g = lane / 4); register 4j + e is column 8j + 2·(lane % 4) +
// (e & 1) of row 16w + g + 8·(e >> 1).

#include "float.cuh"
#include "flash_common.cuh"
#include "wgmma.cuh"
#include <stdint.h>

#define FW_BC 64
#define FW_GROUPS 2
// Three stages: tile t's K, tile t − 1's V (their MMAs overlap), and the load of tile t + 1.
#define FW_STAGES 3
#define FW_TILE (FW_BC * 128)  // bytes of one K or V tile

// Byte offset of 16-byte chunk `chunk` of row `row` in a swizzled tile of 128-byte rows.
__device__ __forceinline__ uint32_t swizzled(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }

// d (+)= a·b for a 64×64 tile over 16 of K: both operands from shared memory, K-major.
// d (+)= a·b with a from registers (mma.sync's A fragment of the warp's 16 rows) and b
// MN-major in shared memory.
template <typename T> struct Wgmma;
#define WGMMA(T, NAME)                                                                                             \
  template <> struct Wgmma<T> {                                                                                    \
    static __device__ __forceinline__ void ss(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {           \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                  \
                   "wgmma.mma_async.sync.aligned.m64n64k16.f32." NAME "." NAME " " WG_ACC32 ", %32, %33, p, 1, 1, 0, 0;\n}\n" \
                   : WG_ACC32_OPS(d)                                                                                  \
                   : "l"(a), "l"(b), "r"(accumulate));                                                           \
    }                                                                                                              \
    /* The same for 16 keys (n16): the first 8 accumulators, laid out as the first two  \
       8-column blocks of the n64 form. */                                                                         \
    static __device__ __forceinline__ void ss16(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {         \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"                                                  \
                   "wgmma.mma_async.sync.aligned.m64n16k16.f32." NAME "." NAME                                   \
                   " {%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, p, 1, 1, 0, 0;\n}\n"                                       \
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),          \
                     "+f"(d[7])                                                                                  \
                   : "l"(a), "l"(b), "r"(accumulate));                                                           \
    }                                                                                                              \
    static __device__ __forceinline__ void rs(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {               \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                    \
                   "wgmma.mma_async.sync.aligned.m64n64k16.f32." NAME "." NAME " " WG_ACC32                       \
                   ", {%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n"                                                    \
                   : WG_ACC32_OPS(d)                                                                                  \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));                                        \
    }                                                                                                              \
  };
WGMMA(__nv_bfloat16, "bf16")
WGMMA(__half, "f16")

// 16 bytes global → shared (a shared-window address), or 16 zero bytes when !valid.
__device__ __forceinline__ void cp_async16(uint32_t smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(valid ? 16 : 0));
}

template <typename T>
__device__ void flash_wgmma(const T* __restrict__ q, long q_batch, long q_row, const T* __restrict__ k,
                            const T* __restrict__ v, long kv_batch, long kv_row, T* __restrict__ out, long o_batch,
                            long o_row, int n_q, int n_k, int group, int past, float scale_log2) {
  constexpr int GROUPS = FW_GROUPS;
  constexpr int FW_BR = 64 * GROUPS;  // query rows a CTA
  constexpr int STAGES = FW_STAGES;   // K/V tiles in the ring
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // The launch adds 1024 bytes so that the tiles can start on a 1024-byte boundary (the
  // swizzle's period: the descriptors' base offset is then 0).
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t qs = (raw + 1023) & ~1023u;        // [FW_BR][128 bytes]
  const uint32_t ks = qs + FW_BR * 128;             // [STAGES][FW_BC][128 bytes]
  const uint32_t vs = ks + STAGES * FW_TILE;        // [STAGES][FW_BC][128 bytes]

  const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int tile_q = gridDim.x - 1 - blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z, kvh = h / group;
  const int q0 = tile_q * FW_BR + wg * 64;  // the group's first row
  const bool active = q0 < n_q;             // uniform across the group
  const int row = q0 + 16 * warp + g;       // this lane's first row

  const T* qb = q + b * q_batch + (long)h * 64;
#pragma unroll
  for (int c = tid; c < FW_BR * 8; c += GROUPS * 128) {
    const int r = c >> 3, ch = c & 7, i = tile_q * FW_BR + r;
    const bool ok = i < n_q;
    cp_async16(qs + swizzled(r, ch), ok ? qb + (long)i * q_row + ch * 8 : qb, ok);
  }

  const int last_q = min(n_q, (tile_q + 1) * FW_BR) - 1;
  const int kv_end = past >= 0 ? min(n_k, past + last_q + 1) : n_k;
  const int tiles = (kv_end + FW_BC - 1) / FW_BC;

  // Each thread copies chunk `tid % 8` of rows tid / 8 + i · ROW_STEP (i < PER) of every K
  // and V tile: its source rows advance by 64 rows a tile, its swizzled destinations stay
  // (ROW_STEP is a multiple of 8, the swizzle's period).
  constexpr int PER = FW_BC * 8 / (GROUPS * 128), ROW_STEP = FW_BC / PER;
  static_assert(PER * GROUPS * 128 == FW_BC * 8 && ROW_STEP % 8 == 0, "whole chunks a thread a tile");
  const int lr = tid >> 3, lch = tid & 7;
  const long src0 = b * kv_batch + (long)lr * kv_row + (long)kvh * 64 + lch * 8, src_step = ROW_STEP * kv_row;
  const uint32_t dst0 = swizzled(lr, lch);
  auto load = [&](int tile) {
    const uint32_t stage = (tile % STAGES) * FW_TILE;
    const int j = tile * FW_BC + lr;
    const long off = src0 + (long)tile * FW_BC * kv_row;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const bool ok = j + i * ROW_STEP < kv_end;
      const uint32_t dst = dst0 + i * ROW_STEP * 128;
      cp_async16(ks + stage + dst, k + (ok ? off + i * src_step : 0), ok);
      cp_async16(vs + stage + dst, v + (ok ? off + i * src_step : 0), ok);
    }
    asm volatile("cp.async.commit_group;\n");
  };

  float o[32], s[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) o[i] = s[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  uint32_t p[4][4];  // the probabilities of one tile as the A fragments of P·V

  const uint32_t qg = qs + wg * 64 * 128;
  // Issue S = Q·Kᵀ for tile t (NARROW: its first 16 keys, an n16 MMA); no wait.
  auto scores = [&](int t, auto narrow) {
    const uint32_t stage = (t % STAGES) * FW_TILE;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      if (decltype(narrow)::value)
        Wgmma<T>::ss16(s, descriptor(qg + kk * 32, 16), descriptor(ks + stage + kk * 32, 16), kk);
      else
        Wgmma<T>::ss(s, descriptor(qg + kk * 32, 16), descriptor(ks + stage + kk * 32, 16), kk);
    }
    wg_commit();
  };
  // Issue O += P·V for tile t (NARROW: one k16 step, its first 16 keys); no wait.
  auto values = [&](int t, auto narrow) {
    const uint32_t stage = (t % STAGES) * FW_TILE;
#pragma unroll
    for (int kk = 0; kk < (decltype(narrow)::value ? 1 : 4); ++kk)
      Wgmma<T>::rs(o, p[kk], descriptor(vs + stage + kk * 16 * 128, 1024));
    wg_commit();
  };
  // The online softmax of the scores of tile t (complete in s), returning O's factor.
  auto softmax = [&](int t, auto masked, auto narrow, float (&alpha)[2]) {
    softmax_tile<decltype(masked)::value, decltype(narrow)::value ? 2 : 8>(s, m, l, alpha, t * FW_BC, n_k, past, row,
                                                                          t4, scale_log2);
  };
  // Two adjacent 8-key column blocks of the probabilities make one 16-key A fragment.
  auto pack = [&](auto narrow) {
#pragma unroll
    for (int kk = 0; kk < (decltype(narrow)::value ? 1 : 4); ++kk) {
      p[kk][0] = pack2<T>(s[8 * kk], s[8 * kk + 1]);
      p[kk][1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
      p[kk][2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
      p[kk][3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
    }
  };
  auto rescale = [&](const float (&alpha)[2]) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      o[4 * j] *= alpha[0];
      o[4 * j + 1] *= alpha[0];
      o[4 * j + 2] *= alpha[1];
      o[4 * j + 3] *= alpha[1];
    }
  };
  // Calls f(masked, narrow) with tile t's kind as compile-time bools: NARROW where at most
  // its first 16 keys are visible (the last tile of CLIP-L's 577 holds one), MASKED where
  // some key is hidden (past n_k, or causal).
  auto by_kind = [&](int t, auto f) {
    const int kbase = t * FW_BC;
    if (kv_end - kbase <= 16)
      f(Bool<true>(), Bool<true>());
    else if (kbase + FW_BC > n_k || (past >= 0 && kbase + FW_BC - 1 > past + q0))
      f(Bool<true>(), Bool<false>());
    else
      f(Bool<false>(), Bool<false>());
  };
  // Tile t's scores, waited for, and their softmax (alpha: O's factor).
  auto scored = [&](int t, auto masked, auto narrow, float (&alpha)[2]) {
    wg_fence();
    scores(t, narrow);
    wg_wait<0>();
    pin(s);
    softmax(t, masked, narrow, alpha);
  };
  // P·V of tile t, waited for.
  auto valued = [&](int t, auto narrow) {
    wg_fence();
    values(t, narrow);
    wg_wait<0>();
    pin(o);
  };
  // Tile t is in for everyone (and every group is done with the stage the next load reuses).
  auto arrive = [&](int t) {
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // cp.async's writes → the tensor cores
    __syncthreads();
    if (t + 1 < tiles) load(t + 1);
  };

  if (tiles > 0) load(0);  // with the queries: one group
  if (tiles > 0) {
    // Pipelined within the warp group (FlashAttention-3's intra-warpgroup overlap): the
    // scores of tile t are issued together with P·V of tile t − 1, and their softmax runs
    // while the tensor cores do P·V. Hence three stages: tile t's K, tile t − 1's V, and
    // the load of tile t + 1. Only the last tile can be narrow, so P·V in the loop is full.
    arrive(0);
    if (active)
      by_kind(0, [&](auto masked, auto narrow) {
        float alpha[2];  // O is still zero
        scored(0, masked, narrow, alpha);
        pack(narrow);
      });
    for (int t = 1; t < tiles; ++t) {
      arrive(t);
      if (!active) continue;
      by_kind(t, [&](auto masked, auto narrow) {
        constexpr bool NARROW = decltype(narrow)::value;
        wg_fence();
        if constexpr (NARROW) {
          // The n16 scores in flight beside P·V make ptxas serialize every wgmma of the
          // kernel (C7511); the narrow tile is the last, so it waits for P·V instead.
          values(t - 1, Bool<false>());
          wg_wait<0>();
          pin(o);
          wg_fence();
        }
        scores(t, narrow);
        if constexpr (!NARROW) values(t - 1, Bool<false>());
        wg_wait<NARROW ? 0 : 1>();
        pin(s);
        float alpha[2];
        softmax(t, masked, narrow, alpha);
        wg_wait<0>();
        pin(o);
        rescale(alpha);
        pack(narrow);
      });
    }
    if (active) by_kind(tiles - 1, [&](auto, auto narrow) { valued(tiles - 1, narrow); });
  }
  if (!active) return;

  T* ob = out + b * o_batch + (long)h * 64;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    l[r] = l[r] > 0.f ? 1.f / l[r] : 0.f;
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int i = row + 8 * half;
    if (i >= n_q) continue;
    T* dst = ob + (long)i * o_row + 2 * t4;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      *reinterpret_cast<uint32_t*>(dst + 8 * j) = pack2<T>(o[4 * j + 2 * half] * l[half], o[4 * j + 2 * half + 1] * l[half]);
  }
}

// A CTA of two warp groups (128 query rows; two CTAs an SM), pipelined.
#define FLASH_WGMMA(suffix, T)                                                                                   \
  extern "C" __global__ void __launch_bounds__(FW_GROUPS * 128, 2)                                               \
      flash_wgmma_##suffix(const T* q, long q_batch, long q_row, const T* k, const T* v, long kv_batch,           \
                           long kv_row, T* out, long o_batch, long o_row, int n_q, int n_k, int group, int past, \
                           float scale_log2) {                                                                   \
    flash_wgmma<T>(q, q_batch, q_row, k, v, kv_batch, kv_row, out, o_batch, o_row, n_q, n_k, group, past,       \
                   scale_log2);                                                                                  \
  }

FLASH_WGMMA(bf16, __nv_bfloat16)
FLASH_WGMMA(f16, __half)
