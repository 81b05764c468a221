// Programmatic dependent launch on this GPU, probed: does a dependent kernel that waits (griddepcontrol.wait, ggml's
// ggml_cuda_pdl_sync) see the writes its primary made after letting it launch early (launch_dependents,
// ggml_cuda_pdl_lc)? And what does one that does not wait see? A producer of 264 blocks writes a marker over 4 MB
// after a ~10 us spin, with or without an early trigger; a consumer launched programmatically after it counts the
// stale values it reads, with or without its wait; 200 pairs each. H100, twenty-eighth session: 0 stale reads
// wherever the consumer waits (early trigger or not), 0 without the wait and without the early trigger, all
// 209,715,200 without the wait after an early trigger. So every kernel that ggml_ext launches through
// ggml_cuda_kernel_launch must wait before reading its inputs, early trigger or not (docs/benchmarks.md).
//
//   nvcc -O2 -arch=sm_90 -o /tmp/pdl_probe tools/pdl_probe.cu && /tmp/pdl_probe
#include <cstdio>
#include <cuda_runtime.h>
__global__ void producer(int * buf, int n, int marker, int early, long long spin) {
    if (early) cudaTriggerProgrammaticLaunchCompletion();
    long long t0 = clock64();
    while (clock64() - t0 < spin) {}
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) buf[i] = marker;
}
__global__ void consumer(const int * buf, int n, int marker, int * bad, int wait) {
    if (wait) cudaGridDependencySynchronize();
    int b = 0;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) b += buf[i] != marker;
    if (b) atomicAdd(bad, b);
}
int main() {
    const int n = 1 << 20;
    int *buf, *bad;
    cudaMalloc(&buf, n * 4); cudaMalloc(&bad, 4);
    cudaStream_t st; cudaStreamCreate(&st);
    for (int early = 0; early < 2; ++early) for (int wait = 0; wait < 2; ++wait) {
        cudaMemset(bad, 0, 4);
        for (int it = 1; it <= 200; ++it) {
            cudaLaunchAttribute attr; attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
            attr.val.programmaticStreamSerializationAllowed = 1;
            cudaLaunchConfig_t cfg = {}; cfg.gridDim = dim3(264); cfg.blockDim = dim3(256); cfg.stream = st;
            cfg.attrs = &attr; cfg.numAttrs = 1;
            cudaLaunchKernelEx(&cfg, producer, buf, n, it + 1000 * (2 * early + wait), early, (long long) 20000);
            cudaLaunchKernelEx(&cfg, consumer, (const int *) buf, n, it + 1000 * (2 * early + wait), bad, wait);
        }
        int h; cudaStreamSynchronize(st); cudaMemcpy(&h, bad, 4, cudaMemcpyDeviceToHost);
        printf("early trigger %d, consumer waits %d: %d stale reads over 200 pairs (%s)\n", early, wait, h,
               cudaGetErrorString(cudaGetLastError()));
    }
    return 0;
}
