"""jaxgin.triton_call: a Triton kernel (tritongin device functions included) as one XLA op.

    out = jaxgin.triton_call(kernel, x, heap_buf, signal_id, grid=(n,), out_shape=x, BLOCK=1024)

calls ``kernel(ctx, x, heap_buf, signal_id, out, BLOCK=1024)`` on XLA's stream, where ``ctx`` is
the jaxgin context of the GPU the op runs on. Positional arguments, in the kernel's order after
``ctx``, may be jax arrays (device pointers), ``tritongin.empty`` heap buffers (pointers into this
GPU's symmetric heap, the same offset on every rank), Python ints (int32 or int64 scalars) and
floats (float32); the outputs follow them, then the keyword arguments bind ``tl.constexpr``
parameters. An int that is a multiple of 16 compiles as one, as Triton's own launcher specializes
it, so that loads and stores masked against it stay 16-byte vectors.

The kernel is compiled for the GPU when the program is traced, linked with the device library,
and carried inside the program (a serialized executable keeps its kernel). The op is a
side-effecting custom call, so XLA never drops or merges it (and, unless ``pure=True``, a side
effect for JAX, which keeps it where nothing reads its outputs), and it may be captured into CUDA
graphs: a kernel that needs values to differ between replays must keep them on the device (as
``tritongin.wait_arrivals`` does). Outputs are uninitialised until the kernel writes them.

It needs jaxgin on CUDA GPUs; there is no reference lowering of an arbitrary Triton kernel, so on
CPU it raises.
"""

from __future__ import annotations

import jax
import numpy as np
from jax._src import core as jax_core  # as jax.ffi.ffi_call prepares its operands
from jax._src import dispatch as jax_dispatch  # as ffi_call's primitive runs outside jit
from jax._src import ffi as jax_ffi  # ffi_call's own result types, for the pure call's primitive
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

from jaxgin import op_support, runtime
from jaxgin.errors import JaxginError
from jaxgin.ffi import capture
from jaxgin.ffi.op_table import ParamKind

_TRITON_TYPES = {
    "float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64",
    "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64",
    "uint8": "u8", "uint16": "u16", "uint32": "u32", "uint64": "u64", "bool": "i1",
    "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5",
}


def _pointer_type(dtype, what: str) -> str:
    name = np.dtype(dtype).name
    if name not in _TRITON_TYPES:
        raise TypeError(f"jaxgin.triton_call: {what} has dtype {name}, which Triton kernels cannot take "
                        f"(supported: {sorted(_TRITON_TYPES)})")
    return "*" + _TRITON_TYPES[name]


def _is_array(value) -> bool:
    """A jax array, numpy array or tracer: passed to the kernel as a device pointer."""
    return isinstance(value, (jax.Array, np.ndarray)) or hasattr(value, "aval")


def _grid(grid, constexprs) -> tuple[int, int, int]:
    if callable(grid):
        grid = grid(dict(constexprs))
    grid = (grid,) if isinstance(grid, (int, np.integer)) else tuple(grid)
    if not 1 <= len(grid) <= 3 or any(int(g) < 1 for g in grid):
        raise ValueError(f"jaxgin.triton_call: grid must be 1 to 3 positive ints, got {grid}")
    return tuple(int(g) for g in grid) + (1,) * (3 - len(grid))


def _out_types(out_shape, arrays) -> tuple[list, bool]:
    single = not isinstance(out_shape, (list, tuple))
    shapes = [out_shape] if single else list(out_shape)
    # Inside shard_map the outputs vary over the manual axes the inputs vary over (a communicating
    # kernel's result differs per device), unless the caller typed them with a ShapeDtypeStruct.
    first = jax.typeof(arrays[0]) if arrays else None
    manual = getattr(first, "manual_axis_type", None)
    types = []
    for s in shapes:
        if not hasattr(s, "shape") or not hasattr(s, "dtype"):
            raise TypeError(f"jaxgin.triton_call: out_shape entries need .shape and .dtype, got {s!r}")
        if isinstance(s, jax.ShapeDtypeStruct) or manual is None or getattr(manual, "empty", True):
            types.append(s if isinstance(s, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct(s.shape, s.dtype))
            continue
        replicated = NamedSharding(first.sharding.mesh, PartitionSpec(*([None] * len(s.shape))))
        types.append(jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated, manual_axis_type=manual))
    return types, single


# jaxgin's own kernels (fused ops, MoE) ask Triton by name to fuse multiplies and adds into FMAs:
# that is how they were measured and compared with XLA, and Triton's default (on up to 3.9, which
# warns that 3.10 turns it off) would otherwise change their numerics with the Triton installed.
OWN_KERNELS_FP_FUSION = True


