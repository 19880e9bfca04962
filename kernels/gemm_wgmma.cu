// act(x·Wᵀ + b) on Hopper's warp-group MMA (sm_90a), for the encoders' linear layers that
// an activation follows (CLIP's fc1 and quick_gelu): cuBLASLt has no quick_gelu epilogue,
// and the separate in-place pass over the [M, N] output moved ~300 MB a CLIP-L layer at 32
// images. x [M, K] and W [N, K] are row-major (K-major), b [N], out [M, N]; K a multiple of
// 64, N of 128, any M.
//
// The "ping-pong" form of a warp-specialised persistent GEMM: a CTA of three warp groups
// per SM walks output tiles of 128×128 (blockIdx.x, then every gridDim.x-th). Warp group 0
// is the producer: one thread issues TMA loads of each tile's 64-wide K blocks of x and W
// into a ring of GW_STAGES stages (full and empty mbarriers a stage). Warp groups 1 and 2
// are consumers that take the CTA's tiles in turn; their main loops run one after the other
// (named barriers pass the turn), so the tensor cores serve one group while the other runs
// its epilogue (bias, activation, rounding, stores) on the tile it just finished.
//
// Every wait on a ring barrier names its phase by parity, i.e. modulo two; the turn-taking
// keeps that unambiguous: a consumer waits on the stages of its tile only once the other
// has waited on all of its own, so the producer is never more than one lap ahead of a
// waiter.
//
// Accumulators: wgmma m64n128k16, two per 16 of K (rows 0-63 and 64-127 of the tile).
// Register 4j + e of half h is row 64h + 16w + g + 8(e >> 1), column 8j + 2(lane % 4) +
// (e & 1) (w the warp within the group, g = lane / 4).

#include <cuda.h>
#include <stdint.h>

#include "activations.cuh"
#include "float.cuh"
#include "wgmma.cuh"

#define GW_BM 128
#define GW_BN 128
#define GW_BK 64
#define GW_STAGES 6
#define GW_A_BYTES (GW_BM * GW_BK * 2)
#define GW_STAGE_BYTES ((GW_BM + GW_BN) * GW_BK * 2)

