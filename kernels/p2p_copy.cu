// p2p_copy.cu -- peer-to-peer copy between two GPUs of one node.
//
// What it measures: unidirectional and bidirectional GPU<->GPU bandwidth over
// NVLink or PCIe, done by SM load/store instructions rather than copy engines.
// The host enables peer access (cudaDeviceEnablePeerAccess) and launches
// p2p_copy_kernel on one device with one of the two pointers on the peer:
//   remote read : kernel runs on the destination GPU, src is the peer pointer
//   remote write: kernel runs on the source GPU,      dst is the peer pointer
//   bidirectional: two launches at once, one on each device, each copying
//                  towards the other (both directions busy simultaneously).
// Bytes moved across the link per launch = n * 16 B (n float4 elements);
// bidirectional bandwidth counts both launches.
//
// How it checks itself: after the copy the host compares dst with src
// (exact equality, both copied back to the host) for every direction tested.
//
// extern "C" so cupy.RawModule finds it by name; grid-stride loop.

extern "C" __global__ void p2p_copy_kernel(const float4* __restrict__ src,
                                           float4* __restrict__ dst, size_t n)
{
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        dst[i] = src[i];
    }
}
