// Thread-block clusters at one block an SM on this GPU: how many clusters of C blocks can be resident at once
// (cudaOccupancyMaxActiveClusters) for the f16 kernel's block shapes, and whether a grid of that many clusters
// really starts at once (each block writes its start time and SM; a grid that fits starts within ~1-2 us and ends
// after one spin). For a cut-tile hand-off through distributed shared memory in the f16 kernel (qmatmul_shared.cuh;
// docs/benchmarks.md, thirty-sixth session: 30 clusters of 4, 39 of 3, 66 of 2 on an H100 80GB HBM3).
//
//   nvcc -O2 -arch=sm_90a -o /tmp/cluster_probe tools/cluster_probe.cu && /tmp/cluster_probe
#include <cstdio>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>

#define CHECK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    printf("%s: %s\n", #x, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void spin(unsigned long long * start, int * sm, long long cycles) {
    extern __shared__ char smem[];
    if (threadIdx.x == 0) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        int id;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
        start[blockIdx.x] = t;
        sm[blockIdx.x] = id;
        smem[0] = 1;
    }
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
}

static cudaLaunchConfig_t config(int blocks, int threads, size_t smem, int C, cudaLaunchAttribute * attr) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = smem;
    attr->id = cudaLaunchAttributeClusterDimension;
    attr->val.clusterDim.x = C;
    attr->val.clusterDim.y = 1;
    attr->val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cfg;
}

int main() {
    int n_sm = 0;
    CHECK(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, 0));
    CHECK(cudaFuncSetAttribute(spin, cudaFuncAttributeMaxDynamicSharedMemorySize, 220 * 1024));
    CHECK(cudaFuncSetAttribute(spin, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    printf("SMs %d\n", n_sm);
    struct shape { int warps; size_t smem; } shapes[] = {{8, 184 * 1024}, {10, 198 * 1024}, {12, 210 * 1024}, {16, 210 * 1024}};
    for (const shape & s : shapes) {
        printf("%2d warps, %zu KB: max active clusters by size", s.warps, s.smem / 1024);
        for (int C = 1; C <= 8; ++C) {
            cudaLaunchAttribute attr;
            cudaLaunchConfig_t cfg = config(C * 16, 32 * s.warps, s.smem, C, &attr);
            int n = 0;
            CHECK(cudaOccupancyMaxActiveClusters(&n, spin, &cfg));
            printf("  %d:%d (%d blocks)", C, n, n * C);
        }
        printf("\n");
    }
    unsigned long long * start;
    int * sm;
    CHECK(cudaMalloc(&start, 1024 * sizeof(unsigned long long)));
    CHECK(cudaMalloc(&sm, 1024 * sizeof(int)));
    struct grid { int clusters, C, warps; size_t smem; } grids[] = {
        {32, 4, 10, 198 * 1024}, {33, 4, 10, 198 * 1024}, {40, 3, 8, 184 * 1024}, {64, 2, 8, 184 * 1024},
        {66, 2, 8, 184 * 1024}, {20, 6, 16, 210 * 1024}, {120, 1, 8, 184 * 1024}};
    const long long cycles = 40000;   // ~20 us at 1.98 GHz
    for (const grid & g : grids) {
        const int blocks = g.clusters * g.C;
        cudaLaunchAttribute attr;
        cudaLaunchConfig_t cfg = config(blocks, 32 * g.warps, g.smem, g.C, &attr);
        for (int rep = 0; rep < 3; ++rep) {
            CHECK(cudaLaunchKernelEx(&cfg, spin, start, sm, cycles));
            CHECK(cudaDeviceSynchronize());
        }
        std::vector<unsigned long long> t(blocks);
        std::vector<int> s(blocks);
        CHECK(cudaMemcpy(t.data(), start, blocks * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(s.data(), sm, blocks * sizeof(int), cudaMemcpyDeviceToHost));
        const unsigned long long t0 = *std::min_element(t.begin(), t.end());
        std::vector<double> d(blocks);
        for (int i = 0; i < blocks; ++i) {
            d[i] = (t[i] - t0) * 1e-3;
        }
        std::sort(d.begin(), d.end());
        std::sort(s.begin(), s.end());
        const int distinct = (int) (std::unique(s.begin(), s.end()) - s.begin());
        printf("%d clusters of %d (%d warps, %zu KB): %d blocks on %d SMs, start us after the first: median %.2f, "
               "90%% %.2f, last %.2f\n", g.clusters, g.C, g.warps, g.smem / 1024, blocks, distinct,
               d[blocks / 2], d[blocks * 9 / 10], d[blocks - 1]);
    }
    return 0;
}
