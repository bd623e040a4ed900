"""The op table: one row per op family, the one place that names what both languages need of it.

A row names the family's slice (its Python modules and the csrc files compiled into the backend),
its custom-call targets with their exported handler symbols, the user-facing ops each target
serves and the tag its kernels record in a fault, the attribute codes its handler reads, the
constants both sides compute with, and the hook that loads its kernels at initialize.

Python reads the rows (jaxgin/ffi/targets.py registers the targets, the op modules look up their
target by op name, the build compiles the rows' sources); the build renders them into the C++
header ``jaxgin_op_table.h`` (header()), written into each build's own directory, so that csrc
spells none of it by hand: the op tags and the names fault reports give them, the preload hooks
the runtime calls, the handlers' exported declarations, the attribute codes and the constants.
Adding an op family is its slice plus one row here (docs/guide.md, "Adding an op").

Imports nothing but the standard library and jaxgin.settings (a default the C++ needs is a
setting's): the build reads it without JAX's lowering machinery or a backend.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Mapping

from jaxgin import settings


class ExchangeKind(enum.IntEnum):
    """jaxgin_exchange's `kind` attribute."""

    PPERMUTE = 0
    ALL_TO_ALL = 1


class ChunkLayout(enum.IntEnum):
    """The chunked fused ops' `layout` attribute: how the peers' chunks are split into cuBLAS calls
    (csrc/ffi/chunked_matmul.cu; benchmarks/fused.py --chunked-layouts-only compares them)."""

    CHUNK_PER_PEER = 0  # a call per peer's chunk, each handed over when done (the ops' layout)
    PEERS_MERGED = 1  # the peers' row chunks in at most two calls
    WHOLE = 2  # one call for every chunk, then every hand-over


class ParamKind(enum.IntEnum):
    """jaxgin_triton_call's `params`: pairs (kind, value) in the kernel's parameter order."""

    CONTEXT = 0  # the jaxgin context of the GPU this runs on
    OPERAND = 1  # the address of XLA operand number `value`
    RESULT = 2  # the address of XLA result number `value`
    HEAP = 3  # this GPU's address of symmetric-heap offset `value`
    INT32 = 4  # a scalar
    INT64 = 5  # a scalar
    FLOAT32 = 6  # a scalar, as its bit pattern
    NULL_POINTER = 7  # a pointer parameter Triton appends (global / profile scratch) that the kernel was compiled not to use


@dataclasses.dataclass(frozen=True)
class Op:
    """A user-facing op, or a kind of device work, as fault reports name it."""

    name: str  # what users call ("jaxgin.ppermute"); fault reports say "in <name>"
    tag: str | None = None  # JAXGIN_OP_<tag>, recorded by its kernels in a fault; None: they record another op's


CAPTURED_SUFFIX = "_captured"


@dataclasses.dataclass(frozen=True)
class Target:
    """An XLA custom-call target on CUDA."""

    name: str
    handlers: Mapping[str, str]  # XLA stage ("execute", or "instantiate" and "execute") -> exported handler symbol
    ops: tuple[Op, ...]  # the ops that lower to it
    # Whether the target has a twin that XLA may record into its command buffers (CUDA graphs):
    # the same handlers, exported a second time with XLA's command-buffer trait under the
    # "_captured" names below (jaxgin/ffi/capture.py says which of the two a call lowers to).
    capturable: bool = False

    @property
    def captured_name(self) -> str:
        return self.name + CAPTURED_SUFFIX

    @property
    def captured_handlers(self) -> dict[str, str]:
        """The twin's handler symbols: each execute stage's with CAPTURED_SUFFIX (the stages that
        run once per executable, such as instantiate, are shared)."""
        return {stage: symbol + CAPTURED_SUFFIX if stage == "execute" else symbol
                for stage, symbol in self.handlers.items()}


@dataclasses.dataclass(frozen=True)
class StateType:
    """An FFI state type (jax.ffi.register_ffi_type): exported getters of its type id and type info."""

    name: str
    type_id: str
    type_info: str


