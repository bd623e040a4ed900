"""Triton stubs for the device library's Triton entry points (csrc/device/jaxgin_triton.h).

Each stub is a ``@core.extern`` with an explicit dispatch table {(argument dtypes): (symbol,
return dtype)}, as Triton's libdevice stubs are. Before dispatching, arguments are brought to the
table's types: the context and heap pointers become int64 addresses, peers and signal ids int32,
sizes and values int64. Arguments that must be scalars (every one here: one call moves one
region) are checked, so a tensor-valued peer is a compile-time error naming the argument.
"""

from __future__ import annotations

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


def _call(symbol: str, args: list, arg_types: tuple, ret, _semantic):
    return core.extern_elementwise(
        LIBRARY, "", args, {arg_types: (symbol, ret)}, is_pure=False, _semantic=_semantic
    )


@core.extern
def rank(ctx, _semantic=None):
    ctx = _address(ctx, "ctx", "rank", _semantic)
    return _call("jaxgin_rank", [ctx], (_I64,), _I32, _semantic)


@core.extern
def world_size(ctx, _semantic=None):
    ctx = _address(ctx, "ctx", "world_size", _semantic)
    return _call("jaxgin_world_size", [ctx], (_I64,), _I32, _semantic)


@core.extern
def peer_delta(ctx, peer, _semantic=None):
    ctx = _address(ctx, "ctx", "peer_ptr", _semantic)
    peer = _integer(peer, "peer", "peer_ptr", _I32, _semantic)
    return _call("jaxgin_tt_peer_delta", [ctx, peer], (_I64, _I32), _I64, _semantic)


@core.extern
def put_signal(ctx, dst, src, nbytes, peer, signal, _semantic=None):
    ctx = _address(ctx, "ctx", "put_signal", _semantic)
    dst = _address(dst, "dst", "put_signal", _semantic)
    src = _address(src, "src", "put_signal", _semantic)
    nbytes = _integer(nbytes, "nbytes", "put_signal", _I64, _semantic)
    peer = _integer(peer, "peer", "put_signal", _I32, _semantic)
    signal = _integer(signal, "signal", "put_signal", _I32, _semantic)
    return _call(
        "jaxgin_tt_put_signal", [ctx, dst, src, nbytes, peer, signal], (_I64, _I64, _I64, _I64, _I32, _I32), _I32,
        _semantic,
    )


@core.extern
def signal(ctx, peer, signal, value, _semantic=None):
    ctx = _address(ctx, "ctx", "signal", _semantic)
    peer = _integer(peer, "peer", "signal", _I32, _semantic)
    signal = _integer(signal, "signal", "signal", _I32, _semantic)
    value = _integer(value, "value", "signal", _I64, _semantic)
    return _call("jaxgin_tt_signal", [ctx, peer, signal, value], (_I64, _I32, _I32, _I64), _I32, _semantic)


@core.extern
def read_signal(ctx, signal, _semantic=None):
    ctx = _address(ctx, "ctx", "read_signal", _semantic)
    signal = _integer(signal, "signal", "read_signal", _I32, _semantic)
    return _call("jaxgin_read_signal", [ctx, signal], (_I64, _I32), _I64, _semantic)


@core.extern
def wait_signal(ctx, signal, value, _semantic=None):
    ctx = _address(ctx, "ctx", "wait_signal", _semantic)
    signal = _integer(signal, "signal", "wait_signal", _I32, _semantic)
    value = _integer(value, "value", "wait_signal", _I64, _semantic)
    return _call("jaxgin_tt_wait_signal", [ctx, signal, value], (_I64, _I32, _I64), _I64, _semantic)


@core.extern
def wait_arrivals(ctx, signal, count, _semantic=None):
    ctx = _address(ctx, "ctx", "wait_arrivals", _semantic)
    signal = _integer(signal, "signal", "wait_arrivals", _I32, _semantic)
    count = _integer(count, "count", "wait_arrivals", _I64, _semantic)
    return _call("jaxgin_tt_wait_arrivals", [ctx, signal, count], (_I64, _I32, _I64), _I64, _semantic)


@core.extern
def set_flag(ctx, flag, value, peer, _semantic=None):
    ctx = _address(ctx, "ctx", "set_flag", _semantic)
    flag = _address(flag, "flag", "set_flag", _semantic)
    value = _integer(value, "value", "set_flag", _I64, _semantic)
    peer = _integer(peer, "peer", "set_flag", _I32, _semantic)
    return _call("jaxgin_tt_set_flag", [ctx, flag, value, peer], (_I64, _I64, _I64, _I32), _I32, _semantic)


@core.extern
def wait_flag(ctx, flag, value, _semantic=None):
    ctx = _address(ctx, "ctx", "wait_flag", _semantic)
    flag = _address(flag, "flag", "wait_flag", _semantic)
    value = _integer(value, "value", "wait_flag", _I64, _semantic)
    return _call("jaxgin_tt_wait_flag", [ctx, flag, value], (_I64, _I64, _I64), _I64, _semantic)


@core.extern
def wait_peer_flag(ctx, flag, value, peer, _semantic=None):
    ctx = _address(ctx, "ctx", "wait_peer_flag", _semantic)
    flag = _address(flag, "flag", "wait_peer_flag", _semantic)
    value = _integer(value, "value", "wait_peer_flag", _I64, _semantic)
    peer = _integer(peer, "peer", "wait_peer_flag", _I32, _semantic)
    return _call("jaxgin_tt_wait_peer_flag", [ctx, flag, value, peer], (_I64, _I64, _I64, _I32), _I64, _semantic)


@core.extern
def flush(ctx, _semantic=None):
    ctx = _address(ctx, "ctx", "flush", _semantic)
    return _call("jaxgin_tt_flush", [ctx], (_I64,), _I32, _semantic)


@core.extern
def barrier(ctx, _semantic=None):
    ctx = _address(ctx, "ctx", "barrier", _semantic)
    return _call("jaxgin_tt_barrier", [ctx], (_I64,), _I32, _semantic)
