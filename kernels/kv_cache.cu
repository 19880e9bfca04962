// Writes the keys (or values) of new tokens into one layer of the paged KV pool.
//
// pool:  [num_blocks, kv_heads, block_size, head_dim]  (the layout of ARCHITECTURE.md)
// src:   [n_tokens, kv_heads, head_dim], contiguous
// slots: [n_tokens], token t goes to block slots[t] / block_size, row slots[t] % block_size
//
// Blocks of (32, 8) threads: each y takes one (token, head) row, whose block and row it
// finds once; its x threads copy the row in words, 16 bytes each where the row's size
// and both base addresses allow (`_w16`), else one element each. The copy is bitwise, so
// one kernel serves every dtype of a width (b16: bf16 and f16; b32: f32). (One thread
// per element with 64-bit index arithmetic made a 2,048-token prefill's writes run at
// a twentieth of the memory bandwidth.)

template <typename W>
__device__ void write_kv(W* pool, const W* src, const unsigned int* slots, int rows, int kv_heads, int block_size,
                         int words) {
  const int row = blockIdx.x * blockDim.y + threadIdx.y;
  if (row >= rows) return;
  const int t = row / kv_heads, h = row - t * kv_heads;
  const unsigned int slot = slots[t];
  const long long block = slot / block_size;
  const int off = (int)(slot - block * block_size);
  W* dst = pool + ((block * kv_heads + h) * block_size + off) * words;
  const W* from = src + (long long)row * words;
  for (int i = threadIdx.x; i < words; i += blockDim.x) dst[i] = from[i];
}

extern "C" __global__ void write_kv_b16(unsigned short* pool, const unsigned short* src, const unsigned int* slots,
                                        int rows, int kv_heads, int block_size, int words) {
  write_kv(pool, src, slots, rows, kv_heads, block_size, words);
}

extern "C" __global__ void write_kv_b32(unsigned int* pool, const unsigned int* src, const unsigned int* slots,
                                        int rows, int kv_heads, int block_size, int words) {
  write_kv(pool, src, slots, rows, kv_heads, block_size, words);
}

extern "C" __global__ void write_kv_w16(uint4* pool, const uint4* src, const unsigned int* slots, int rows,
                                        int kv_heads, int block_size, int words) {
  write_kv(pool, src, slots, rows, kv_heads, block_size, words);
}
