"""tritongin on a machine without GPUs: the device library builds, every device function compiles
and is compiled with the device library into one cubin for sm_90a, kernels that use none of them are compiled
exactly as without tritongin, misuse is a compile-time error, and the cache key carries the
library's identity. Runs on whichever Triton is installed (CI runs it on 3.6 and the newest).

Needs nvcc and its ptxas, and NCCL's headers (skips without them, unless JAXGIN_REQUIRE_NVCC=1).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

import tritongin  # noqa: E402
import tritongin.language as tgl  # noqa: E402
from jaxgin import build  # noqa: E402
from jaxgin.errors import JaxginError, ToolchainError  # noqa: E402
from jaxgin.triton_device import link  # noqa: E402

from conftest import compile_for_sm90, sm90_runtime  # noqa: E402

@pytest.fixture
def fresh_triton_cache(tmp_path, monkeypatch):
    """A private Triton cache, so every compile in the test really compiles."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    from triton import knobs

    monkeypatch.setattr(knobs.cache, "dir", str(tmp_path / "triton-cache"), raising=False)
    return tmp_path


@triton.jit
def every_function(ctx, buf, out, sig, nbytes, BLOCK: tl.constexpr):
    me = tgl.rank(ctx)
    n = tgl.world_size(ctx)
    right = (me + 1) % n
    tgl.put_signal(ctx, buf, buf, nbytes, right, sig)
    tgl.signal(ctx, right, sig + 1, 1)
    seen = tgl.wait_signal(ctx, sig, 1)
    consumed = tgl.wait_arrivals(ctx, sig + 1, 1)
    tgl.flush(ctx)
    tgl.barrier(ctx)
    offs = tl.arange(0, BLOCK)
    tl.store(tgl.peer_ptr(ctx, buf, right) + offs, tl.load(buf + offs))
    tl.store(out, seen + consumed + tgl.read_signal(ctx, sig) + tgl.gin_peer(ctx, right))


EVERY_SIGNATURE = {"ctx": "*u8", "buf": "*fp32", "out": "*i64", "sig": "i32", "nbytes": "i64", "BLOCK": "constexpr"}


@triton.jit
def plain_copy(src, dst, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs) * 2.0)


_C_KINDS = {"const void*": "address", "int": "i32", "int32_t": "i32", "uint32_t": "i32", "uint64_t": "i64",
            "int64_t": "i64"}
_C_RETURNS = {"int": "int32", "int32_t": "int32", "uint64_t": "int64", "int64_t": "int64"}


def _c_declarations() -> dict[str, tuple[str, list[str]]]:
    """symbol -> (return type, parameter types) of the device library's C declarations."""
    found = {}
    for header in ("jaxgin_triton.h", "jaxgin_device.h"):
        text = (build.sources_dir() / "device" / header).read_text()
        for ret, symbol, params in re.findall(r"__device__\s+([\w ]+?\*?)\s+(jaxgin_\w+)\(([^)]*)\);", text):
            types = [re.sub(r"\s+\w+$", "", p.strip()).replace(" *", "*") for p in params.split(",") if p.strip()]
            found[symbol] = (ret.strip(), types)
    return found


def test_triton_stubs_match_the_c_declarations():
    """The one table of Triton entry points (jaxgin.triton_device._externs.FUNCTIONS) agrees with
    the C header on every symbol's parameter count and kinds and its return type, and language.py
    wraps every stub."""
    from jaxgin.triton_device import _externs

    declared = _c_declarations()
    assert {"jaxgin_tt_put_signal", "jaxgin_rank", "jaxgin_read_signal"} <= declared.keys()  # the parse works
    for name, (symbol, shown, params, ret, pure) in _externs.FUNCTIONS.items():
        assert symbol in declared, f"{name}: {symbol} is not declared in the device library's headers"
        c_ret, c_params = declared[symbol]
        assert [_C_KINDS[t] for t in c_params] == [kind for _, kind in params], (name, c_params, params)
        assert _C_RETURNS[c_ret] == ret.name, (name, c_ret, ret)
        assert hasattr(tgl, shown), f"tritongin.language has no {shown} (wrapping {name})"
    assert _externs.FUNCTIONS["rank"][4] and _externs.FUNCTIONS["world_size"][4]  # pure: Triton may compute once
    assert not _externs.FUNCTIONS["put_signal"][4] and not _externs.FUNCTIONS["read_signal"][4]