@dataclasses.dataclass(frozen=True)
class Family:
    """A row: an op family's slice and everything both languages need of it. The first row is the
    runtime and the device library, which every op sits on: no op, but tags, constants and sources
    of the same kinds."""

    name: str
    python: tuple[str, ...]  # its Python modules, relative to the repository
    sources: tuple[str, ...]  # its csrc files compiled into the backend, relative to csrc/
    targets: tuple[Target, ...] = ()
    ops: tuple[Op, ...] = ()  # tagged work that is no custom call of its own (device library, diagnostics)
    preload: tuple[str, ...] = ()  # jaxgin::<hook>() loads some of its kernels on the current device at initialize
    codes: tuple[type[enum.IntEnum], ...] = ()  # attribute codes its handlers read
    constants: Mapping[str, int] = dataclasses.field(default_factory=dict)  # JAXGIN_<NAME> in C++
    state_types: tuple[StateType, ...] = ()

    def all_ops(self) -> tuple[Op, ...]:
        return self.ops + tuple(op for target in self.targets for op in target.ops)


FAMILIES: tuple[Family, ...] = (
    Family(
        "runtime",
        python=("jaxgin/runtime.py", "jaxgin/heap.py"),
        sources=("device/library.cu", "runtime/runtime.cu", "runtime/heap_release.cu", "runtime/vmm_ledger.cu",
                 "runtime/cublas_loader.cu", "runtime/constants.cu", "runtime/thread_settle.cu",
                 "ffi/launch_pacing.cu", "kernels/heap_settle.cu", "ffi/heap_free.cu"),
        ops=(Op("a jaxgin device-library call", "DEVICE_CALL"),  # a jaxgin_* device function called from user code
             Op("jaxgin barrier", "BARRIER")),
        preload=("preload_heap_settle_kernel",),
        constants={
            # Messages up to this size between LSA peers travel as lines (csrc/device/impl/line__funcs.h).
            "line_max_bytes": 8192,
            # $JAXGIN_MAX_QUEUED_CALLS (csrc/ffi/launch_pacing.cu): its default and largest value.
            "default_max_queued_calls": int(settings.BY_NAME["JAXGIN_MAX_QUEUED_CALLS"].default),
            "max_queued_calls_limit": 1 << 16,
        },
    ),
    Family(
        "diagnostics",
        python=("jaxgin/diagnostics.py",),
        sources=("ffi/diagnostics.cu", "kernels/selftest_exchange.cu", "kernels/wait_signal.cu",
                 "kernels/launch_floor.cu"),
        ops=(Op("jaxgin selftest exchange", "SELFTEST"),),
        preload=("preload_wait_signal_kernel",),
    ),
    Family(
        "exchange",
        python=("jaxgin/collectives.py",),
        sources=("kernels/exchange.cu", "kernels/line_exchange.cu", "ffi/collectives.cu"),
        targets=(Target("jaxgin_exchange", {"execute": "jaxgin_ffi_exchange"},
                        (Op("jaxgin.ppermute", "PPERMUTE"), Op("jaxgin.all_to_all", "ALL_TO_ALL")), capturable=True),),
        preload=("preload_exchange_kernels", "preload_line_exchange_kernels"),
        codes=(ExchangeKind,),
        # Ranks one exchange (and one mailbox, one fused op) may involve: kernel parameters carry them.
        constants={"max_exchange_peers": 64},
    ),
    Family(
        "mailbox",
        python=("jaxgin/mailbox.py",),
        sources=("kernels/mailbox.cu", "ffi/mailbox.cu"),
        targets=(Target("jaxgin_put_signal", {"execute": "jaxgin_ffi_put"}, (Op("jaxgin.put_signal", "PUT_SIGNAL"),),
                        capturable=True),
                 Target("jaxgin_wait_signal", {"execute": "jaxgin_ffi_wait"}, (Op("jaxgin.wait_signal", "WAIT_SIGNAL"),),
                        capturable=True),
                 Target("jaxgin_wait_signal_from", {"execute": "jaxgin_ffi_wait_from"},
                        (Op("jaxgin.wait_signal_from", "WAIT_SIGNAL_FROM"),), capturable=True)),
        preload=("preload_mailbox_kernels",),
        constants={"mailbox_header_bytes": 256},  # counters and the running wait's decision (csrc/kernels/mailbox.cu)
    ),
    Family(
        "fused",  # method="chunked": cuBLAS chunks handed over by the copy engine
        python=("jaxgin/fused/_chunked.py",),
        sources=("kernels/chunk_handoff.cu", "ffi/chunked_matmul.cu"),
        targets=(Target("jaxgin_matmul_all_to_all", {"execute": "jaxgin_ffi_matmul_all_to_all"},
                        (Op("jaxgin.fused.matmul_all_to_all", "MATMUL_ALL_TO_ALL"),)),
                 Target("jaxgin_all_gather_matmul", {"execute": "jaxgin_ffi_all_gather_matmul"},
                        (Op("jaxgin.fused.all_gather_matmul", "ALL_GATHER_MATMUL"),)),
                 Target("jaxgin_matmul_reduce_scatter", {"execute": "jaxgin_ffi_matmul_reduce_scatter"},
                        (Op("jaxgin.fused.matmul_reduce_scatter", "MATMUL_REDUCE_SCATTER"),)),
                 # the same exchange with one Triton kernel computing every chunk (its faults name the
                 # user's op, an attribute): loaded once per executable, as triton_call's
                 Target("jaxgin_triton_chunks", {"instantiate": "jaxgin_ffi_triton_chunks_instantiate",
                                                 "execute": "jaxgin_ffi_triton_chunks"},
                        (Op("jaxgin.fused.triton_chunks"),))),
        codes=(ChunkLayout,),
        preload=("preload_chunk_handoff_kernels",),
    ),
    Family(
        "triton_call",  # loads its kernel once per executable (instantiate), then launches it
        python=("jaxgin/triton_op.py",),
        sources=("ffi/triton_call.cu",),
        targets=(Target("jaxgin_triton_call",
                        {"instantiate": "jaxgin_ffi_triton_instantiate", "execute": "jaxgin_ffi_triton_execute"},
                        # The user's kernel faults in the device functions it calls (DEVICE_CALL).
                        (Op("jaxgin.triton_call"),), capturable=True),),
        codes=(ParamKind,),
        state_types=(StateType("jaxgin_triton_kernel", "jaxgin_ffi_triton_kernel_type_id",
                               "jaxgin_ffi_triton_kernel_type_info"),),
    ),
)


