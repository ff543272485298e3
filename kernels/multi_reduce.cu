// multi_reduce.cu -- the arithmetic inside an all-reduce.
//
// What it measures: how fast one GPU can sum nsrc buffers element-wise into
// dst, i.e. the reduction step of a ring / tree / one-shot all-reduce, without
// any network. srcs is a device array of nsrc device pointers (which may be
// peer pointers on other GPUs when peer access is enabled).
// Bytes moved per launch = (nsrc + 1) * n * elsize  (nsrc reads + one write;
// elsize = 4 for multi_reduce_kernel, 2 for multi_reduce_half_kernel).
//
// How it checks itself: the host compares dst against the host sum of the same
// nsrc inputs (numpy, float32 accumulation; allclose, with a looser tolerance
// for the __half variant, which accumulates in float and rounds once to half).
//
// extern "C" so cupy.RawModule finds them by name; grid-stride loops.

#include <cuda_fp16.h>

extern "C" __global__ void multi_reduce_kernel(const float* const* srcs, int nsrc,
                                               float* dst, size_t n)
{
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float acc = 0.0f;
        for (int k = 0; k < nsrc; ++k) {
            acc += srcs[k][i];
        }
        dst[i] = acc;
    }
}

extern "C" __global__ void multi_reduce_half_kernel(const __half* const* srcs, int nsrc,
                                                    __half* dst, size_t n)
{
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float acc = 0.0f;
        for (int k = 0; k < nsrc; ++k) {
            acc += __half2float(srcs[k][i]);
        }
        dst[i] = __float2half(acc);
    }
}