def test_device_library(toolchain):
    artifacts = tritongin.device_library("sm_90a")
    assert artifacts.backend is None  # what tritongin links, and nothing else
    assert artifacts.directory.parent == build.default_cache_dir()
    assert artifacts.directory.name.startswith(f"nccl{toolchain.version_string}-sm_90a-")
    ptx = artifacts.ptx.read_text()
    for symbol in ("jaxgin_put_signal", "jaxgin_tt_put_signal", "jaxgin_tt_peer_delta", "jaxgin_tt_wait_arrivals"):
        assert re.search(rf"^\.visible\s+\.func\s+(?:\([^)]*\)\s*)?{symbol}\s*\(", ptx, flags=re.MULTILINE), symbol
    assert artifacts.cubin.read_bytes()[:4] == b"\x7fELF"
    # Triton owns the shared memory of the kernels the library is linked into and assumes its
    # dynamic part starts at offset 0; a static __shared__ in the library would shift it and
    # corrupt swizzled matmul tiles without any error.
    assert not re.search(r"^\s*\.shared\b", ptx, flags=re.MULTILINE), "the device library declares shared memory"


def test_linking_builds_only_the_device_library(toolchain, tmp_path, monkeypatch):
    """Triton-only work (a CPU machine compiling tritongin kernels) compiles the two nvcc steps of
    the device library, never the backend's twenty-one: it links nothing else. The commands are
    recorded and their outputs written in place of nvcc's (the real build is test_device_library's)."""
    commands = []

    def run(command, cwd):
        commands.append(command)
        Path(command[command.index("-o") + 1]).write_bytes(b"\x7fELF")

    monkeypatch.setattr(build, "_run", run)
    monkeypatch.setenv("JAXGIN_CACHE_DIR", str(tmp_path))
    link._library_ptx.cache_clear()
    try:
        assert link._library_ptx("sm_90a") == "\x7fELF"
    finally:
        link._library_ptx.cache_clear()  # the next test links the real library again
    assert sorted(Path(c[c.index("-o") + 1]).name for c in commands) == ["jaxgin_device.cubin", "jaxgin_device.ptx"]
    assert not list(tmp_path.glob(f"*/{build.BACKEND_LIBRARY}"))


def test_every_device_function_compiles_and_links_for_sm90a(toolchain, fresh_triton_cache, monkeypatch):
    linked = []
    real_link = link.link_kernel
    monkeypatch.setattr(link, "link_kernel",
                        lambda ptx, arch, options=(): linked.append(arch) or real_link(ptx, arch, options))
    kernel = compile_for_sm90(every_function, EVERY_SIGNATURE, {"BLOCK": 1024})
    ptx = kernel.asm["ptx"]
    assert set(link.library_calls(ptx)) == {
        "jaxgin_rank", "jaxgin_world_size", "jaxgin_tt_put_signal", "jaxgin_tt_signal", "jaxgin_tt_wait_signal",
        "jaxgin_tt_wait_arrivals", "jaxgin_tt_flush", "jaxgin_tt_barrier", "jaxgin_tt_peer_delta",
        "jaxgin_read_signal", "jaxgin_tt_gin_peer",
    }
    assert linked == ["sm_90a"]
    cubin = kernel.asm["cubin"]
    assert cubin[:4] == b"\x7fELF"
    # The linked cubin defines the library's functions (it would not load otherwise).
    assert b"jaxgin_tt_put_signal" in cubin
    # Stores through peer_ptr keep 16-byte vectors: the alignment hint survives.
    assert re.search(r"st\.global\.v4\.(b32|f32)", ptx)


def test_kernels_without_device_functions_are_untouched(toolchain, fresh_triton_cache, monkeypatch):
    from triton import knobs

    signature = {"src": "*fp32", "dst": "*fp32", "BLOCK": "constexpr"}
    monkeypatch.setattr(knobs.compilation, "always_compile", True, raising=False)
    monkeypatch.setattr(knobs.runtime, "add_stages_inspection_hook", None)
    without = compile_for_sm90(plain_copy, signature, {"BLOCK": 256}).asm["cubin"]
    monkeypatch.setattr(link, "_installed", False)
    link.install()
    linked = []
    monkeypatch.setattr(link, "link_kernel", lambda ptx, arch, options=(): linked.append(arch))
    with_hook = compile_for_sm90(plain_copy, signature, {"BLOCK": 256}).asm["cubin"]
    assert linked == []
    assert with_hook == without


