// cuBLAS, found at run time in the process instead of linked: JAX's CUDA plugin has already loaded
// it (jaxgin uses the same copy), and the backend then builds with no cuBLAS headers or wheel. Only
// the entry points the chunked matmul ops call are declared, with the values of cuBLAS's C ABI.
#pragma once
#include <cuda_runtime.h>
#include <library_types.h>

namespace jaxgin::blas {

using Handle = void*;

constexpr int kOpN = 0;                  // cublasOperation_t CUBLAS_OP_N
constexpr int kCompute32F = 68;          // cublasComputeType_t CUBLAS_COMPUTE_32F
constexpr int kCompute32FFastTF32 = 77;  // CUBLAS_COMPUTE_32F_FAST_TF32
constexpr int kGemmDefault = -1;         // cublasGemmAlgo_t CUBLAS_GEMM_DEFAULT

struct Api {
  int (*create)(Handle*);
  int (*destroy)(Handle);
  int (*set_stream)(Handle, cudaStream_t);
  int (*set_workspace)(Handle, void*, size_t);
  int (*gemm_ex)(Handle, int transa, int transb, int m, int n, int k, const void* alpha, const void* a,
                 cudaDataType a_type, int lda, const void* b, cudaDataType b_type, int ldb, const void* beta,
                 void* c, cudaDataType c_type, int ldc, int compute_type, int algo);
};

// The process's cuBLAS; throws an Error that says what to install when there is none.
const Api& api();

// Row-major C[m, n] = A[m, k] @ B[k, n] (float32 accumulation) with leading dimensions (elements per
// row) lda, ldb, ldc, on the stream the handle was last set to. Throws an Error naming `what`.
void gemm_row_major(Handle handle, cudaDataType type, int compute_type, int m, int n, int k, const void* a,
                    int lda, const void* b, int ldb, void* c, int ldc, const char* what);

}  // namespace jaxgin::blas