def targets() -> tuple[Target, ...]:
    return tuple(target for family in FAMILIES for target in family.targets)


def target_of(op: str) -> Target:
    """The custom-call target that serves the op called `op` ("jaxgin.ppermute")."""
    for target in targets():
        if any(o.name == op for o in target.ops):
            return target
    raise KeyError(f"no custom-call target serves {op!r} in jaxgin/ffi/op_table.py")


def handler_symbols(target: Target) -> tuple[str, ...]:
    """Every handler symbol the backend exports for `target`: its own, then its captured twin's
    (the stages they share once)."""
    both = [*target.handlers.values(), *(target.captured_handlers.values() if target.capturable else ())]
    return tuple(dict.fromkeys(both))


def tags() -> tuple[Op, ...]:
    """The tagged ops in table order; a tag's value is its position (the same build writes and reads it)."""
    return tuple(op for family in FAMILIES for op in family.all_ops() if op.tag is not None)


def _constants() -> dict[str, int]:
    found: dict[str, int] = {}
    for family in FAMILIES:
        found.update(family.constants)
        for codes in family.codes:
            prefix = _snake(codes.__name__)
            found.update({f"{prefix}_{member.name.lower()}": int(member) for member in codes})
    return found


def sources() -> tuple[str, ...]:
    """Every csrc file of the backend, in table order."""
    return tuple(source for family in FAMILIES for source in family.sources)


HEADER = "jaxgin_op_table.h"