def _compile(kernel, signature, constexprs, num_warps, num_stages, capability, enable_fp_fusion=None,
             multiples_of_16=frozenset(), max_registers=None):
    """`multiples_of_16`: names of integer parameters whose value is a multiple of 16 in this call,
    specialized as Triton's own launcher does: a mask against such a bound keeps vector accesses."""
    import triton  # Triton is optional: only triton_call on GPUs needs it
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, t) in enumerate(signature.items())
             if t.startswith("*") or name in multiples_of_16}
    source = ASTSource(kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    major, minor = capability
    return triton.compile(
        source,
        target=GPUTarget("cuda", major * 10 + minor, 32),
        options=compile_options(num_warps, num_stages, enable_fp_fusion, max_registers),
    )


def compile_options(num_warps: int, num_stages: int, enable_fp_fusion: bool | None = None,
                    max_registers: int | None = None) -> dict:
    """Triton's compile options for a triton_call kernel; `enable_fp_fusion` and `max_registers`
    (Triton's maxnreg) only when given, so that None leaves them to Triton (and to
    TRITON_DEFAULT_FP_FUSION)."""
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if enable_fp_fusion is not None:
        options["enable_fp_fusion"] = bool(enable_fp_fusion)
    if max_registers is not None:
        options["maxnreg"] = int(max_registers)
    return options


# The most shared memory one block may opt into, by compute capability (CUDA's programming guide,
# "Technical Specifications per Compute Capability"); a capability not listed is left to the launch.
SHARED_BYTES_PER_BLOCK = {
    (7, 0): 96 << 10, (7, 2): 96 << 10, (7, 5): 64 << 10,
    (8, 0): 163 << 10, (8, 6): 99 << 10, (8, 7): 163 << 10, (8, 9): 99 << 10,
    (9, 0): 227 << 10, (10, 0): 227 << 10, (10, 3): 227 << 10, (12, 0): 99 << 10, (12, 1): 99 << 10,
}


def check_shared_memory(kernel_name: str, shared_bytes: int, capability: tuple[int, int], num_stages: int) -> None:
    """Raises, before anything runs, for a compiled kernel that needs more shared memory per block
    than GPUs of `capability` allow (the launch would fail with only the byte count)."""
    limit = SHARED_BYTES_PER_BLOCK.get(tuple(capability))
    if limit is not None and shared_bytes > limit:
        raise JaxginError(
            f"jaxgin.triton_call: kernel {kernel_name} needs {shared_bytes} bytes of shared memory per block; "
            f"sm_{capability[0]}{capability[1]} GPUs allow at most {limit}. Fewer stages (num_stages={num_stages}) "
            "or smaller blocks need less"
        )


def _capability(state) -> tuple[int, int]:
    major, minor = str(state.local_devices[0].compute_capability).split(".")
    return int(major), int(minor)


def triton_call(
    kernel,
    *args,
    grid,
    out_shape,
    num_warps: int = 4,
    num_stages: int = 3,
    enable_fp_fusion: bool | None = None,
    max_registers: int | None = None,
    pure: bool = False,
    **constexprs,
):
    """Runs a ``@triton.jit`` kernel as one XLA op; returns its output(s) as jax arrays.

    ``num_warps``, ``num_stages`` and ``enable_fp_fusion`` are Triton's compile options of those
    names; ``enable_fp_fusion=None`` leaves FMA fusion to Triton's default. ``max_registers`` is
    Triton's ``maxnreg``: the most registers per thread ptxas may give the kernel (None: no cap).
    ``pure=True`` tells JAX that the call's outputs are all it does: JAX may then drop a call whose
    outputs nothing uses, and a jitted function keeps JAX's fast dispatch path (a call with a side
    effect, the default, sends every call of the function through JAX's Python path). XLA never
    drops, merges or hoists either kind."""
    call = lowered_call(kernel, args, grid=grid, out_shape=out_shape, num_warps=num_warps, num_stages=num_stages,
                        enable_fp_fusion=enable_fp_fusion, max_registers=max_registers, constexprs=constexprs)
    return call.run(capture.target_for("jaxgin.triton_call", runtime.current()), pure=pure)


class LoweredCall:
    """A Triton kernel compiled for a call, with the XLA operands, result types and attributes that
    launch it (lowered_call): run() makes the custom call of a target whose handler takes them; a
    caller that makes its own (with attributes of its own) hands its results to results()."""

    def __init__(self, operands, out_types, attributes, scratch: bool, single: bool, out_shape):
        self.operands, self.out_types, self.attributes = operands, out_types, attributes
        self.scratch, self.single, self.out_shape = scratch, single, out_shape

    def run(self, target: str, pure: bool = False):
        """The custom call of `target`: with a JAX side effect, or with `pure` as a primitive JAX
        treats as pure (triton_call's `pure`). XLA sees a side-effecting custom call either way."""
        if pure:
            # as jax.ffi.ffi_call does: inside shard_map, operands that do not vary over a manual
            # axis the others vary over are cast to vary (one varying type for the call's inputs)
            operands = jax_core.auto_insert_reshard(*self.operands)
            return self.results(pure_call_p.bind(*operands, call=self, target=target))
        call = jax.ffi.ffi_call(target, self.out_types, has_side_effect=True)
        return self.results(call(*self.operands, **self.attributes))

    def results(self, results):
        """What the caller gets of the custom call's results (Triton's scratch, if any, is not returned)."""
        results = list(results)
        if self.scratch:
            results = results[:-1]
        if self.single:
            return results[0]
        return tuple(results) if isinstance(self.out_shape, tuple) else list(results)  # shard_map's out_specs match it


# triton_call(pure=True): the same custom call as jax.ffi.ffi_call makes, as a primitive with no JAX
# effect: any effect in a jitted function sends its every call through JAX's Python dispatch
# (docs/measurements.md, thirty-sixth session).
pure_call_p = Primitive("jaxgin_triton_call")
pure_call_p.multiple_results = True
jax_dispatch.simple_impl(pure_call_p)  # called outside jit, it is compiled as a program of its own


@pure_call_p.def_abstract_eval
def _pure_call_abstract(*operands, call, target):
    results, _ = jax_ffi.ffi_call_abstract_eval(*operands, result_avals=jax_ffi._result_avals(call.out_types),
                                                has_side_effect=False)
    return results


def _pure_call_lowering(ctx, *operands, call, target):
    return jax.ffi.ffi_lowering(target, has_side_effect=True)(ctx, *operands, **call.attributes)


def _pure_call_refused(what: str):
    def rule(*_, **__):
        raise JaxginError(f"jaxgin.triton_call cannot be {what}: it runs one compiled kernel; "
                          + ("loop over the batch instead" if what == "vmapped" else
                             "wrap the call in jax.custom_vjp with a backward of its own"))

    return rule


mlir.register_lowering(pure_call_p, _pure_call_lowering)
batching.primitive_batchers[pure_call_p] = _pure_call_refused("vmapped")
ad.primitive_jvps[pure_call_p] = _pure_call_refused("differentiated")


def lowered_call(kernel, args, *, grid, out_shape, num_warps: int, num_stages: int, enable_fp_fusion, max_registers,
                 constexprs) -> LoweredCall:
    """triton_call's work up to the custom call (jaxgin.fused's copy-engine exchange makes its own)."""
    if max_registers is not None and not 24 <= max_registers <= 255:
        raise ValueError(f"jaxgin.triton_call: max_registers must be between 24 and 255 (ptxas's range), "
                         f"got {max_registers}")
    state = runtime.current()
    if state.runtime is None:
        raise JaxginError(
            f"jaxgin.triton_call runs Triton kernels on CUDA GPUs; jaxgin runs in {state.options.backend} mode "
            "here (no GPU). Use a jax.lax / jaxgin reference for CPU runs"
        )
    from jaxgin.triton_device import link  # imports jaxgin.build, which `import jaxgin` leaves out (jaxgin.runtime)

    link.install()
    names = list(getattr(kernel, "arg_names", []))
    if not names:
        raise TypeError(f"jaxgin.triton_call: {kernel!r} is not a @triton.jit kernel")
    arrays = [a for a in args if _is_array(a)]
    out_types, single = _out_types(out_shape, arrays)
    runtime_params = [n for n in names if n not in constexprs]
    expected = 1 + len(args) + len(out_types)
    if len(runtime_params) != expected:
        raise TypeError(
            f"jaxgin.triton_call: kernel {kernel.__name__}{tuple(names)} has {len(runtime_params)} non-constexpr "
            f"parameters {tuple(runtime_params)}, but the call supplies {expected}: the context, {len(args)} "
            f"positional argument(s) and {len(out_types)} output(s). Bind tl.constexpr parameters by keyword"
        )
    unknown = sorted(set(constexprs) - set(names))
    if unknown:
        raise TypeError(f"jaxgin.triton_call: kernel {kernel.__name__} has no parameter(s) {unknown}")

    signature: dict[str, str] = {}
    multiples_of_16: set[str] = set()
    params: list[int] = []
    operands = []
    it = iter(runtime_params)
    signature[next(it)] = "*u8"
    params += [ParamKind.CONTEXT, 0]
    for position, arg in enumerate(args):
        name = next(it)
        if isinstance(arg, op_support.SymmetricArray):
            arg.check_live()
            signature[name] = _pointer_type(arg.dtype, f"argument {name!r}")
            params += [ParamKind.HEAP, arg.offset]
        elif isinstance(arg, (bool, np.bool_)):
            raise TypeError(f"jaxgin.triton_call: argument {name!r} is a bool; pass an int")
        elif isinstance(arg, (int, np.integer)):
            value = int(arg)
            small = -(2**31) <= value < 2**31
            signature[name] = "i32" if small else "i64"
            params += [ParamKind.INT32 if small else ParamKind.INT64, value]
            if value % 16 == 0:
                multiples_of_16.add(name)
        elif isinstance(arg, (float, np.floating)):
            signature[name] = "fp32"
            params += [ParamKind.FLOAT32, int(np.array(arg, dtype=np.float32).view(np.uint32))]
        elif _is_array(arg):
            signature[name] = _pointer_type(arg.dtype, f"argument {name!r}")
            params += [ParamKind.OPERAND, len(operands)]
            operands.append(arg)
        else:
            raise TypeError(
                f"jaxgin.triton_call: argument {position} ({name!r}) is {type(arg).__name__}; pass a jax array, a "
                "tritongin.empty heap buffer, an int or a float"
            )
    for index, out in enumerate(out_types):
        name = next(it)
        signature[name] = _pointer_type(out.dtype, f"output {name!r}")
        params += [ParamKind.RESULT, index]
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"

    capability = _capability(state)
    compiled = _compile(kernel, signature, constexprs, num_warps, num_stages, capability, enable_fp_fusion,
                        frozenset(multiples_of_16), max_registers)
    metadata = compiled.metadata
    check_shared_memory(kernel.__name__, metadata.shared, capability, num_stages)
    if getattr(metadata, "num_ctas", 1) != 1:
        raise JaxginError(f"jaxgin.triton_call: kernel {kernel.__name__} uses thread-block clusters (num_ctas > 1)")
    launch_grid = _grid(grid, constexprs)
    scratch = _global_scratch_bytes(metadata, launch_grid)
    if scratch:
        # Triton's global scratch (tensor descriptors made on the device: tl.make_tensor_descriptor)
        # is one more XLA result, never returned: XLA owns the memory, and a captured graph replays
        # with the same buffer.
        out_types = out_types + [jax.ShapeDtypeStruct((scratch,), np.uint8)]
        params += [ParamKind.RESULT, len(out_types) - 1]
    else:
        params += [ParamKind.NULL_POINTER, 0]
    params += [ParamKind.NULL_POINTER, 0]  # Triton's profile scratch pointer
    cubin = compiled.asm["cubin"]
    if operands:
        # Why the barrier: XLA's dynamic-slice fusion (on by default in the XLA of JAX 0.11) moves a
        # custom call whose operand is a slice into a fusion that reads the slice in place, and
        # for a side-effecting call with several results it leaves the original call in the
        # program too, so the kernel runs twice per call (measured: MoE dispatch, 2 x 24 us).
        # For a kernel that communicates that doubles its puts and signals. An operand that
        # comes out of an optimization barrier is not a slice to that pass. The barrier adds no
        # device work (the profile of tools/profile_moe.py shows no copies); newer XLA removes the
        # original call itself (dynamic_slice_fusion_rewriter_v2.cc).
        operands = list(jax.lax.optimization_barrier(tuple(operands)))
    attributes = dict(
        cubin=np.frombuffer(cubin, dtype=np.int8),
        kernel_name=metadata.name,
        grid=np.array(launch_grid, dtype=np.int64),
        num_warps=np.int64(metadata.num_warps),
        shared_bytes=np.int64(metadata.shared),
        params=np.array(params, dtype=np.int64),
        generation=np.int64(state.generation),
    )
    return LoweredCall(operands, out_types, attributes, bool(scratch), single, out_shape)


def _global_scratch_bytes(metadata, grid) -> int:
    """Bytes of Triton global scratch a launch of `grid` needs: a slice per program, each
    global_scratch_size bytes rounded up to global_scratch_align."""
    size = int(getattr(metadata, "global_scratch_size", 0) or 0)
    if not size:
        return 0
    align = max(int(getattr(metadata, "global_scratch_align", 1) or 1), 1)
    per_program = -(-size // align) * align
    return per_program * grid[0] * grid[1] * grid[2]
