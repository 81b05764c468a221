// The f16 kernel's tagged hand-off (qmatmul_shared.cuh: qmm_half_shared's TAG; PYDFLASH_QMATMUL_HANDOFF=1), in a file
// of its own so that the build compiles its instantiations beside qmatmul.cu's

#include "ggml-ext-cuda.cuh"
#include "qmatmul_shared.cuh"

template <ggml_type type, bool GLU> void qmh_run_tagged(const qmh_args & p, int device, int P, cudaStream_t stream) {
    qmh_run<type, GLU, true>(p, device, P, stream);
}

template void qmh_run_tagged<GGML_TYPE_Q4_K, false>(const qmh_args & p, int device, int P, cudaStream_t stream);
template void qmh_run_tagged<GGML_TYPE_Q4_K, true>(const qmh_args & p, int device, int P, cudaStream_t stream);
template void qmh_run_tagged<GGML_TYPE_Q6_K, false>(const qmh_args & p, int device, int P, cudaStream_t stream);
template void qmh_run_tagged<GGML_TYPE_BF16, false>(const qmh_args & p, int device, int P, cudaStream_t stream);
