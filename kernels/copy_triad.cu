// copy_triad.cu -- device memory (HBM) bandwidth, STREAM style.
//
// What it measures: achievable device-memory bandwidth of one GPU, as a
// reference ceiling for the communication benchmarks.
//   copy_kernel : dst[i] = src[i]           bytes moved per launch = 2 * n * 16 B
//   triad_kernel: c[i]   = a[i] + s * b[i]  bytes moved per launch = 3 * n * 16 B
// (n counts float4 elements, 16 B each; bandwidth = bytes moved / kernel time.)
//
// How it checks itself: after a timed launch the host copies dst / c back and
// compares it against a numpy/cupy reference computed from the same inputs
// (copy: exact equality with src; triad: a + s*b, allclose in float32).
//
// Both kernels are extern "C" so cupy.RawModule finds them by name; they use a
// grid-stride loop, so any grid size covers any n.

extern "C" __global__ void copy_kernel(const float4* __restrict__ src,
                                       float4* __restrict__ dst, size_t n)
{
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        dst[i] = src[i];
    }
}

extern "C" __global__ void triad_kernel(const float4* __restrict__ a,
                                        const float4* __restrict__ b,
                                        float4* __restrict__ c, float s, size_t n)
{
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float4 x = a[i];
        const float4 y = b[i];
        float4 r;
        r.x = x.x + s * y.x;
        r.y = x.y + s * y.y;
        r.z = x.z + s * y.z;
        r.w = x.w + s * y.w;
        c[i] = r;
    }
}
