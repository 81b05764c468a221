#pragma once

// What ggml-cuda.cu would provide to a lab (tools/qmm_lab.cu, tools/fa_lab.cu) that includes ggml_ext's kernel
// headers without linking ggml: CUDA_CHECK's reporter, the current device, the device table (this machine's device
// 0 only) and GGML_ABORT's target; and the labs' own pieces: CK, their check of a CUDA call, and time_graph, their
// timing. Include after the kernel headers.

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)

// CUDA_CHECK (in ggml_cuda_kernel_launch) reports through it
void ggml_cuda_error(const char * stmt, const char * func, const char * file, int line, const char * msg) {
    fprintf(stderr, "CUDA error %s at %s (%s:%d): %s\n", msg, func, file, line, stmt);
    exit(1);
}

// for ggml_cuda_kernel_launch and GGML_ABORT
int ggml_cuda_get_device() {
    int d;
    CK(cudaGetDevice(&d));
    return d;
}

// for the launchers that size themselves from the device
const ggml_cuda_device_info & ggml_cuda_info() {
    static const ggml_cuda_device_info info = [] {
        ggml_cuda_device_info i = {};
        cudaDeviceProp p;
        CK(cudaGetDeviceProperties(&p, 0));
        i.device_count = 1;
        i.devices[0].cc    = 100 * p.major + 10 * p.minor;
        i.devices[0].nsm   = p.multiProcessorCount;
        i.devices[0].smpb  = p.sharedMemPerBlock;
        i.devices[0].smpbo = p.sharedMemPerBlockOptin;
        return i;
    }();
    return info;
}

void ggml_abort(const char * file, int line, const char * fmt, ...) {
    fprintf(stderr, "abort at %s:%d: %s\n", file, line, fmt);
    exit(1);
}

// median time per launch (us) of `launch(copy)` for every copy, in one graph
template <typename F> static double time_graph(F launch, int copies, cudaStream_t st, int reps = 10) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int c = 0; c < copies; ++c) launch(c);
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<float> t;
    for (int r = 0; r < reps + 2; ++r) {
        CK(cudaEventRecord(e0, st));
        CK(cudaGraphLaunch(ge, st));
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (r >= 2) t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    return 1000.0 * t[t.size() / 2] / copies;
}
