// Flash attention (Dao et al. 2022, "FlashAttention"; the FlashAttention-2 loop order): every
// query row attends over its keys in tiles, with an online softmax held in registers, so the
// [queries, keys] score matrix never reaches memory. Tensor cores through mma.sync
// (m16n8k16, bf16 or f16 in, f32 accumulate); key and value tiles double-buffered in shared
// memory by cp.async.
//
// Three ways to find keys and values (KV):
//   dense:  row j of batch b at k + b·kv_batch + j·kv_row + kv_head·HD (the encoder: q, k and
//           v side by side in one GEMM's output [B·N, 3·D]);
//   varlen: batch row b is rows starts[b]..starts[b + 1] of one packed sequence, queries,
//           keys and outputs alike (Qwen-VL's towers: images of different sizes, windows);
//   paged:  the pool [num_blocks, kv_heads, block_size, HD] through one sequence's block
//           table (a prefill chunk: no gather of its blocks).
// Queries: row i of batch b, head h at q + b·q_batch + i·q_row + h·HD; the output likewise
// (o_batch, o_row). All strides are in elements and multiples of 8 (16-byte cp.async).
//
// Masking: keys >= n_k are hidden; with past >= 0, query i sees keys j <= past + i (causal,
// the new tokens of a sequence that has `past` tokens cached). `group` query heads share a
// kv head.
//
// Grid (ceil(n_q / BR), heads, batch), FA_WARPS warps; warp w owns MT row tiles of 16
// (BR = 16 · FA_WARPS · MT rows a CTA: 128 at head dim 64, 64 at 128). The last query tiles (the most keys, when causal) start first. Rows and
// keys past the ends are zero-filled, never read from memory.

#include "float.cuh"
#include "flash_common.cuh"
#include <stdint.h>

#define FA_WARPS 4
#define FA_BC 64

