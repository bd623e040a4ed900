"""jaxgin.fused.explain: which implementation a fused op runs for given shapes, and why, without
running it (method="auto" picks by the size of the matmul and the job's mesh)."""

from __future__ import annotations

import numpy as np

from jaxgin import op_support
from jaxgin.errors import NotInitializedError
from jaxgin.fused import _common

# op name -> how its x is laid out per device (the ops' plans weigh the same matmuls: `flop`)
_OPS = {
    "matmul_all_to_all": "x [M, K] of this device",
    "all_gather_matmul": "x [M, K]: this device's shard",
    "matmul_reduce_scatter": "x [M, K] of this device, sharded along K",
}


def explain(op: str, x_shape, w_shape, dtype="bfloat16", *, axis_size: int, method: str = "auto", precision=None,
            gin_in_job: bool | None = None) -> _common.MethodChoice:
    """What jaxgin.fused.<op>(x, w, axis_name=..., method=method) runs on GPUs for per-device
    operands x `x_shape` and w `w_shape` of `dtype` over an axis of `axis_size` devices: a
    MethodChoice with the method ("chunked", "triton" or "unfused") and the reason; str() of it
    reads as one line. `gin_in_job` says whether the job has GPUs on other hosts (default: the
    running jaxgin runtime's answer, False without one on GPUs). In reference mode (no GPUs) every
    method computes the reference; this says what the GPUs would run."""
    if op not in _OPS:
        raise ValueError(f"jaxgin.fused.explain: op={op!r}; use one of {', '.join(map(repr, _OPS))}")
    layout = _OPS[op]
    name = f"jaxgin.fused.{op}"
    x_shape, w_shape = tuple(x_shape), tuple(w_shape)
    if len(x_shape) != 2 or len(w_shape) != 2 or x_shape[1] != w_shape[0]:
        raise ValueError(f"{name}: x_shape {list(x_shape)} ({layout}) and w_shape {list(w_shape)} ([K, N]) must be "
                         "2-D with the same K")
    if not isinstance(axis_size, (int, np.integer)) or axis_size < 1:
        raise ValueError(f"{name}: axis_size must be a positive int (the devices along axis_name), got {axis_size!r}")
    if np.dtype(dtype).name not in _common.DTYPES:
        raise TypeError(f"{name}: dtype {np.dtype(dtype).name}; supported: {', '.join(_common.DTYPES)}")
    _common.check_method(name, method, None)
    if gin_in_job is None:
        try:
            state = op_support.kernel_state()
        except NotInitializedError:
            state = None
        gin_in_job = state is not None and op_support.gin_in_job(state)
    (m, k), n = x_shape, w_shape[1]
    flop = 2.0 * m * k * n * (axis_size if op == "all_gather_matmul" else 1)
    return _common.choose_method(name, method, flop, np.dtype(dtype), _common.lax_precision(precision),
                                 bool(gin_in_job))
