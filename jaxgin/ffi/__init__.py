"""Lowering of jaxgin's JAX primitives: XLA FFI custom calls on CUDA (handlers in csrc/ffi), the
pure-JAX reference (lax collectives) on other platforms and in reference mode."""
