"""Lowering layer: jaxgin's JAX primitives become XLA FFI custom calls on CUDA (handlers in the
backend library run device-library code on XLA's stream) and pure-JAX lax collectives on CPU,
which also serve as the test oracle. The ops land here with the JAX ops; the runtime they need is
in ``jaxgin.runtime``."""
