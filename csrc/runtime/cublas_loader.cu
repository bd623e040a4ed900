#include "cublas_loader.h"

#include <dlfcn.h>

#include <mutex>
#include <string>

#include "errors.h"

namespace jaxgin::blas {
namespace {

void* open_cublas() {
  // Already in the process (XLA loads it) first, then the dynamic linker's search path.
  for (int flags : {RTLD_NOW | RTLD_NOLOAD, RTLD_NOW})
    for (const char* name : {"libcublas.so.13", "libcublas.so.12", "libcublas.so"})
      if (void* handle = dlopen(name, flags)) return handle;
  throw Error(
      "cuBLAS is not loaded in this process and libcublas.so.13 is not on the library path; the fused "
      "matmul ops call the cuBLAS that JAX's CUDA plugin uses (pip install 'jax[cuda13]' provides it)");
}

template <typename F>
void bind(void* handle, const char* name, F& out) {
  out = reinterpret_cast<F>(dlsym(handle, name));
  if (out == nullptr) throw Error(std::string("the loaded cuBLAS does not export ") + name);
}

}  // namespace

const Api& api() {
  static std::once_flag once;
  static Api loaded{};
  static std::string failure;
  std::call_once(once, [] {
    try {
      void* handle = open_cublas();
      bind(handle, "cublasCreate_v2", loaded.create);
      bind(handle, "cublasDestroy_v2", loaded.destroy);
      bind(handle, "cublasSetStream_v2", loaded.set_stream);
      bind(handle, "cublasSetWorkspace_v2", loaded.set_workspace);
      bind(handle, "cublasGemmEx", loaded.gemm_ex);
    } catch (const Error& e) {
      failure = e.what();
    }
  });
  if (!failure.empty()) throw Error(failure);
  return loaded;
}

void gemm_row_major(Handle handle, cudaDataType type, int compute_type, int m, int n, int k, const void* a,
                    int lda, const void* b, int ldb, void* c, int ldc, const char* what) {
  // cuBLAS is column-major: a row-major [m, n] matrix with row stride ld is its transpose there, so
  // C^T = B^T A^T with the operands swapped and nothing transposed.
  const float alpha = 1.0f, beta = 0.0f;
  const int status = api().gemm_ex(handle, kOpN, kOpN, n, m, k, &alpha, b, type, ldb, a, type, lda, &beta, c, type,
                                   ldc, compute_type, kGemmDefault);
  if (status != 0)
    throw Error(std::string(what) + ": cublasGemmEx failed with status " + std::to_string(status) + " for [" +
                std::to_string(m) + ", " + std::to_string(k) + "] @ [" + std::to_string(k) + ", " +
                std::to_string(n) + "]");
}

}  // namespace jaxgin::blas
