// Decode attention over the paged KV pool: one new query token per sequence attends over
// the sequence's cached keys and values, read in place through its block table.
//
// q:     [seqs, heads, head_dim], contiguous
// pool:  k and v, each [num_blocks, kv_heads, block_size, head_dim] (ARCHITECTURE.md's layout)
// meta:  [seqs, 1 + width] u32: the sequence's length (keys to attend over), then its block
//        table (only the first ceil(len / block_size) entries are read)
// out:   [seqs, heads, head_dim] in q's dtype
//
// Grid (heads, seqs, splits), WARPS warps per CTA. A CTA takes one query head of one
// sequence and one split: a run of `split_len` positions. Each warp walks every WARPS-th
// position of the split, one key row per step (lanes hold EPL consecutive elements of the
// row, so a warp reads a row in one coalesced sweep), keeping a running max, sum and
// weighted sum of values (online softmax, in f32). The warps then combine in shared memory.
// With one split the CTA writes the output; with several it writes its partial (max, sum,
// unnormalised sum of values) and `paged_decode_reduce` combines the splits. Splits exist
// for small batches: they give the GPU enough CTAs when seqs × heads alone would not.

#include "common.cuh"
#include "pdl.cuh"

#define WARPS 4

// Lane `lane`'s EPL elements of a row of `hd` values at `row` (zeros past the row's end).
// VEC: hd and the row's offset are multiples of EPL, so each lane's chunk is aligned and
// read in one load.
template <typename T, int EPL, bool VEC>
__device__ __forceinline__ void load_row(const T* __restrict__ row, int lane, int hd, float (&out)[EPL]) {
  const int d0 = lane * EPL;
  if (VEC && d0 + EPL <= hd) {
    constexpr int bytes = EPL * sizeof(T);
    T tmp[EPL];
    if constexpr (bytes % 16 == 0) {
#pragma unroll
      for (int c = 0; c < bytes / 16; ++c)
        reinterpret_cast<uint4*>(tmp)[c] = reinterpret_cast<const uint4*>(row + d0)[c];
    } else if constexpr (bytes == 8) {
      *reinterpret_cast<uint2*>(tmp) = *reinterpret_cast<const uint2*>(row + d0);
    } else if constexpr (bytes == 4) {
      *reinterpret_cast<unsigned*>(tmp) = *reinterpret_cast<const unsigned*>(row + d0);
    } else {
#pragma unroll
      for (int e = 0; e < EPL; ++e) tmp[e] = row[d0 + e];
    }
#pragma unroll
    for (int e = 0; e < EPL; ++e) out[e] = to_f32(tmp[e]);
  } else {
#pragma unroll
    for (int e = 0; e < EPL; ++e) out[e] = d0 + e < hd ? to_f32(row[d0 + e]) : 0.f;
  }
}