def test_earlier_stages_hook_still_runs(toolchain, fresh_triton_cache, monkeypatch):
    from triton import knobs

    calls = []

    def earlier(*args):
        calls.append(len(args))
        return ("", "") if not args else None

    monkeypatch.setattr(knobs.runtime, "add_stages_inspection_hook", earlier)
    monkeypatch.setattr(link, "_installed", False)
    link.install()
    assert knobs.runtime.add_stages_inspection_hook is not earlier
    kernel = compile_for_sm90(every_function, EVERY_SIGNATURE, {"BLOCK": 256})
    assert kernel.asm["cubin"][:4] == b"\x7fELF"
    assert 5 in calls  # the earlier hook saw the pipeline


def test_cache_key_carries_the_library_identity(toolchain, monkeypatch):
    def fresh_kernel():
        @triton.jit
        def uses_rank(ctx, out):
            tl.store(out, tgl.rank(ctx))

        return uses_rank

    def fresh_plain():
        @triton.jit
        def plain(out):
            tl.store(out, 1)

        return plain

    def key_of(fresh):
        return fresh().cache_key

    key_a, plain_a = key_of(fresh_kernel), key_of(fresh_plain)
    monkeypatch.setattr(link, "library_key", lambda: "another-nccl")
    key_b, plain_b = key_of(fresh_kernel), key_of(fresh_plain)
    assert key_a != key_b
    assert plain_a == plain_b


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("tgl.put_signal(ctx, buf, buf, 64, tl.arange(0, 4), 0)", "`peer` must be a scalar"),
        ("tgl.signal(ctx, 1, tl.arange(0, 4), 1)", "`signal` must be a scalar"),
        ("tgl.put_signal(ctx, buf, buf, 64.0, 1, 0)", "`nbytes` must be an integer"),
        ("tgl.wait_signal(ctx, 0.5, 1)", "`signal` must be an integer"),
        ("tgl.rank(1.5)", "`ctx` must be a pointer"),
    ],
)
def test_misuse_is_a_compile_time_error(toolchain, tmp_path, body, message):
    source = tmp_path / "misuse_kernel.py"
    source.write_text(
        "import triton\nimport triton.language as tl\nimport tritongin.language as tgl\n\n"
        f"@triton.jit\ndef misuse(ctx, buf):\n    {body}\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        import importlib

        module = importlib.import_module("misuse_kernel")
        importlib.reload(module)
        with pytest.raises(triton.CompilationError) as error:
            compile_for_sm90(module.misuse, {"ctx": "*u8", "buf": "*fp32"})
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("misuse_kernel", None)
    # Triton wraps the stub's error in one CompilationError per inlined call; the user sees them all.
    chain, e = [], error.value
    while e is not None:
        chain.append(str(e))
        e = e.__cause__ or e.__context__
    assert any(message in text for text in chain), chain


def test_gpu_scenario_kernels_compile_and_link(toolchain, fresh_triton_cache):
    sys.path.insert(0, str(Path(__file__).parent / "gpu"))
    try:
        import tritongin_scenarios as s
    finally:
        sys.path.pop(0)
    cases = [
        (s.ring_kernel, {"ctx": "*u8", "send": "*i32", "recv": "*i32", "tally": "*i32", "data_sig": "i32",
                         "credit_sig": "i32", "words": "i32", "iteration": "i32", "BLOCK": "constexpr"}),
        (s.all_pairs_kernel, {"ctx": "*u8", "send": "*i32", "recv": "*i32", "tally": "*i32", "sig": "i32",
                              "words": "i32", "iteration": "i32", "BLOCK": "constexpr"}),
        (s.barrier_kernel, {"ctx": "*u8", "slots": "*i32", "tally": "*i32", "words": "i32", "iteration": "i32",
                            "BLOCK": "constexpr"}),
        (s.pingpong_kernel, {"ctx": "*u8", "buf": "*u8", "sig": "i32", "nbytes": "i32", "rounds": "i32"}),
        (s.raw_pingpong_kernel, {"ctx": "*u8", "flag": "*i32", "base": "i32", "rounds": "i32"}),
        (s.push_kernel, {"ctx": "*u8", "src": "*fp32", "dst": "*fp32", "count": "i32", "peer": "i32",
                         "BLOCK": "constexpr"}),
        (s.ring_call_kernel, {"ctx": "*u8", "x": "*fp32", "send": "*fp32", "recv": "*fp32", "data_sig": "i32",
                              "credit_sig": "i32", "out": "*fp32", "WORDS": "constexpr"}),
    ]
    for kernel, signature in cases:
        constexprs = {name: 1024 for name, kind in signature.items() if kind == "constexpr"}
        compiled = compile_for_sm90(kernel, signature, constexprs)
        assert compiled.asm["cubin"][:4] == b"\x7fELF", kernel.__name__
        assert link.library_calls(compiled.asm["ptx"]), kernel.__name__


def test_standalone_and_triton_call_need_gpus():
    import jax.numpy as jnp

    import jaxgin

    jaxgin.initialize()  # reference mode on this CPU-only machine
    for call in (tritongin.context, lambda: tritongin.empty((4,), "float32"), lambda: tritongin.signals(1)):
        with pytest.raises(JaxginError, match="needs jaxgin on GPUs"):
            call()
    with pytest.raises(JaxginError, match="runs Triton kernels on CUDA GPUs"):
        jaxgin.triton_call(plain_copy, jnp.ones(4), grid=(1,), out_shape=jnp.ones(4), BLOCK=4)


@triton.jit
def descriptor_copy(ctx, src, dst, N: tl.constexpr, BLOCK: tl.constexpr):
    desc = tl.make_tensor_descriptor(src, shape=[N], strides=[1], block_shape=[BLOCK])
    offs = tl.program_id(0) * BLOCK
    tl.store(dst + offs + tl.arange(0, BLOCK), desc.load([offs]))


@triton.jit
def masked_copy(ctx, src, n, dst, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


def _lowered_as_on_a_gpu(monkeypatch) -> list:
    """triton_call lowered here as on an sm_90 GPU (conftest.sm90_runtime: a stand-in runtime state,
    no device library link step), an ffi_call that returns zeros. Returns the list each compiled
    kernel goes into."""
    import jax
    import jax.numpy as jnp

    from jaxgin import triton_op as tc

    sm90_runtime(monkeypatch)
    compiled = []
    real_compile = tc._compile
    monkeypatch.setattr(tc, "_compile", lambda *a, **k: compiled.append(real_compile(*a, **k)) or compiled[-1])
    monkeypatch.setattr(jax.ffi, "ffi_call", lambda target, out_types, has_side_effect: (
        lambda *operands, **attrs: [jnp.zeros(t.shape, t.dtype) for t in out_types]))
    return compiled


@pytest.mark.parametrize("n, vectors", [(4096, True), (4100, False)])
def test_triton_call_specializes_ints_that_are_multiples_of_16(monkeypatch, n, vectors):
    """As Triton's own launcher does: a bound that is a multiple of 16 compiles as one, so the
    accesses masked against it stay 16-byte vectors (st.global.v4); another bound cannot."""
    import re

    import jax.numpy as jnp

    from jaxgin import triton_op as tc

    compiled = _lowered_as_on_a_gpu(monkeypatch)
    src = jnp.zeros(n, jnp.float32)
    tc.triton_call(masked_copy, src, n, grid=(triton.cdiv(n, 1024),), out_shape=src, enable_fp_fusion=False,
                   BLOCK=1024)
    stores = set(re.findall(r"st\.global[\w.]*", compiled[0].asm["ptx"]))
    assert ("st.global.v4.b32" in stores) == vectors, stores


def test_triton_call_gives_global_scratch_as_a_hidden_result(monkeypatch):
    """A kernel that makes tensor descriptors on the device needs Triton's global scratch, a slice
    per program: triton_call hands it over as one more XLA result, the size of the whole grid's
    slices, passes its address where Triton expects it and returns only the kernel's outputs."""
    import types

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxgin import triton_op as tc

    _lowered_as_on_a_gpu(monkeypatch)
    seen = {}

    def ffi_call(target, out_types, has_side_effect):
        def call(*operands, **attrs):
            seen.update(out_types=out_types, attrs=attrs)
            return [jnp.zeros(t.shape, t.dtype) for t in out_types]
        return call

    monkeypatch.setattr(jax.ffi, "ffi_call", ffi_call)
    src = jnp.arange(4096, dtype=jnp.float32)
    out = tc.triton_call(descriptor_copy, src, grid=(8,), out_shape=src, enable_fp_fusion=True, N=4096,
                         BLOCK=512)
    assert out.shape == (4096,) and out.dtype == jnp.float32  # the scratch is not returned
    compiled_size = tc._global_scratch_bytes(types.SimpleNamespace(global_scratch_size=100, global_scratch_align=128),
                                             (8, 1, 1))
    assert compiled_size == 8 * 128
    scratch_type = seen["out_types"][-1]
    assert len(seen["out_types"]) == 2 and scratch_type.dtype == np.uint8
    assert scratch_type.shape[0] > 0 and scratch_type.shape[0] % 8 == 0  # a slice per program
    params = list(seen["attrs"]["params"])
    # ... then Triton's two scratch pointers: the global one is result 1, the profile one null
    assert params[-4:] == [tc.ParamKind.RESULT, 1, tc.ParamKind.NULL_POINTER, 0]
    plain = tc.triton_call(plain_copy_ctx, src, grid=(8,), out_shape=src, enable_fp_fusion=True, BLOCK=512)
    assert plain.shape == (4096,) and len(seen["out_types"]) == 1
    assert list(seen["attrs"]["params"])[-4:] == [tc.ParamKind.NULL_POINTER, 0, tc.ParamKind.NULL_POINTER, 0]


def test_a_pure_call_has_no_jax_effect_and_stays_side_effecting_for_xla(monkeypatch):
    """triton_call(pure=True) is a primitive with no JAX effect: a jitted function holding it keeps
    JAX's fast dispatch path (any effect sends every call through the Python path), and JAX drops it
    where nothing uses its outputs, as it drops jaxgin's collectives. XLA still sees a side-effecting
    custom call (never dropped, merged or moved), the same HLO as the default call's, which JAX
    keeps. Inside shard_map and outside jit it behaves as the default call does."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxgin import triton_op as tc
    from jaxgin.errors import JaxginError

    real_ffi_call = jax.ffi.ffi_call
    _lowered_as_on_a_gpu(monkeypatch)
    monkeypatch.setattr(jax.ffi, "ffi_call", real_ffi_call)
    src = jnp.arange(4096, dtype=jnp.float32)

    def copy(pure):
        return lambda s: tc.triton_call(plain_copy_ctx, s, grid=(8,), out_shape=s, enable_fp_fusion=True, BLOCK=512,
                                        pure=pure)

    assert not jax.make_jaxpr(copy(True))(src).effects
    assert jax.make_jaxpr(copy(False))(src).effects
    for pure in (True, False):
        text = jax.jit(copy(pure)).lower(src).as_text()
        (call,) = [line for line in text.splitlines() if "custom_call" in line]
        assert "@jaxgin_triton_call(" in call and "has_side_effect = true" in call, call[:200]
        unused = jax.jit(lambda s, pure=pure: (copy(pure)(s), s + 1)[1]).lower(src).as_text()
        assert ("custom_call" in unused) == (not pure)
    with pytest.raises(JaxginError, match="cannot be vmapped"):
        jax.vmap(copy(True))(jnp.zeros((2, 4096), jnp.float32))
    # Inside shard_map, operands that vary over the axis and operands that do not (a replicated
    # table) go to one call, as with jax.ffi.ffi_call.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    P = jax.sharding.PartitionSpec

    def two_inputs(s, table, pure):
        return tc.triton_call(plain_add_ctx, s, table, grid=(8,), out_shape=s, enable_fp_fusion=True, BLOCK=512,
                              pure=pure)

    hlo = {}
    for pure in (True, False):
        mapped = jax.shard_map(lambda s, t, pure=pure: two_inputs(s, t, pure), mesh=mesh, in_specs=(P("x"), P()),
                               out_specs=P("x"))
        assert "custom_call" in jax.jit(mapped).lower(src, src).as_text()
        # several outputs, one typed by the caller, as the MoE kernels have
        both = jax.shard_map(lambda s, t, pure=pure: tc.triton_call(
            plain_copy_twice_ctx, s, t, grid=(8,), out_shape=[s, jax.ShapeDtypeStruct(s.shape, s.dtype)],
            enable_fp_fusion=True, BLOCK=512, pure=pure), mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"))
        first, second = jax.jit(both).trace(src, src).out_info
        assert first.shape == second.shape == src.shape
        hlo[pure] = jax.jit(both).lower(src, src).as_text(dialect="hlo")
    # XLA gets the same program either way (instruction names aside): only JAX's view differs.
    assert hlo[True].replace("jaxgin_triton_call.", "ffi_call.") == hlo[False]
    # Called outside jit, a pure call is compiled as a program of its own, as the default call is
    # (here, on CPU, XLA has no handler for the target: the error names it).
    for pure in (True, False):
        with pytest.raises(Exception, match="No FFI handler registered for jaxgin_triton_call"):
            jax.block_until_ready(copy(pure)(src))


@triton.jit
def plain_add_ctx(ctx, a, b, dst, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(a + offs) + tl.load(b + offs))


@triton.jit
def plain_copy_twice_ctx(ctx, a, b, dst, dst2, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(a + offs))
    tl.store(dst2 + offs, tl.load(b + offs))


@triton.jit
def plain_copy_ctx(ctx, src, dst, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs))


def test_ptx_is_stamped_with_a_version_the_linker_reads():
    """Triton 3.9 stamps PTX ISA 9.4 (its ptxas is CUDA 13.4's) over code LLVM generated for at
    most 9.0; a GPU machine's toolkit of CUDA 13.0 rejects 9.4 ("Unsupported .version 9.4;
    current version is '9.0'"). The link step lowers the stamp to what its ptxas reads, never
    raises it."""
    assert link.newest_ptx_isa((13, 0)) == (9, 0)
    assert link.newest_ptx_isa((13, 4)) == (9, 4)
    assert link.newest_ptx_isa((12, 9)) == (8, 8)
    assert link.newest_ptx_isa((12, 4)) == (8, 4)
    ptx = "//\n.version 9.4\n.target sm_90a\n.address_size 64\n.version 9.4 in a comment stays\n"
    lowered = link.readable_ptx(ptx, (13, 0))
    assert lowered.splitlines()[1] == ".version 9.0" and lowered.splitlines()[4].endswith("comment stays")
    assert link.readable_ptx(ptx, (13, 5)) == ptx
    older = ptx.replace("9.4", "8.7", 1)
    assert link.readable_ptx(older, (13, 0)) == older


def test_a_kernel_stamped_for_an_older_linker_still_links(toolchain, fresh_triton_cache):
    """What a CUDA 13.0 ptxas gets from the installed Triton, lowered to ISA 9.0, compiles with the
    device library into a cubin (the installed toolkit's ptxas compiles it here; it reads 9.0 too)."""
    compiled = compile_for_sm90(every_function, EVERY_SIGNATURE, {"BLOCK": 1024})
    lowered = link.readable_ptx(compiled.asm["ptx"], (13, 0))
    stamped = re.search(r"^\.version (\d+)\.(\d+)", lowered, re.MULTILINE).groups()
    assert tuple(map(int, stamped)) <= (9, 0)
    cubin = link.link_kernel(lowered, "sm_90a")
    assert cubin[:4] == b"\x7fELF"


KERNEL_PTX = """//
.version 9.4
.target sm_90a
.address_size 64

.extern .func  (.param .b32 func_retval0) jaxgin_rank
(
	.param .b64 jaxgin_rank_param_0
)
;
.extern .func  (.param .b32 func_retval0) vprintf
(
	.param .b64 vprintf_param_0,
	.param .b64 vprintf_param_1
)
;
.global .align 1 .b8 $str[2] = {104, 0};
.visible .entry kernel() { ret; }
"""

LIBRARY_PTX = """//
.version 9.0
.target sm_90a
.address_size 64

.extern .func  (.param .b32 func_retval0) vprintf
(
	.param .b64 vprintf_param_0,
	.param .b64 vprintf_param_1
)
;
.global .align 1 .b8 $str[2] = {105, 0};
.global .align 1 .b8 $str$1[2] = {106, 0};
.weak .global .align 8 .b8 table[8];
.visible .func  (.param .b32 func_retval0) jaxgin_rank(.param .b64 p) { mov.u64 %rd1, $str$1; mov.u64 %rd2, $str; ret; }
"""


def test_one_module_holds_the_library_before_the_kernel_and_nothing_of_it_external():
    """The kernel's declarations of library functions go (the library defines them); a CUDA
    function both declare stays declared once; the library's private strings are renamed so that
    they cannot clash with the kernel's ($str in both); the newer ISA heads the module."""
    module = link.one_module(KERNEL_PTX, LIBRARY_PTX)
    assert re.findall(r"^\.(version|target|address_size) (\S+)", module, re.MULTILINE) == [
        ("version", "9.4"), ("target", "sm_90a"), ("address_size", "64")]
    assert not link.library_calls(module)
    assert len(re.findall(r"\.extern\s+\.func\s+\([^)]*\)\s*vprintf", module)) == 1
    assert "jaxgin_library_$str[2] = {105" in module and "jaxgin_library_$str$1[2] = {106" in module
    assert "mov.u64 %rd1, jaxgin_library_$str$1; mov.u64 %rd2, jaxgin_library_$str;" in module
    assert ".global .align 1 .b8 $str[2] = {104" in module  # the kernel's own, untouched
    assert ".weak .global .align 8 .b8 table[8]" in module
    assert module.index("jaxgin_rank(.param") < module.index(".entry kernel")


def test_one_module_refuses_a_library_built_for_another_target():
    with pytest.raises(ToolchainError, match=r"\.target sm_90a and the device library's for sm_100a"):
        link.one_module(KERNEL_PTX, LIBRARY_PTX.replace("sm_90a", "sm_100a"))
    with pytest.raises(ToolchainError, match=r"has no \.target line"):
        link.one_module(KERNEL_PTX.replace(".target sm_90a\n", ""), LIBRARY_PTX)


def test_linked_kernels_get_the_ptxas_options_triton_would_give_them():
    """Line info always; FMA fusion off (--fmad=false) only when the kernel asked for it off; the
    kernel's own ptx_options last."""
    assert link.ptxas_options(True, None) == ("-lineinfo",)
    assert link.ptxas_options(False, "--opt-level 1") == ("-lineinfo", "--fmad=false", "--opt-level", "1")


@triton.jit
def square_matmul(ctx, a, b, c, N: tl.constexpr, BLOCK: tl.constexpr, BK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, BLOCK)
    ks = tl.arange(0, BK)
    acc = tl.zeros((BLOCK, BLOCK), tl.float32)
    for k in range(0, N, BK):
        acc = tl.dot(tl.load(a + rows[:, None] * N + (k + ks)[None, :]),
                     tl.load(b + (k + ks)[:, None] * BLOCK + cols[None, :]), acc)
    tl.store(c + rows[:, None] * BLOCK + cols[None, :], acc.to(tl.bfloat16))


def test_triton_call_refuses_a_kernel_with_more_shared_memory_than_the_gpu_allows(monkeypatch):
    """A kernel whose pipelined tiles need more shared memory per block than its GPU allows fails
    when it is lowered, naming the kernel, both sizes and the knob, not at its launch with only a
    CUDA error; the same kernel with fewer stages lowers."""
    import jax
    import jax.numpy as jnp

    from jaxgin import triton_op as tc

    compiled = _lowered_as_on_a_gpu(monkeypatch)
    a = jnp.zeros((256, 4096), jnp.bfloat16)
    b = jnp.zeros((4096, 256), jnp.bfloat16)
    out = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)
    with pytest.raises(JaxginError) as refused:
        tc.triton_call(square_matmul, a, b, grid=(1,), out_shape=out, num_warps=8, num_stages=4,
                       enable_fp_fusion=True, N=4096, BLOCK=256, BK=128)
    needed = compiled[-1].metadata.shared
    assert needed > 227 << 10
    assert str(refused.value) == (
        f"jaxgin.triton_call: kernel square_matmul needs {needed} bytes of shared memory per block; sm_90 GPUs "
        "allow at most 232448. Fewer stages (num_stages=4) or smaller blocks need less")
    tc.triton_call(square_matmul, a, b, grid=(1,), out_shape=out, num_warps=8, num_stages=2, enable_fp_fusion=True,
                   N=4096, BLOCK=256, BK=64)
    assert compiled[-1].metadata.shared <= 227 << 10
    tc.check_shared_memory("any", 1 << 30, (13, 0), 3)  # a capability not in the table: left to the launch
