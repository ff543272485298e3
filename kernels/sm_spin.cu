// sm_spin.cu -- a compute kernel that occupies a chosen number of SMs.
//
// What it measures: the interference between compute and communication. Launch
// sm_spin_kernel with exactly num_sms blocks of 1024 threads (with num_sms at most
// the SM count the block scheduler spreads them one per SM; two such blocks could
// share an SM, so the host should confirm the spread, e.g. by timing num_sms vs
// 2 x num_sms blocks) while an NCCL collective runs on
// another stream, and compare with each alone: how much the collective slows
// the compute (kernel time) and how much the compute slows the collective
// (bus bandwidth), as num_sms varies.
// Each thread runs a dependent FMA chain of `iters` steps,
//     x = fmaf(x, 0.5f, 0.5f),   x0 = (float)(threadIdx.x & 31),
// and writes x to out[blockIdx.x * blockDim.x + threadIdx.x], so the compiler
// cannot drop the loop (iters is a runtime value, the result is stored).
// out must hold num_sms * 1024 floats.
//
// How it checks itself: the host reproduces the recurrence exactly with numpy
// float32 in a loop for small iters (x = np.float32(x) * np.float32(0.5) +
// np.float32(0.5)): multiplying by 0.5 is exact, so the fused and unfused
// forms round identically, and out[i] must equal the host value bit for bit.
//
// extern "C" so cupy.RawModule finds it by name.

extern "C" __global__ void __launch_bounds__(1024)
sm_spin_kernel(float* out, long long iters)
{
    float x = (float)(threadIdx.x & 31u);
    for (long long k = 0; k < iters; ++k) {
        x = fmaf(x, 0.5f, 0.5f);
    }
    out[(size_t)blockIdx.x * blockDim.x + threadIdx.x] = x;
}
