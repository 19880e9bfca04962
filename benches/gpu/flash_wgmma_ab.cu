// A/B timing of flash_wgmma.cu's kernels on CLIP-L's attention at 32 images (577 tokens,
// 16 heads of 64, q/k/v side by side in rows of 3·1024), with the outputs checked against
// a plain f32 attention on the device. Development tool, not part of the build:
//   nvcc -O3 -arch=sm_90a -I kernels -DKERNELS='"flash_wgmma.cu"' -o /tmp/fab benches/gpu/flash_wgmma_ab.cu
// (KERNELS may name a variant of the file, to weigh one change in isolation), then
//   /tmp/fab [images] [repeats]
// Exits 1 if a kernel's output strays from the reference by more than bf16's rounding
// allows (or holds a NaN: the output starts poisoned).
#include KERNELS

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                  \
  do {                                                                            \
    cudaError_t e = (x);                                                          \
    if (e != cudaSuccess) {                                                       \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      exit(1);                                                                    \
    }                                                                             \
  } while (0)

// One thread a (row, head, image): two passes over the keys in f32.
__global__ void reference(const __nv_bfloat16* qkv, float* out, int n, int heads, float scale) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x, h = blockIdx.y, b = blockIdx.z;
  if (i >= n) return;
  const long row = 3L * heads * 64;
  const __nv_bfloat16* q = qkv + (long)b * n * row + (long)i * row + h * 64;
  float mx = -INFINITY;
  for (int j = 0; j < n; ++j) {
    const __nv_bfloat16* k = qkv + (long)b * n * row + (long)j * row + heads * 64 + h * 64;
    float s = 0.f;
    for (int d = 0; d < 64; ++d) s += __bfloat162float(q[d]) * __bfloat162float(k[d]);
    mx = fmaxf(mx, s * scale);
  }
  float acc[64] = {}, sum = 0.f;
  for (int j = 0; j < n; ++j) {
    const __nv_bfloat16* k = qkv + (long)b * n * row + (long)j * row + heads * 64 + h * 64;
    const __nv_bfloat16* v = k + heads * 64;
    float s = 0.f;
    for (int d = 0; d < 64; ++d) s += __bfloat162float(q[d]) * __bfloat162float(k[d]);
    const float p = expf(s * scale - mx);
    sum += p;
    for (int d = 0; d < 64; ++d) acc[d] += p * __bfloat162float(v[d]);
  }
  float* o = out + ((long)b * n + i) * heads * 64 + h * 64;
  for (int d = 0; d < 64; ++d) o[d] = acc[d] / sum;
}

typedef void (*Kernel)(const __nv_bfloat16*, long, long, const __nv_bfloat16*, const __nv_bfloat16*, long, long,
                       __nv_bfloat16*, long, long, int, int, int, int, float);

int main(int argc, char** argv) {
  const int images = argc > 1 ? atoi(argv[1]) : 32, repeats = argc > 2 ? atoi(argv[2]) : 50;
  const int n = 577, heads = 16, width = heads * 64;
  const long elems = (long)images * n * 3 * width, outs = (long)images * n * width;
  std::vector<__nv_bfloat16> host(elems);
  srand(7);
  // Scores of a few units (q·k/8 with entries of ±2): the running max moves often.
  for (long i = 0; i < elems; ++i) host[i] = __float2bfloat16(4.f * (rand() / (float)RAND_MAX - 0.5f));
  __nv_bfloat16 *qkv, *out;
  float* ref;
  CHECK(cudaMalloc(&qkv, elems * 2));
  CHECK(cudaMalloc(&out, outs * 2));
  CHECK(cudaMalloc(&ref, outs * 4));
  CHECK(cudaMemcpy(qkv, host.data(), elems * 2, cudaMemcpyHostToDevice));
  const float scale = 0.125f;
  reference<<<dim3((n + 127) / 128, heads, images), 128>>>(qkv, ref, n, heads, scale);
  CHECK(cudaDeviceSynchronize());
  std::vector<float> want(outs);
  CHECK(cudaMemcpy(want.data(), ref, outs * 4, cudaMemcpyDeviceToHost));

  struct Case {
    const char* name;
    Kernel f;
    int groups, stages;
  } cases[] = {
      {"2 groups, pipelined", flash_wgmma_pipe_bf16, 2, FW_STAGES(true)},
      {"2 groups, serial", flash_wgmma_bf16, 2, FW_STAGES(false)},
      {"1 group, pipelined", flash_wgmma1_pipe_bf16, 1, FW_STAGES(true)},
  };
  const double flops = 4.0 * images * heads * (double)n * n * 64;
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  std::vector<__nv_bfloat16> got(outs);
  bool ok = true;
  for (const Case& c : cases) {
    const int rows = 64 * c.groups, smem = 1024 + (rows + 2 * c.stages * 64) * 128;
    CHECK(cudaFuncSetAttribute(c.f, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const dim3 grid((n + rows - 1) / rows, heads, images);
    const long qb = (long)n * 3 * width, qr = 3 * width;
    auto launch = [&] {
      c.f<<<grid, 128 * c.groups, smem>>>(qkv, qb, qr, qkv + width, qkv + 2 * width, qb, qr, out, (long)n * width,
                                          width, n, n, 1, -1, scale * 1.4426950408889634f);
    };
    CHECK(cudaMemset(out, 0xff, outs * 2));  // poisoned: NaN in bf16
    launch();
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(got.data(), out, outs * 2, cudaMemcpyDeviceToHost));
    // Outputs are averages of values within ±2: a few bf16 steps of 2^-7 at most.
    double err = 0;
    for (long i = 0; i < outs; ++i) {
      const double d = fabs((double)__bfloat162float(got[i]) - want[i]);
      if (d != d) err = INFINITY;
      else if (d > err) err = d;
    }
    ok &= err <= 0.02;
    for (int i = 0; i < 5; ++i) launch();
    CHECK(cudaEventRecord(t0));
    for (int i = 0; i < repeats; ++i) launch();
    CHECK(cudaEventRecord(t1));
    CHECK(cudaEventSynchronize(t1));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, t0, t1));
    const double us = 1e3 * ms / repeats;
    printf("%-22s %8.1f us  %6.1f TFLOP/s  max abs err %.3g\n", c.name, us, flops / us / 1e6, err);
  }
  return ok ? 0 : 1;
}
