// ggml_qmatmul's tensor-core kernel for Q4_K weights (qmatmul_mma.cuh), in a file of its own so that the build
// compiles the four weight types in parallel.

#include "qmatmul_mma.cuh"

template void qmm_mma_run<GGML_TYPE_Q4_K>(const qmm_args & p, int nt, int rt, cudaStream_t stream);