// c += a · b for one 16×8 tile (a 16×16 row-major, b 16×8 column-major fragments).
template <typename T> __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8×8 matrices of 16-bit elements from shared memory; lane l names row l % 8 of
// matrix l / 8. TRANS hands each lane the transposed element pair.
template <bool TRANS> __device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* smem) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  if (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// 16 bytes global → shared, or 16 zero bytes when !valid (nothing is read then).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Shared memory a CTA needs (the launch computes it): K and V tiles, double-buffered, rows
// padded by 8 elements so that the 8 rows an ldmatrix reads fall in distinct banks.

// MT: row tiles of 16 per warp. Two let each K and V fragment read from shared memory feed
// twice the MMAs, for more registers; at head dim 128 the queries then stay in shared
// memory (QS). Both are compiled, the launch picks.
template <typename T, int HD, int MT, bool PAGED>
__device__ void flash_attention(const T* __restrict__ q, long q_batch, long q_row, const T* __restrict__ k,
                                const T* __restrict__ v, long kv_batch, long kv_row,
                                const unsigned* __restrict__ table, int block_size, int kv_heads,
                                T* __restrict__ out, long o_batch, long o_row, int n_q, int n_k, int group, int past,
                                float scale_log2, const int* __restrict__ starts) {
  constexpr int LD = HD + 8, BR = 16 * FA_WARPS * MT;
  constexpr bool QS = HD > 64 && MT > 1;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* ks = reinterpret_cast<T*>(smem_raw);  // [2][FA_BC][LD]
  T* vs = ks + 2 * FA_BC * LD;             // [2][FA_BC][LD]

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int tile_q = gridDim.x - 1 - blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z, kvh = h / group;
  const int q0 = tile_q * BR + warp * 16 * MT;  // this warp's first row; row tile mt starts at q0 + 16·mt
  long q_off = b * q_batch, kv_off = b * kv_batch, o_off = b * o_batch;
  if (starts != nullptr) {
    // Variable length: batch row b is the rows starts[b]..starts[b + 1] of one packed
    // sequence; the grid covers the longest, CTAs past a shorter one's end have nothing to do.
    const int first = starts[b];
    n_q = n_k = starts[b + 1] - first;
    q_off = first * q_row;
    kv_off = first * kv_row;
    o_off = first * o_row;
    if (tile_q * BR >= n_q) return;
  }

  // The warp's query rows as A fragments, one per 16 dims: rows g and g + 8 of each tile.
  // With QS they stay in shared memory ([BR][LD], loaded with the first K/V tile) and are
  // read per use: at head dim 128 two row tiles' fragments would not fit in registers.
  T* qs = vs + 2 * FA_BC * LD;
  uint32_t qf[QS ? 1 : MT][QS ? 1 : HD / 16][4];
  const T* qb = q + q_off + (long)h * HD;
  if (QS) {
    const int first = tile_q * BR;
    for (int c = threadIdx.x; c < BR * HD / 8; c += FA_WARPS * 32) {
      const int r = c / (HD / 8), col = (c % (HD / 8)) * 8;
      const bool ok = first + r < n_q;
      cp_async16(qs + r * LD + col, ok ? qb + (long)(first + r) * q_row + col : qb, ok);
    }
  } else {
#pragma unroll
    for (int mt = 0; mt < (QS ? 0 : MT); ++mt) {
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = q0 + 16 * mt + g + 8 * half;
          const T* p = qb + (long)row * q_row + kk * 16 + 2 * t4;
          const bool ok = row < n_q;
          qf[mt][kk][half] = ok ? *reinterpret_cast<const uint32_t*>(p) : 0u;
          qf[mt][kk][half + 2] = ok ? *reinterpret_cast<const uint32_t*>(p + 8) : 0u;
        }
      }
    }
  }

  // Keys this CTA needs: up to its last query's causal limit.
  const int last_q = min(n_q, (tile_q + 1) * BR) - 1;
  const int kv_end = past >= 0 ? min(n_k, past + last_q + 1) : n_k;
  const int tiles = (kv_end + FA_BC - 1) / FA_BC;

  auto load = [&](int tile, int buf) {
    const int base = tile * FA_BC;
#pragma unroll
    for (int c = threadIdx.x; c < FA_BC * HD / 8; c += FA_WARPS * 32) {
      const int r = c / (HD / 8), col = (c % (HD / 8)) * 8;
      const int j = base + r;
      const bool ok = j < kv_end;
      long off = 0;
      if (ok) {
        if (PAGED)
          off = (((long)table[j / block_size] * kv_heads + kvh) * block_size + j % block_size) * HD + col;
        else
          off = kv_off + (long)j * kv_row + (long)kvh * HD + col;
      }
      cp_async16(ks + (buf * FA_BC + r) * LD + col, k + off, ok);
      cp_async16(vs + (buf * FA_BC + r) * LD + col, v + off, ok);
    }
    cp_async_commit();
  };

  float o[MT][HD / 8][4];
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int j = 0; j < HD / 8; ++j) o[mt][j][0] = o[mt][j][1] = o[mt][j][2] = o[mt][j][3] = 0.f;
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.f;
  }

  if (tiles > 0) load(0, 0);
  for (int t = 0; t < tiles; ++t) {
    const int buf = t & 1;
    if (t + 1 < tiles) {
      load(t + 1, buf ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    // The tile's scores and the product with V; MASKED: some keys are hidden (past n_k or
    // causal). Two instantiations, since the compiler turns the masking into several
    // instructions a score even where it is off.
    auto tile_body = [&](auto masked) {
      // Scores of the warp's rows against the tile's FA_BC keys; each K fragment feeds MT
      // row tiles.
      float s[MT][FA_BC / 8][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < FA_BC / 8; ++j) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
      const T* kt = ks + buf * FA_BC * LD;
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) {
        uint32_t qa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if (QS) {
            // Lanes 0-15 name rows 0-15 at dim 16kk, lanes 16-31 the same rows at 16kk + 8.
            const int row = warp * 16 * MT + 16 * mt + (lane & 15);
            ldsm_x4<false>(qa[mt], qs + row * LD + 16 * kk + ((lane >> 4) << 3));
          } else {
#pragma unroll
            for (int e = 0; e < 4; ++e) qa[mt][e] = qf[QS ? 0 : mt][QS ? 0 : kk][e];
          }
        }
#pragma unroll
        for (int jj = 0; jj < FA_BC / 16; ++jj) {
          uint32_t r[4];
          const int key = 16 * jj + (lane & 7) + ((lane >> 4) << 3);
          const int dim = 16 * kk + (((lane >> 3) & 1) << 3);
          ldsm_x4<false>(r, kt + key * LD + dim);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma<T>(s[mt][2 * jj], qa[mt], r[0], r[1]);
            mma<T>(s[mt][2 * jj + 1], qa[mt], r[2], r[3]);
          }
        }
      }

      // Online softmax in base 2 on the raw scores (scale > 0, so maxima commute with it):
      // p = 2^(s · scale_log2 − m · scale_log2), one FFMA and one EX2 per score. This lane
      // holds rows g (e = 0, 1) and g + 8 (e = 2, 3) of each row tile.
      const int kbase = t * FA_BC;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int j = 0; j < FA_BC / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if (decltype(masked)::value) {
              const int key = kbase + 8 * j + 2 * t4 + (e & 1), row = q0 + 16 * mt + g + ((e >> 1) << 3);
              if (key >= n_k || (past >= 0 && key > past + row)) s[mt][j][e] = -INFINITY;
            }
            mx[e >> 1] = fmaxf(mx[e >> 1], s[mt][j][e]);
          }
        }
        float base[2], alpha[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
          mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
          const float mnew = fmaxf(m[mt][r], mx[r]);
          base[r] = mnew == -INFINITY ? 0.f : mnew * scale_log2;  // every key so far hidden
          alpha[r] = fast_exp2(m[mt][r] * scale_log2 - base[r]);
          m[mt][r] = mnew;
          l[mt][r] *= alpha[r];
        }
#pragma unroll
        for (int j = 0; j < FA_BC / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float p = fast_exp2(fmaf(s[mt][j][e], scale_log2, -base[e >> 1]));
            s[mt][j][e] = p;
            l[mt][e >> 1] += p;
          }
        }
