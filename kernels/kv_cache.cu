// Writes the keys (or values) of new tokens into one layer of the paged KV pool.
//
// pool:  [num_blocks, kv_heads, block_size, head_dim]  (the layout of ARCHITECTURE.md)
// src:   [n_tokens, kv_heads, head_dim], contiguous
// slots: [n_tokens], token t goes to block slots[t] / block_size, row slots[t] % block_size
//
// One thread per element, grid-stride; the copy is bitwise, so one kernel serves every
// dtype of a width (b16: bf16 and f16; b32: f32).

template <typename T>
__device__ void write_kv(T* pool, const T* src, const unsigned int* slots, int n_tokens, int kv_heads,
                         int block_size, int head_dim) {
  const long long total = (long long)n_tokens * kv_heads * head_dim;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    const int d = (int)(i % head_dim);
    const long long row = i / head_dim;
    const int h = (int)(row % kv_heads);
    const long long t = row / kv_heads;
    const unsigned int slot = slots[t];
    const long long block = slot / block_size;
    const int off = slot % block_size;
    pool[((block * kv_heads + h) * block_size + off) * head_dim + d] = src[i];
  }
}

extern "C" __global__ void write_kv_b16(unsigned short* pool, const unsigned short* src, const unsigned int* slots,
                                        int n_tokens, int kv_heads, int block_size, int head_dim) {
  write_kv(pool, src, slots, n_tokens, kv_heads, block_size, head_dim);
}

extern "C" __global__ void write_kv_b32(unsigned int* pool, const unsigned int* src, const unsigned int* slots,
                                        int n_tokens, int kv_heads, int block_size, int head_dim) {
  write_kv(pool, src, slots, n_tokens, kv_heads, block_size, head_dim);
}