def _snake(camel: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", camel).lower()


def _camel(snake: str) -> str:
    return "".join(part.capitalize() for part in snake.lower().split("_"))


def _c_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


# Every constant both sides need, by name: the rows' constants, then the attribute codes as
# <code>_<member> ("exchange_kind_ppermute").
CONSTANTS: Mapping[str, int] = _constants()


def header() -> str:
    """The C++ header the build writes from the table (see the module docstring)."""
    out = [
        "// Generated by jaxgin/build.py from jaxgin/ffi/op_table.py: edit the table, not this file.",
        "#pragma once",
        "#include <stdint.h>",
        "",
        "// Constants both languages need (the rows' `constants`).",
    ]
    out += [f"#define JAXGIN_{name.upper()} {value}u" for family in FAMILIES for name, value in family.constants.items()]
    out += ["", "// Which op a fault record names (jaxgin_fault::op): one tag per tagged op of the table.",
            "enum jaxgin_op_tag : uint32_t {"]
    out += [f"  JAXGIN_OP_{op.tag} = {value},  // {op.name}" for value, op in enumerate(tags())]
    out += ["};", "", "// How fault reports name the op that recorded a fault.",
            "static inline const char* jaxgin_op_name(uint32_t op) {", "  switch (op) {"]
    out += [f"    case JAXGIN_OP_{op.tag}: return {_c_string(op.name)};" for op in tags()]
    out += ['    default: return "a jaxgin operation";', "  }", "}", ""]
    out += ["#ifdef __cplusplus", "#include <cuda_runtime.h>", "",
            "// The handlers' C ABI (xla/ffi/api/c_api.h); declared here so that this header needs no XLA.",
            "struct XLA_FFI_Error;", "struct XLA_FFI_CallFrame;", "",
            "// Every custom-call handler and FFI state type getter, exported from the backend under the names",
            "// jaxgin/ffi/targets.py registers (each defined in its family's csrc/ffi file).", 'extern "C" {']
    for family in FAMILIES:
        for target in family.targets:
            out += [f'__attribute__((visibility("default"))) XLA_FFI_Error* {symbol}(XLA_FFI_CallFrame* call_frame);'
                    for symbol in handler_symbols(target)]
        for state in family.state_types:
            out += [f'__attribute__((visibility("default"))) void* {state.type_id}(void);',
                    f'__attribute__((visibility("default"))) void* {state.type_info}(void);']
    out += ['}  // extern "C"', "", "namespace jaxgin {", ""]
    out += ["// Attribute codes: Python writes them into a custom call's attributes, its handler reads them.",
            "namespace ffi_support {"]
    for family in FAMILIES:
        for codes in family.codes:
            members = ", ".join(f"k{_camel(m.name)} = {int(m)}" for m in codes)
            out += [f"enum {codes.__name__} : int64_t {{ {members} }};"]
    out += ["}  // namespace ffi_support", "",
            "// Each loads some of an op family's kernels on the current device (cudaFuncGetAttributes forces the",
            "// load). CUDA loads kernels lazily by default, and a first launch may synchronize the whole context:",
            "// a jaxgin kernel that spins until a transport thread completes its put then deadlocks against the",
            "// launch of the next kernel (measured on 2 x H200 with the mailbox kernels). The runtime calls every",
            "// hook at initialize, before any kernel can spin."]
    hooks = [hook for family in FAMILIES for hook in family.preload]
    out += [f"cudaError_t {hook}();" for hook in hooks]
    out += ["", "struct PreloadHook {", "  const char* name;", "  cudaError_t (*load)();", "};",
            "inline constexpr PreloadHook kPreloadHooks[] = {"]
    out += [f"    {{{_c_string(hook)}, &{hook}}}," for hook in hooks]
    out += ["};", "", "// Every constant above and every attribute code by name, for jaxgin_constant.",
            "struct TableConstant {", "  const char* name;", "  int64_t value;", "};",
            "inline constexpr TableConstant kTableConstants[] = {"]
    out += [f"    {{{_c_string(name)}, {value}}}," for name, value in CONSTANTS.items()]
    out += ["};", "", "}  // namespace jaxgin", "#endif  // __cplusplus", ""]
    return "\n".join(out)
