"""Triton stubs for the device library's Triton entry points (csrc/device/jaxgin_triton.h), made from
one table (FUNCTIONS).

Each stub is a ``@core.extern`` with an explicit dispatch table {(argument dtypes): (symbol,
return dtype)}, as Triton's libdevice stubs are. Before dispatching, arguments are brought to the
table's types: the context and heap pointers become int64 addresses, peers and signal ids int32,
sizes and values int64. Arguments that must be scalars (every one here: one call moves one
region) are checked, so a tensor-valued peer is a compile-time error naming the argument.
"""

from __future__ import annotations

import inspect

from triton.language import core

LIBRARY = "jaxgin"

_I32, _I64, _U64 = core.int32, core.int64, core.uint64


def _scalar(value, name: str, function: str, _semantic):
    value = _semantic.to_tensor(value)
    if value.type.is_block():
        raise ValueError(
            f"tritongin.{function}: `{name}` must be a scalar, got a tensor of shape {list(value.shape)} "
            "(one call addresses one peer and one region; loop over tensors outside the call)"
        )
    return value


def _integer(value, name: str, function: str, dtype, _semantic):
    value = _scalar(value, name, function, _semantic)
    if not value.dtype.is_int():
        raise ValueError(f"tritongin.{function}: `{name}` must be an integer, got {value.dtype}")
    return _semantic.cast(value, dtype)


def _address(value, name: str, function: str, _semantic):
    """A pointer (or an int64 holding one) as an int64 address."""
    value = _scalar(value, name, function, _semantic)
    if value.dtype.is_ptr():
        return _semantic.cast(value, _I64)
    if value.dtype in (_I64, _U64):
        return _semantic.cast(value, _I64)
    raise ValueError(
        f"tritongin.{function}: `{name}` must be a pointer (or an int64 address), got {value.dtype}"
    )


# The device library's Triton entry points, declared once: stub name -> (C symbol, the name users
# call it by, parameters as (name, kind), return type, pure). Kinds: "address" (a pointer, or an
# int64 holding one, passed as int64), "i32" / "i64" (an integer, cast). language.py wraps these
# stubs with their documentation; tests/test_tritongin.py checks every row against the C
# declarations (csrc/device/jaxgin_triton.h, jaxgin_device.h). Pure: the same value for the whole
# kernel and no effect, so Triton may compute it once.
FUNCTIONS = {
    "rank": ("jaxgin_rank", "rank", (("ctx", "address"),), _I32, True),
    "world_size": ("jaxgin_world_size", "world_size", (("ctx", "address"),), _I32, True),
    "peer_delta": ("jaxgin_tt_peer_delta", "peer_ptr", (("ctx", "address"), ("peer", "i32")), _I64, False),
    "gin_peer": ("jaxgin_tt_gin_peer", "gin_peer", (("ctx", "address"), ("peer", "i32")), _I32, True),
    "put_signal": ("jaxgin_tt_put_signal", "put_signal",
                   (("ctx", "address"), ("dst", "address"), ("src", "address"), ("nbytes", "i64"), ("peer", "i32"),
                    ("signal", "i32")), _I32, False),
    "signal": ("jaxgin_tt_signal", "signal", (("ctx", "address"), ("peer", "i32"), ("signal", "i32"), ("value", "i64")),
               _I32, False),
    "read_signal": ("jaxgin_read_signal", "read_signal", (("ctx", "address"), ("signal", "i32")), _I64, False),
    "wait_signal": ("jaxgin_tt_wait_signal", "wait_signal", (("ctx", "address"), ("signal", "i32"), ("value", "i64")),
                    _I64, False),
    "wait_arrivals": ("jaxgin_tt_wait_arrivals", "wait_arrivals",
                      (("ctx", "address"), ("signal", "i32"), ("count", "i64")), _I64, False),
    "set_flag": ("jaxgin_tt_set_flag", "set_flag",
                 (("ctx", "address"), ("flag", "address"), ("value", "i64"), ("peer", "i32")), _I32, False),
    "wait_flag": ("jaxgin_tt_wait_flag", "wait_flag", (("ctx", "address"), ("flag", "address"), ("value", "i64")),
                  _I64, False),
    "wait_peer_flag": ("jaxgin_tt_wait_peer_flag", "wait_peer_flag",
                       (("ctx", "address"), ("flag", "address"), ("value", "i64"), ("peer", "i32")), _I64, False),
    "flush": ("jaxgin_tt_flush", "flush", (("ctx", "address"),), _I32, False),
    "barrier": ("jaxgin_tt_barrier", "barrier", (("ctx", "address"),), _I32, False),
}

_TYPES = {"address": _I64, "i32": _I32, "i64": _I64}


def _convert(value, name: str, kind: str, function: str, _semantic):
    if kind == "address":
        return _address(value, name, function, _semantic)
    return _integer(value, name, function, _TYPES[kind], _semantic)


def _stub(name: str, symbol: str, shown: str, params: tuple, ret, pure: bool):
    """The @core.extern stub of one row of FUNCTIONS, with the row's parameter names."""
    arg_types = tuple(_TYPES[kind] for _, kind in params)

    def stub(*args, _semantic=None):
        if len(args) != len(params):
            raise TypeError(f"tritongin.{shown} takes {len(params)} arguments "
                            f"({', '.join(p for p, _ in params)}), got {len(args)}")
        converted = [_convert(v, p, kind, shown, _semantic) for v, (p, kind) in zip(args, params)]
        return core.extern_elementwise(LIBRARY, "", converted, {arg_types: (symbol, ret)}, is_pure=pure,
                                       _semantic=_semantic)

    stub.__name__ = stub.__qualname__ = name
    stub.__signature__ = inspect.Signature(
        [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p, _ in params]
        + [inspect.Parameter("_semantic", inspect.Parameter.KEYWORD_ONLY, default=None)]
    )
    return core.extern(stub)


# One module attribute per row (rank, world_size, peer_delta, put_signal, ...): language.py calls
# them as _externs.<name>, which Triton resolves when it compiles a kernel.
globals().update({name: _stub(name, *row) for name, row in FUNCTIONS.items()})
__all__ = list(FUNCTIONS)
