"""Runs jaxgin's pure Triton device functions (no tritongin calls) in Triton's interpreter
(TRITON_INTERPRET=1) on this machine, with numpy arrays as device memory, against the plain JAX
they stand for. A script of its own: Triton reads TRITON_INTERPRET when a kernel is defined, so it
needs a fresh process.

    python tests/triton_interpreter.py fp8

prints one JSON line: the cases checked (tests/test_moe.py asserts on it).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402

from jaxgin.moe import _fp8_device as fp8_rows  # noqa: E402


class HostArray:
    """A numpy array that Triton's interpreter takes for device memory: it reads and writes it in
    place, through its address."""

    def __init__(self, array):
        self.array = np.ascontiguousarray(array)
        self.dtype = self.array.dtype

    def data_ptr(self) -> int:
        return self.array.ctypes.data


def _in_place() -> None:
    """The interpreter copies torch tensors to the host and back around a launch; these arrays are
    host memory already, so it is told to use them as they are."""
    for name in ("_init_args_hst", "_restore_args_dev"):
        if not hasattr(interpreter.GridExecutor, name):
            raise SystemExit(f"this Triton's interpreter has no GridExecutor.{name}: tests/triton_interpreter.py "
                             "needs updating for it")
    interpreter.GridExecutor._init_args_hst = lambda self, args, kwargs: (args, kwargs)
    interpreter.GridExecutor._restore_args_dev = lambda self, *args, **kwargs: None


@triton.jit
def _stage_and_place(x, staged, out, T: tl.constexpr, H: tl.constexpr, SW: tl.constexpr, BT: tl.constexpr,
                     BH: tl.constexpr):
    """What the dispatch kernel does to a row with fp8: stage it (store_rows), then place it (load_rows)."""
    r = tl.program_id(0) * BT + tl.arange(0, BT)
    ok = r < T
    for h0 in range(0, H, BH):
        h = h0 + tl.arange(0, BH)
        rows = tl.load(x + r[:, None] * H + h[None, :], mask=ok[:, None] & (h < H)[None, :], other=0.0)
        fp8_rows.store_rows(staged, r, rows, h0, ok, H, SW, BT, BH)
    for h0 in range(0, H, BH):
        h = h0 + tl.arange(0, BH)
        rows = fp8_rows.load_rows(staged, r, h0, ok, out.dtype.element_ty, H, SW, BT, BH)
        tl.store(out + r[:, None] * H + h[None, :], rows, mask=ok[:, None] & (h < H)[None, :])


def _triton_version() -> tuple[int, int]:
    return tuple(int(v) for v in triton.__version__.split(".")[:2])


def fp8() -> list[dict]:
    import jax

    from jaxgin.moe import fp8 as fp8_lib

    checked = []
    for dtype in (np.float32, ml_dtypes.bfloat16, np.float16):
        for t, h, bt, bh, seed in ((5, 384, 4, 256, 0), (33, 1024, 4, 512, 1)):
            rng = np.random.default_rng(seed)
            # magnitudes from 1e-9 to 3000 per row: subnormal e4m3 values, ties, carries into the exponent
            x = rng.standard_normal((t, h)) * np.exp(rng.uniform(-20, 8, size=(t, 1)))
            x[1, :128] = 0  # an all-zero block: scale 1
            x[2, :] = rng.integers(-3, 4, h)  # exact small integers
            x = x.astype(dtype)
            width = fp8_lib.packed_width(h)
            staged, out = HostArray(np.zeros((t, width), np.int16)), HostArray(np.zeros((t, h), dtype))
            _stage_and_place[(-(-t // bt),)](HostArray(x), staged, out, T=t, H=h, SW=width, BT=bt, BH=bh)
            packed = np.asarray(jax.jit(lambda v: fp8_lib.pack(*fp8_lib.quantize(v)))(x))
            rounded = np.asarray(jax.jit(fp8_lib.rounded)(x))
            rows_equal = bool(np.array_equal(out.array.view(np.uint8), rounded.view(np.uint8)))
            if dtype is np.float16 and _triton_version() < (3, 9):
                rows_equal = None  # this interpreter's float32 -> float16 conversion is not the GPU's rounding
            checked.append(dict(dtype=np.dtype(dtype).name, tokens=t, hidden=h,
                                packed_equal=bool(np.array_equal(staged.array, packed)), rows_equal=rows_equal,
                                rounded_differs_from_x=not np.array_equal(rounded.view(np.uint8), x.view(np.uint8))))
    return checked


if __name__ == "__main__":
    _in_place()
    print(json.dumps({"fp8": fp8}[sys.argv[1]]()))