template <typename T, int EPL, bool VEC>
__device__ void paged_decode(const T* __restrict__ q, const T* __restrict__ kpool, const T* __restrict__ vpool,
                             const unsigned* __restrict__ meta, T* __restrict__ out, float* __restrict__ part_acc,
                             float* __restrict__ part_ml, int heads, int kv_heads, int block_size, int hd, int width,
                             int split_len, float scale) {
  const int h = blockIdx.x, s = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int kvh = h / (heads / kv_heads);
  const unsigned* seq_meta = meta + (long long)s * (1 + width);
  const int len = (int)seq_meta[0];
  const unsigned* table = seq_meta + 1;
  const int begin = split * split_len;
  const int end = min(len, begin + split_len);

  float qv[EPL];
  load_row<T, EPL, VEC>(q + ((long long)s * heads + h) * hd, lane, hd, qv);
#pragma unroll
  for (int e = 0; e < EPL; ++e) qv[e] *= scale;

  float m = -INFINITY, l = 0.f, acc[EPL];
#pragma unroll
  for (int e = 0; e < EPL; ++e) acc[e] = 0.f;

  auto row_of = [&](int p) {
    const long long block = table[p / block_size];
    return ((block * kv_heads + kvh) * block_size + p % block_size) * (long long)hd;
  };
  auto update = [&](float score, const float (&v)[EPL]) {
    const float m2 = fmaxf(m, score);
    const float c = expf(m - m2), w = expf(score - m2);
    l = l * c + w;
#pragma unroll
    for (int e = 0; e < EPL; ++e) acc[e] = acc[e] * c + w * v[e];
    m = m2;
  };
  // Two positions per step: both rows' loads are issued before either is used.
  int p = begin + warp;
  for (; p + WARPS < end; p += 2 * WARPS) {
    const long long r0 = row_of(p), r1 = row_of(p + WARPS);
    float k0[EPL], k1[EPL], v0[EPL], v1[EPL];
    load_row<T, EPL, VEC>(kpool + r0, lane, hd, k0);
    load_row<T, EPL, VEC>(kpool + r1, lane, hd, k1);
    load_row<T, EPL, VEC>(vpool + r0, lane, hd, v0);
    load_row<T, EPL, VEC>(vpool + r1, lane, hd, v1);
    float d0 = 0.f, d1 = 0.f;
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      d0 += qv[e] * k0[e];
      d1 += qv[e] * k1[e];
    }
    update(warp_sum(d0), v0);
    update(warp_sum(d1), v1);
  }
  if (p < end) {
    const long long r0 = row_of(p);
    float k0[EPL], v0[EPL];
    load_row<T, EPL, VEC>(kpool + r0, lane, hd, k0);
    load_row<T, EPL, VEC>(vpool + r0, lane, hd, v0);
    float d0 = 0.f;
#pragma unroll
    for (int e = 0; e < EPL; ++e) d0 += qv[e] * k0[e];
    update(warp_sum(d0), v0);
  }

  // Combine the warps: each writes its (max, sum) and its lanes' values.
  extern __shared__ float smem[];  // [WARPS * 2] then [WARPS * 32 * EPL]
  float* sm_ml = smem;
  float* sm_acc = smem + 2 * WARPS;
  if (lane == 0) {
    sm_ml[2 * warp] = m;
    sm_ml[2 * warp + 1] = l;
  }
#pragma unroll
  for (int e = 0; e < EPL; ++e) sm_acc[(warp * 32 + lane) * EPL + e] = acc[e];
  __syncthreads();
  float mx = -INFINITY;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, sm_ml[2 * w]);
  float weight[WARPS], total = 0.f;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) {
    // A warp that saw no position has max -inf and sum 0: weight 0 (and no NaN when
    // the whole split is empty).
    weight[w] = sm_ml[2 * w] == -INFINITY ? 0.f : expf(sm_ml[2 * w] - mx);
    total += sm_ml[2 * w + 1] * weight[w];
  }
  const long long head_row = (long long)s * heads + h;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    const int owner = d / EPL, e = d % EPL;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) sum += sm_acc[(w * 32 + owner) * EPL + e] * weight[w];
    if (splits == 1) {
      out[head_row * hd + d] = from_f32<T>(sum / total);
    } else {
      part_acc[(head_row * splits + split) * hd + d] = sum;
    }
  }
  if (splits > 1 && threadIdx.x == 0) {
    part_ml[(head_row * splits + split) * 2] = mx;
    part_ml[(head_row * splits + split) * 2 + 1] = total;
  }
}

// Grid (heads, seqs): combines the splits' partials of one head of one sequence.
template <typename T>
__device__ void paged_decode_reduce(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                    T* __restrict__ out, int heads, int hd, int splits) {
  const long long head_row = (long long)blockIdx.y * heads + blockIdx.x;
  const float* ml = part_ml + head_row * splits * 2;
  float mx = -INFINITY;
  for (int j = 0; j < splits; ++j) mx = fmaxf(mx, ml[2 * j]);
  float total = 0.f;
  for (int j = 0; j < splits; ++j) total += ml[2 * j] == -INFINITY ? 0.f : ml[2 * j + 1] * expf(ml[2 * j] - mx);
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float sum = 0.f;
    for (int j = 0; j < splits; ++j) {
      if (ml[2 * j] != -INFINITY) sum += part_acc[(head_row * splits + j) * hd + d] * expf(ml[2 * j] - mx);
    }
    out[head_row * hd + d] = from_f32<T>(sum / total);
  }
}

#define DECODE(NAME, T, EPL, VEC)                                                                              \
  extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                       \
      NAME(const T* q, const T* k, const T* v, const unsigned* meta, T* out, float* part_acc, float* part_ml,    \
           int heads, int kv_heads, int block_size, int hd, int width, int split_len, float scale) {             \
    paged_decode<T, EPL, VEC>(q, k, v, meta, out, part_acc, part_ml, heads, kv_heads, block_size, hd, width,     \
                              split_len, scale);                                                                 \
  }

