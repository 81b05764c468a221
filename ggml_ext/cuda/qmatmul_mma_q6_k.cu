// ggml_qmatmul's kernels for Q6_K weights (the tensor-core one, qmatmul_mma.cuh, its staged form, qmatmul_staged.cuh,
// and the one-column one of the same bits, qmatmul_stream.cuh), in a file of their own so that the build compiles the
// weight types in parallel.

#include "qmatmul_staged.cuh"

template void qmm_mma_run<GGML_TYPE_Q6_K>(const qmm_args & p, int nt, int rt, cudaStream_t stream);
template void qms_run<GGML_TYPE_Q6_K>(const qmm_args & p, int device, cudaStream_t stream);
template void qmm_staged_run<GGML_TYPE_Q6_K>(const qmm_args & p, int nt, int rt, int device, cudaStream_t stream);