// The identity: the bias alone.
struct NoAct {
  template <typename T> __device__ static float apply(float v) { return v; }
};

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits for the phase of parity `parity` to complete. A wait that outlasts ~2^34 cycles
// (seconds) traps: a launch error, never a hung GPU.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(done)
               : "r"(bar), "r"(parity)
               : "memory");
  if (done) return;
  const long long start = clock64();
  while (!done) {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(bar), "r"(parity)
                 : "memory");
    if (!done && clock64() - start > (1ll << 34)) __trap();
  }
}
// A 2D box of the tensor map at (inner, outer) into shared memory, counted on `bar`.
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap* map, int inner, int outer, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(inner), "r"(outer), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void bar_sync(int id) { asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id) { asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory"); }

// d (+)= a·b for a 64×128 tile over 16 of K, both operands K-major in shared memory.
template <typename T> struct Wgmma128;
#define WGMMA128(T, NAME)                                                                                         \
  template <> struct Wgmma128<T> {                                                                                \
    static __device__ __forceinline__ void ss(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {          \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                 \
                   "wgmma.mma_async.sync.aligned.m64n128k16.f32." NAME "." NAME " " WG_ACC64 ", %64, %65, p, 1, 1, 0, 0;\n}\n" \
                   : WG_ACC64_OPS(d)                                                                                 \
                   : "l"(a), "l"(b), "r"(accumulate));                                                          \
    }                                                                                                             \
  };
WGMMA128(__nv_bfloat16, "bf16")
WGMMA128(__half, "f16")

template <typename T, typename Act>
__device__ __forceinline__ void gemm_wgmma(const CUtensorMap* map_x, const CUtensorMap* map_w,
                                           const T* __restrict__ bias, T* __restrict__ out, int m, int n, int k) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // The launch adds 1024 bytes so that the stages start on the 128-byte swizzle's period.
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t ring = (raw + 1023) & ~1023u;
  const uint32_t bars = ring + GW_STAGES * GW_STAGE_BYTES;
  auto full = [&](int s) { return bars + 8 * s; };
  auto empty = [&](int s) { return bars + 8 * (GW_STAGES + s); };

  const int tid = threadIdx.x, wg = tid >> 7;
  if (tid == 0) {
    for (int s = 0; s < GW_STAGES; ++s) {
      mbar_init(full(s), 1);   // the producer's expect_tx; the bytes complete it
      mbar_init(empty(s), 4);  // a lane of each consumer warp, once its MMAs have read the stage
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  const int tiles_n = n / GW_BN, tiles = (m + GW_BM - 1) / GW_BM * tiles_n, blocks = k / GW_BK;
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (tid != 0) return;
    int g = 0;  // the CTA's K blocks so far, over all its tiles
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
      const int m0 = t / tiles_n * GW_BM, n0 = t % tiles_n * GW_BN;
      for (int kb = 0; kb < blocks; ++kb, ++g) {
        const int s = g % GW_STAGES;
        mbar_wait(empty(s), ((g / GW_STAGES) & 1) ^ 1);
        mbar_expect_tx(full(s), GW_STAGE_BYTES);
        const uint32_t dst = ring + s * GW_STAGE_BYTES;
        tma_load(dst, map_x, kb * GW_BK, m0, full(s));
        tma_load(dst + GW_A_BYTES, map_w, kb * GW_BK, n0, full(s));
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int c = wg - 1;  // consumer 0 takes the CTA's even tiles, 1 its odd ones
  const int warp = (tid >> 5) & 3, lane = tid & 31, gq = lane >> 2, t4 = lane & 3;
  const int my_turn = c == 0 ? 2 : 1, your_turn = c == 0 ? 1 : 2;  // named barriers
  float acc[2][64];
  for (int j = c, t = blockIdx.x + c * gridDim.x; t < tiles; j += 2, t += 2 * gridDim.x) {
    const int m0 = t / tiles_n * GW_BM, n0 = t % tiles_n * GW_BN;
    // This thread's 32 bias values (16 pairs), loaded before the main loop hides their latency.
    uint32_t bias2[16];
#pragma unroll
    for (int jj = 0; jj < 16; ++jj)
      bias2[jj] = bias != nullptr ? *reinterpret_cast<const uint32_t*>(bias + n0 + 8 * jj + 2 * t4) : 0u;
    if (j > 0) bar_sync(my_turn);
    for (int kb = 0; kb < blocks; ++kb) {
      const int g = j * blocks + kb, s = g % GW_STAGES;
      mbar_wait(full(s), (g / GW_STAGES) & 1);
      const uint32_t a = ring + s * GW_STAGE_BYTES, b = a + GW_A_BYTES;
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < GW_BK / 16; ++kk) {
        const int accumulate = kb > 0 || kk > 0;
        Wgmma128<T>::ss(acc[0], descriptor(a + kk * 32, 16), descriptor(b + kk * 32, 16), accumulate);
        Wgmma128<T>::ss(acc[1], descriptor(a + 64 * 128 + kk * 32, 16), descriptor(b + kk * 32, 16), accumulate);
      }
      wg_commit();
      if (kb == blocks - 1 && t + gridDim.x < tiles) bar_arrive(your_turn);  // the next tile's main loop may issue
      wg_wait<1>();
      pin(acc[0]);
      pin(acc[1]);
      if (kb > 0 && lane == 0) mbar_arrive(empty((g - 1) % GW_STAGES));
    }
    wg_wait<0>();
    pin(acc[0]);
    pin(acc[1]);
    if (lane == 0) mbar_arrive(empty((j * blocks + blocks - 1) % GW_STAGES));

#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int e2 = 0; e2 < 2; ++e2) {
        const int row = m0 + 64 * h + 16 * warp + gq + 8 * e2;
        if (row >= m) continue;
        T* dst = out + (long)row * n + n0 + 2 * t4;
#pragma unroll
        for (int jj = 0; jj < 16; ++jj) {
          const T* pair = reinterpret_cast<const T*>(&bias2[jj]);
          const float b0 = to_f32(pair[0]), b1 = to_f32(pair[1]);
          // As cuBLASLt's bias epilogue and then the activation pass: the sum rounded once
          // to T, the activation on that.
          const float v0 = r<T>(acc[h][4 * jj + 2 * e2] + b0), v1 = r<T>(acc[h][4 * jj + 2 * e2 + 1] + b1);
          *reinterpret_cast<uint32_t*>(dst + 8 * jj) =
              pack2<T>(Act::template apply<T>(v0), Act::template apply<T>(v1));
        }
      }
    }
  }
}

#define GEMM_WGMMA(name, suffix, T, ACT)                                                                          \
  extern "C" __global__ void __launch_bounds__(384, 1)                                                            \
      name##_##suffix(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w,     \
                      const T* bias, T* out, int m, int n, int k) {                                             \
    gemm_wgmma<T, ACT>(&map_x, &map_w, bias, out, m, n, k);                                                      \
  }

GEMM_WGMMA(gemm_bias, bf16, __nv_bfloat16, NoAct)
GEMM_WGMMA(gemm_bias, f16, __half, NoAct)
GEMM_WGMMA(gemm_quick_gelu, bf16, __nv_bfloat16, QuickGelu)
GEMM_WGMMA(gemm_quick_gelu, f16, __half, QuickGelu)
GEMM_WGMMA(gemm_gelu_erf, bf16, __nv_bfloat16, GeluErf)
GEMM_WGMMA(gemm_gelu_erf, f16, __half, GeluErf)
