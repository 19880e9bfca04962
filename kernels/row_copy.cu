// copy_blocks16: `blocks` equal runs of `len` 16-byte chunks, run i read at src + i·stride
// and written packed (dst + i·len). LLaVA's feature selection drops each image's class
// row from the tower's [B, 577, D] output: candle's strided copy computes a three-dimension
// index per 2-byte element (184 µs at CLIP-L's batch of 32 on the H200); as runs of 16-byte
// chunks it is a plain copy.
#include <stdint.h>

extern "C" __global__ void copy_blocks16(const uint4* __restrict__ src, uint4* __restrict__ dst, long blocks, long len,
                                         long stride) {
  for (long i = blockIdx.y; i < blocks; i += gridDim.y)
    for (long c = (long)blockIdx.x * blockDim.x + threadIdx.x; c < len; c += (long)gridDim.x * blockDim.x)
      dst[i * len + c] = src[i * stride + c];
}