#pragma unroll
        for (int j = 0; j < HD / 8; ++j) {
          o[mt][j][0] *= alpha[0];
          o[mt][j][1] *= alpha[0];
          o[mt][j][2] *= alpha[1];
          o[mt][j][3] *= alpha[1];
        }
      }

      // o += p · v: the score accumulators of two adjacent key tiles are an A fragment; each
      // V fragment feeds MT row tiles.
      const T* vt = vs + buf * FA_BC * LD;
#pragma unroll
      for (int kk = 0; kk < FA_BC / 16; ++kk) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          a[mt][0] = pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
          a[mt][1] = pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
          a[mt][2] = pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
          a[mt][3] = pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int jj = 0; jj < HD / 16; ++jj) {
          uint32_t r[4];
          const int key = 16 * kk + (lane & 7) + (((lane >> 3) & 1) << 3);
          const int dim = 16 * jj + ((lane >> 4) << 3);
          ldsm_x4<true>(r, vt + key * LD + dim);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma<T>(o[mt][2 * jj], a[mt], r[0], r[1]);
            mma<T>(o[mt][2 * jj + 1], a[mt], r[2], r[3]);
          }
        }
      }
    };
    const int kbase = t * FA_BC;
    if (kbase + FA_BC > n_k || (past >= 0 && kbase + FA_BC - 1 > past + q0))
      tile_body(Bool<true>());
    else
      tile_body(Bool<false>());
    __syncthreads();  // the next iteration's load overwrites this buffer
  }

  // Normalise and write rows g and g + 8 of each row tile.
  T* ob = out + o_off + (long)h * HD;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[mt][r] += __shfl_xor_sync(0xffffffffu, l[mt][r], 1);
      l[mt][r] += __shfl_xor_sync(0xffffffffu, l[mt][r], 2);
      l[mt][r] = l[mt][r] > 0.f ? 1.f / l[mt][r] : 0.f;
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = q0 + 16 * mt + g + 8 * half;
      if (row >= n_q) continue;
      T* p = ob + (long)row * o_row + 2 * t4;
#pragma unroll
      for (int j = 0; j < HD / 8; ++j)
        *reinterpret_cast<uint32_t*>(p + 8 * j) =
            pack2<T>(o[mt][j][2 * half] * l[mt][half], o[mt][j][2 * half + 1] * l[mt][half]);
    }
  }
}

// Two row tiles of 16 a warp (one lost every A/B and is not compiled).
#define FLASH(suffix, T, HD)                                                                                      \
  extern "C" __global__ void __launch_bounds__(FA_WARPS * 32)                                                     \
      flash_dense_##suffix##_##HD(const T* q, long q_batch, long q_row, const T* k, const T* v, long kv_batch,   \
                                  long kv_row, T* out, long o_batch, long o_row, int n_q, int n_k, int group,    \
                                  int past, float scale_log2) {                                                  \
    flash_attention<T, HD, 2, false>(q, q_batch, q_row, k, v, kv_batch, kv_row, nullptr, 1, 1, out, o_batch,     \
                                     o_row, n_q, n_k, group, past, scale_log2, nullptr);                         \
  }                                                                                                               \
  extern "C" __global__ void __launch_bounds__(FA_WARPS * 32)                                                     \
      flash_varlen_##suffix##_##HD(const T* q, long q_row, const T* k, const T* v, long kv_row, T* out,          \
                                   long o_row, const int* starts, int group, float scale_log2) {                 \
    flash_attention<T, HD, 2, false>(q, 0, q_row, k, v, 0, kv_row, nullptr, 1, 1, out, 0, o_row, 0, 0, group,    \
                                     -1, scale_log2, starts);                                                     \
  }

// Prefill over the paged pool (the LMs' head dims).
#define FLASH_PAGED(suffix, T, HD)                                                                                \
  extern "C" __global__ void __launch_bounds__(FA_WARPS * 32)                                                     \
      flash_paged_##suffix##_##HD(const T* q, long q_row, const T* k, const T* v, const unsigned* table,         \
                                  int block_size, int kv_heads, T* out, long o_row, int n_q, int n_k, int group, \
                                  int past, float scale_log2) {                                                  \
    flash_attention<T, HD, 2, true>(q, 0, q_row, k, v, 0, 0, table, block_size, kv_heads, out, 0, o_row, n_q,    \
                                    n_k, group, past, scale_log2, nullptr);                                      \
  }

FLASH(bf16, __nv_bfloat16, 64)
FLASH(bf16, __nv_bfloat16, 80)
FLASH(bf16, __nv_bfloat16, 128)
FLASH(f16, __half, 64)
FLASH(f16, __half, 80)
FLASH(f16, __half, 128)
FLASH_PAGED(bf16, __nv_bfloat16, 64)
FLASH_PAGED(bf16, __nv_bfloat16, 128)
FLASH_PAGED(f16, __half, 64)
FLASH_PAGED(f16, __half, 128)