#define DECODE_ALL(SUFFIX, T)                      \
  DECODE(paged_decode_##SUFFIX##_1, T, 1, false)   \
  DECODE(paged_decode_##SUFFIX##_2v, T, 2, true)   \
  DECODE(paged_decode_##SUFFIX##_2, T, 2, false)   \
  DECODE(paged_decode_##SUFFIX##_4v, T, 4, true)   \
  DECODE(paged_decode_##SUFFIX##_4, T, 4, false)   \
  DECODE(paged_decode_##SUFFIX##_8v, T, 8, true)   \
  DECODE(paged_decode_##SUFFIX##_8, T, 8, false)   \
  extern "C" __global__ void paged_decode_reduce_##SUFFIX(const float* part_acc, const float* part_ml, T* out, \
                                                          int heads, int hd, int splits) {                     \
    paged_decode_reduce<T>(part_acc, part_ml, out, heads, hd, splits);                                         \
  }

DECODE_ALL(f32, float)
DECODE_ALL(bf16, __nv_bfloat16)
DECODE_ALL(f16, __half)

// ---------------------------------------------------------------------------------------
// The tiled variant, for 16-bit T and head dims 64 and 128 with 16-byte aligned rows (the
// models we serve). The kernel above keeps two rows a warp in flight, each a dependent
// chain of loads, a warp sum and an exp: at batch 1 a layer's attention took 5× the time
// its bytes need. Here a row is read by LPR lanes in 16-byte loads (RPL rows a warp-load),
// and each lane issues all LOADS of its K and V rows before using any, so a warp has
// TILE rows in flight. Each group of LPR lanes keeps its own online softmax (base 2: q is
// pre-scaled by log2 e) over the rows it reads; the CTA combines its groups in shared
// memory, and with several splits the last CTA of a head to finish (an atomic count per
// head, reset by that CTA) combines the splits: no second launch.
#define TWARPS 4

template <typename T, int HD>
__device__ void paged_decode_tiled(const T* __restrict__ q, const T* __restrict__ kpool,
                                   const T* __restrict__ vpool, const unsigned* __restrict__ meta,
                                   T* __restrict__ out, float* __restrict__ part_acc, float* __restrict__ part_ml,
                                   unsigned* __restrict__ counters, int heads, int kv_heads, int block_size,
                                   int width, int split_len, float scale_log2) {
  constexpr int LPR = HD / 8;        // lanes per row, 8 elements (16 bytes) each
  constexpr int RPL = 32 / LPR;      // rows a warp reads per load
  constexpr int LOADS = 8;           // K (and V) loads in flight per lane
  constexpr int TILE = RPL * LOADS;  // rows per warp per step
  constexpr int STATES = TWARPS * RPL;
  // Before any read: the tables, too, are the step's, not weights (pdl.cuh).
  pdl_launch_dependents();
  pdl_wait();
  const int h = blockIdx.x, s = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int group = lane / LPR, sub = lane % LPR;
  const int kvh = h / (heads / kv_heads);
  const unsigned* seq_meta = meta + (size_t)s * (1 + width);
  const int len = (int)seq_meta[0];
  const unsigned* table = seq_meta + 1;
  const int begin = split * split_len;
  const int end = min(len, begin + split_len);
  const size_t head_row = (size_t)s * heads + h;

  float qf[8];
  unpack8(*reinterpret_cast<const uint4*>(q + head_row * HD + sub * 8), qf, (const T*)nullptr);
#pragma unroll
  for (int e = 0; e < 8; ++e) qf[e] *= scale_log2;

  float m = -INFINITY, l = 0.f, acc[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] = 0.f;
  for (int base = begin + warp * TILE; base < end; base += TWARPS * TILE) {
    uint4 kr[LOADS], vr[LOADS];
#pragma unroll
    for (int j = 0; j < LOADS; ++j) {
      // Rows past the end re-read the last one; their scores are dropped below.
      const int p = min(base + j * RPL + group, end - 1);
      const size_t row =
          (((size_t)table[p / block_size] * kv_heads + kvh) * block_size + p % block_size) * HD + sub * 8;
      kr[j] = *reinterpret_cast<const uint4*>(kpool + row);
      vr[j] = *reinterpret_cast<const uint4*>(vpool + row);
    }
    float sc[LOADS], mt = -INFINITY;
#pragma unroll
    for (int j = 0; j < LOADS; ++j) {
      float kf[8];
      unpack8(kr[j], kf, (const T*)nullptr);
      float d = 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) d = fmaf(qf[e], kf[e], d);
#pragma unroll
      for (int o = LPR / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
      sc[j] = base + j * RPL + group < end ? d : -INFINITY;
      mt = fmaxf(mt, sc[j]);
    }
    const float m2 = fmaxf(m, mt);
    // m2 is -inf only while this group has seen no row: nothing to add yet.
    const float c = m2 == -INFINITY ? 1.f : exp2f(m - m2);
    l *= c;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] *= c;
#pragma unroll
    for (int j = 0; j < LOADS; ++j) {
      const float p = sc[j] == -INFINITY ? 0.f : exp2f(sc[j] - m2);
      float vf[8];
      unpack8(vr[j], vf, (const T*)nullptr);
      l += p;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = fmaf(p, vf[e], acc[e]);
    }
    m = m2;
  }

  // The CTA's groups, combined: thread d < HD takes dimension d.
  __shared__ float sm_m[STATES], sm_l[STATES], sm_acc[STATES][HD];
  __shared__ bool last;
  const int st = warp * RPL + group;
  if (sub == 0) {
    sm_m[st] = m;
    sm_l[st] = l;
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) sm_acc[st][sub * 8 + e] = acc[e];
  __syncthreads();
  const int d = threadIdx.x;
  float mx = -INFINITY, total = 0.f, sum = 0.f;
  if (d < HD) {
#pragma unroll
    for (int i = 0; i < STATES; ++i) mx = fmaxf(mx, sm_m[i]);
#pragma unroll
    for (int i = 0; i < STATES; ++i) {
      // A group that saw no row has max -inf and sum 0: weight 0 (no NaN).
      const float w = sm_m[i] == -INFINITY ? 0.f : exp2f(sm_m[i] - mx);
      total += sm_l[i] * w;
      sum += sm_acc[i][d] * w;
    }
  }
  if (splits == 1) {
    // Position 0 is in the only split, so total > 0.
    if (d < HD) out[head_row * HD + d] = from_f32<T>(sum / total);
    return;
  }
  if (d < HD) {
    part_acc[(head_row * splits + split) * HD + d] = sum;
    if (d == 0) {
      part_ml[(head_row * splits + split) * 2] = mx;
      part_ml[(head_row * splits + split) * 2 + 1] = total;
    }
  }
  // Publish the partial, then count it; the CTA that counts last combines them all.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(counters + head_row, 1u) == (unsigned)splits - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (d < HD) {
    const float* ml = part_ml + head_row * splits * 2;
    float gm = -INFINITY;
    for (int j = 0; j < splits; ++j) gm = fmaxf(gm, __ldcg(ml + 2 * j));
    float gt = 0.f, gs = 0.f;
    for (int j = 0; j < splits; ++j) {
      const float mj = __ldcg(ml + 2 * j);
      if (mj == -INFINITY) continue;
      const float w = exp2f(mj - gm);
      gt += __ldcg(ml + 2 * j + 1) * w;
      gs += __ldcg(part_acc + (head_row * splits + j) * HD + d) * w;
    }
    out[head_row * HD + d] = from_f32<T>(gs / gt);
  }
  // Ready for the next launch (the next layer), which the stream orders after this one.
  if (threadIdx.x == 0) counters[head_row] = 0;
}

#define TILED(SUFFIX, T, HD)                                                                                   \
  extern "C" __global__ void __launch_bounds__(TWARPS * 32) paged_decode_tiled_##SUFFIX##_##HD(                \
      const T* q, const T* k, const T* v, const unsigned* meta, T* out, float* part_acc, float* part_ml,      \
      unsigned* counters, int heads, int kv_heads, int block_size, int width, int split_len, float scale) {   \
    paged_decode_tiled<T, HD>(q, k, v, meta, out, part_acc, part_ml, counters, heads, kv_heads, block_size,   \
                              width, split_len, scale);                                                       \
  }
TILED(bf16, __nv_bfloat16, 64)
TILED(bf16, __nv_bfloat16, 128)
TILED(f16, __half, 64)
TILED(f16, __half, 128)
