// mask_logits: structured outputs' token masks applied where the logits are, so that only
// a bitmask (vocab / 8 bytes a row) crosses to the device, never a row of logits to the
// host. table is u32 [m, 1 + words]: the logits row it masks, then its bits (token t is
// allowed when bit t % 32 of word t / 32 is set; tokens past words * 32 are not). One
// thread a token: the 32 threads of a warp read one word, and writes are coalesced.
#include <math_constants.h>

extern "C" __global__ void mask_logits(float* __restrict__ logits, int n, const unsigned* __restrict__ table,
                                       int words) {
  const unsigned* entry = table + (size_t)blockIdx.y * (1 + words);
  float* row = logits + (size_t)entry[0] * n;
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= n) return;
  const int w = t >> 5;
  const bool allowed = w < words && ((entry[1 + w] >> (t & 31)) & 1u);
  if (!allowed) row[t] = -CUDART_INF_F;
}
