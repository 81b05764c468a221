#pragma once

// Shared by the CPU and CUDA kernels of the tree ops. Host and device.
#if defined(__CUDACC__)
#define GGML_EXT_HD __host__ __device__ inline
#else
#define GGML_EXT_HD static inline
#endif

// The parent of node t, or -1. An index that does not precede t (which the Python wrapper rejects) is read as
// -1, so a bad parent array yields wrong numbers but never an out-of-bounds access.
GGML_EXT_HD int ggml_ext_parent(const int * parent, int t) {
    const int p = parent[t];
    return (p >= 0 && p < t) ? p : -1;
}

// Column of sx (d_conv-1 state columns, then one per token) for each of token t's d_conv window taps,
// oldest first: cols[d_conv-1] is t itself, then its ancestors, then state columns newest first.
GGML_EXT_HD void ggml_ext_conv_tree_window(const int * parent, int t, int d_conv, int * cols) {
    int node  = t;
    int state = d_conv - 1;  // the next state column to use is state-1
    cols[d_conv - 1] = d_conv - 1 + t;
    for (int j = d_conv - 2; j >= 0; --j) {
        if (node >= 0) {
            node = ggml_ext_parent(parent, node);
        }
        cols[j] = node >= 0 ? d_conv - 1 + node : --state;
    }
}
