"""GPU scenarios for jaxgin.fused, each run in a fresh process by tests/gpu/test_fused_gpu.py.

    python tests/gpu/fused_scenarios.py check              # one process, all visible GPUs
    python tests/gpu/fused_scenarios.py check RANK WORLD COORDINATOR   # one process per GPU

Every case runs for each implementation of its op (method="chunked": cuBLAS per chunk and
copy-engine exchange; method="triton": one Triton kernel). Comparisons per case:
- exact (triton): the fused op equals the unfused composition of the *same* tile code
  (jaxgin.fused._common.matmul, one Triton matmul kernel) and XLA's collective, bit for bit: the
  products are computed identically, so any difference is a tile sent to the wrong place, lost,
  stale or torn;
- close (both): it equals XLA's own x @ w then collective within the rounding of a different
  summation order (float32 cases use HIGHEST precision on both sides). For the chunked method,
  whose products come from cuBLAS calls XLA does not make identically, this is the check: a chunk
  misplaced, lost or left from an earlier call differs by the data's own magnitude.
Then gradients against jax.grad of the unfused composition, and LOOP_CALLS back-to-back calls (20,
or 200 in the soak tier) inside one jit with data that changes every call, each checked (exactly against the same tile code for
triton, within rounding against XLA's matmul for chunked) against a reference every GPU computes
without a collective (`written_out_reference`). Where every peer is on another (emulated)
host, both methods run the Triton kernel's GIN paths; then the bytes and puts each op sends through
the host transport per call are measured too (`traffic`). Prints RESULT: {json}.
"""

import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxgin
import job
from jaxgin import op_support
from harness import PhaseClock, by_tier, folded_worst, loop_fold, run_mesh_check, selected, transport_per_call
from jaxgin.fused import TileConfig, _common
from jaxgin.fused.all_gather_matmul import GIN_GROUPS
from jaxgin.fused.matmul_reduce_scatter import reduce_in_order

TILES = {2: TileConfig(128, 128, 64, 8, 8, 3), 4: TileConfig(64, 64, 32, 8, 4, 3)}
# JAXGIN_TEST_FUSED_TILES=BMxBNxBK/STAGES/WARPS: the 16-bit cases on another tile configuration (a
# GPU round checks a new candidate with the same cases).
if os.environ.get("JAXGIN_TEST_FUSED_TILES"):
    _shape, _stages, _warps = os.environ["JAXGIN_TEST_FUSED_TILES"].split("/")
    TILES[2] = TileConfig(*map(int, _shape.split("x")), 8, int(_warps), int(_stages))
LOOP_CALLS, FOLD_EVERY = by_tier(20, 200), 20


def _host(a) -> np.ndarray:
    return job.gathered(a).astype(np.float64)


def _rel(a, b) -> float:
    a, b = _host(a), _host(b)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def cases(n):
    # (op, M, K, N, dtype, split_axis, concat_axis): even tiles, ragged tiles (masks), every
    # split/concat pair, float32 and bfloat16. a2a and ag: M rows of x and K per device, w whole;
    # rs (matmul_reduce_scatter): M rows of x, K per device (x and w sharded along K), split_axis
    # the scatter dimension.
    return [
        ("a2a", 512, 256, 384, jnp.bfloat16, 0, 0),
        ("a2a", 200 * n, 136, 72, jnp.bfloat16, 0, 0),
        ("a2a", 256, 128, 64 * n, jnp.bfloat16, 1, 1),
        ("a2a", 128 * n, 96, 40, jnp.float32, 0, 1),
        ("a2a", 96, 64, 48 * n, jnp.float32, 1, 0),
        ("ag", 256, 192, 320, jnp.bfloat16, None, None),
        ("ag", 100, 72, 136, jnp.float32, None, None),
    ]


def reduce_scatter_cases(n):
    """matmul_reduce_scatter's cases (check_reduce_scatter), in the form of cases()."""
    return [
        ("rs", 256, 128, 320, jnp.bfloat16, 0, None),
        ("rs", 100, 72, 48 * n, jnp.float32, 1, None),
    ]


METHODS = ("chunked", "triton")
OP_METHODS = {"a2a": METHODS, "ag": METHODS, "rs": METHODS}


# The cases of cases() a scenario at a smaller world runs (job.spot_cases): even tiles in bfloat16,
# split columns in float32, all_gather_matmul with ragged rows.
SPOT_CASES = (0, 4, 6)


def scenario_cases(n, of=cases, spot=None):
    """(case, method) for every case of `of(n)` it runs and every method of its op, in the order
    they run: only SPOT_CASES of cases() with `spot` (default: job.spot_cases())."""
    spot = job.spot_cases() if spot is None else spot
    chosen = [cases(n)[i] for i in SPOT_CASES] if spot and of is cases else of(n)
    return [(c, meth) for meth in METHODS for c in chosen if meth in OP_METHODS[c[0]]]


def specs(op, split=0):
    """(x, w, result) partition specs along "x": x sharded by rows and w whole, except for
    matmul_reduce_scatter, whose x and w are sharded along K and whose result is scattered."""
    if op == "rs":
        return P(None, "x"), P("x", None), (P("x") if split % 2 == 0 else P(None, "x"))
    return P("x"), P(), P("x")


def global_shapes(op, n, m, k, nn):
    """The global shapes of x and w for a case (see cases)."""
    return ((m, n * k), (n * k, nn)) if op == "rs" else ((n * m, k), (k, nn))


def _programs(mesh, op, dtype, split, concat, tiles, method):
    prec = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    tile_prec = _common.dot_precision(dtype, prec)
    how = {"method": method, "tiles": tiles if method == "triton" else None}

    if op == "a2a":
        fused = lambda x, w: jaxgin.fused.matmul_all_to_all(x, w, axis_name="x", split_axis=split,
                                                             concat_axis=concat, precision=prec, **how)
        same_tiles = lambda x, w: jax.lax.all_to_all(_common.matmul(x, w, tiles, tile_prec), "x", split, concat, tiled=True)
        xla = lambda x, w: jax.lax.all_to_all(jnp.matmul(x, w, precision=prec), "x", split, concat, tiled=True)
    elif op == "rs":
        fused = lambda x, w: jaxgin.fused.matmul_reduce_scatter(x, w, axis_name="x", scatter_dimension=split,
                                                                 precision=prec, **how)

        def same_tiles(x, w):  # the partials of the same tile code, exchanged and summed in its order
            ys = _common.matmul(x, w, tiles, tile_prec)
            chunks = jnp.stack(jnp.split(ys, mesh.size, axis=split))
            return reduce_in_order(jax.lax.all_to_all(chunks, "x", 0, 0, tiled=True), x.dtype)

        xla = lambda x, w: jax.lax.psum_scatter(jnp.matmul(x, w, precision=prec), "x", scatter_dimension=split,
                                                tiled=True)
    else:
        fused = lambda x, w: jaxgin.fused.all_gather_matmul(x, w, axis_name="x", precision=prec, **how)
        same_tiles = lambda x, w: _common.matmul(jax.lax.all_gather(x, "x", tiled=True), w, tiles, tile_prec)
        xla = lambda x, w: jnp.matmul(jax.lax.all_gather(x, "x", tiled=True), w, precision=prec)
    if method == "triton":
        product = lambda a, b: _common.matmul(a, b, tiles, tile_prec)  # noqa: E731
    else:  # the loop below compares within rounding then
        product = lambda a, b: jnp.matmul(a, b, precision=prec)  # noqa: E731
    reference = functools.partial(written_out_reference, op=op, split=split, concat=concat, product=product)

    x_spec, w_spec, out_spec = specs(op, split or 0)

    def sm(f):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec))

    return sm(fused), sm(same_tiles), sm(xla), fused, reference


def written_out_reference(xs, ws, me, *, op, split, concat, product):
    """What GPU `me` gets from the op, computed on it without a collective from every GPU's x
    [n, m, k] and w [n, k, nn]: each source's product(x, w), then the all_to_all (or all_gather,
    or reduce-scatter) written out. For the loop below: its calls then add no collectives of the
    reference's own, which in emulated worlds each cost a round of the ranks' GPU time slices.
    Each source's product has the shape the op computes it in, so the tile code gives the same
    bits."""
    n = xs.shape[0]
    if op == "ag":
        return product(xs.reshape(n * xs.shape[1], xs.shape[2]), ws[me])
    ys = [product(xs[j], ws[j]) for j in range(n)]
    size = ys[0].shape[split] // n  # the chunk each source sends to each GPU
    mine = [jax.lax.dynamic_slice_in_dim(y, me * size, size, axis=split) for y in ys]
    if op == "rs":  # partials in the dtype, summed in float32 in source order (the kernel's arithmetic)
        return reduce_in_order(jnp.stack([c.astype(xs.dtype) for c in mine]), xs.dtype)
    return jnp.concatenate(mine, axis=concat)


def loop_against_written_out(x, w, *, fused_body, reference, calls=LOOP_CALLS, fold_every=FOLD_EVERY):
    """`calls` fused calls back to back in one program (inside shard_map over "x"), data changing
    every call, each compared with written_out_reference: the largest difference relative to the
    call's largest value, over every GPU (folded every `fold_every` calls: harness.folded_worst)."""
    xs = jax.lax.all_gather(x, "x")  # [n, m, k]: every GPU's shard, once
    # [n, k, nn]: every GPU's w (the same w everywhere but where it is sharded along K)
    ws = jax.lax.all_gather(*op_support.same_varying(("x",), w), "x")
    me = jax.lax.axis_index("x")

    def call(i, worst):
        xi = (xs.astype(jnp.float32) * jnp.cos(i * 0.1) + jnp.sin(i * 0.37)).astype(x.dtype)
        # The barrier keeps the reference's rounding to the dtype: with excess precision allowed (XLA's
        # GPU default), XLA drops an f32 -> bf16 -> f32 pair, and rs's f32 sum would stay unrounded.
        want = jax.lax.optimization_barrier(reference(xi, ws, me)).astype(jnp.float32)
        diff = jnp.abs(fused_body(xi[me], w).astype(jnp.float32) - want).max() / jnp.abs(want).max()
        return jnp.maximum(worst, diff)

    return folded_worst(call, jnp.float32(0), calls=calls, fold_every=fold_every, axis_name="x")


def _global(mesh, key, shape, dtype, spec):
    host = np.asarray(jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    return jax.device_put(host, NamedSharding(mesh, spec))


def check(mesh) -> dict:
    """matmul_all_to_all and all_gather_matmul."""
    return _check(mesh, cases, TRAFFIC_CASES)


def check_reduce_scatter(mesh) -> dict:
    """matmul_reduce_scatter."""
    return _check(mesh, reduce_scatter_cases, REDUCE_SCATTER_TRAFFIC_CASES)


def _check(mesh, of, traffic_cases) -> dict:
    n = mesh.size
    report = []
    for (op, m, k, nn, dtype, split, concat), method in selected(scenario_cases(n, of)):
        clock = PhaseClock()
        tiles = TILES[min(np.dtype(dtype).itemsize, 4)]
        fused, same_tiles, xla, fused_body, reference = _programs(mesh, op, dtype, split, concat, tiles, method)
        keys = jax.random.split(jax.random.key(m * 7 + k), 3)
        x_spec, w_spec, out_spec = specs(op, split or 0)
        x_shape, w_shape = global_shapes(op, n, m, k, nn)
        x = _global(mesh, keys[0], x_shape, dtype, x_spec)
        w = _global(mesh, keys[1], w_shape, dtype, w_spec)
        # Each jaxgin program is finished before the next program is compiled: over the host
        # transport (emulated hosts), XLA's compiler and the transport's copies for a program still
        # running wait for each other (docs/guide.md).
        got = jax.block_until_ready(fused(x, w))
        exact_ref, xla_ref = same_tiles(x, w), xla(x, w)
        exact = bool(np.array_equal(_host(got), _host(exact_ref))) if method == "triton" else None
        close = _rel(got, xla_ref)
        clock.lap("values")

        # Gradients against the unfused composition (XLA), same cotangent.
        ct = _global(mesh, keys[2], got.shape, dtype, out_spec)
        # (the cotangent is an argument: a multi-process program cannot close over a global array)
        loss = lambda f: (lambda x, w, ct: jnp.sum(f(x, w).astype(jnp.float32) * ct.astype(jnp.float32)))
        g_fused = jax.block_until_ready(jax.jit(jax.grad(loss(fused), argnums=(0, 1)))(x, w, ct))
        g_xla = jax.jit(jax.grad(loss(xla), argnums=(0, 1)))(x, w, ct)
        grad_err = max(_rel(a, b) for a, b in zip(g_fused, g_xla))
        clock.lap("gradients")

        # LOOP_CALLS calls back to back in one jit, data changing every call, each compared.
        loop = functools.partial(loop_against_written_out, fused_body=fused_body, reference=reference,
                                 fold_every=loop_fold(FOLD_EVERY))
        looped = jax.jit(jax.shard_map(loop, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=P()))
        looped = looped.lower(x, w).compile()
        clock.lap("loop_compile")
        loop_err = float(looped(x, w))
        clock.lap("loop_run")
        row = dict(op=op, method=method, m=m, k=k, n=nn, dtype=np.dtype(dtype).name, split=split, concat=concat,
                   exact=exact, rel_err_vs_xla=close, grad_rel_err=grad_err, loop_calls=LOOP_CALLS,
                   loop_max_rel_diff=loop_err, seconds=clock.seconds)
        print(json.dumps(row), flush=True)
        report.append(row)
    result = {"devices": n, "processes": jax.process_count(), "cases": report}
    if jaxgin.info()["gin_transport"] == "host":  # every byte between GPUs goes through the host transport
        clock = PhaseClock()
        result["traffic"] = [_traffic(mesh, *c) for c in traffic_cases]
        clock.lap("traffic")
        result["seconds"] = clock.seconds
    return result


# The chunked method's Triton layout (jaxgin.fused._chunked.TRITON_TILES: one Triton kernel computes
# every chunk and hands it over, the copy engines pull it), not an op's default: its a2a and rs
# cases (even and ragged tiles, both split axes, both dtypes).
def triton_tiles_cases(n):
    return [c for c in cases(n) if c[0] == "a2a"] + reduce_scatter_cases(n)


def check_triton_tiles(mesh) -> dict:
    """Each triton_tiles_cases case through the chunked method's Triton layout: exactly the
    composition of the same tile code and XLA's collective (the layout's products are the tile
    code's), then LOOP_CALLS calls back to back, data changing every call, each exactly the
    written-out reference of the same tile code."""
    import importlib

    from jaxgin.fused import _chunked

    # the modules (jaxgin.fused exports the ops under the same names)
    a2a = importlib.import_module("jaxgin.fused.matmul_all_to_all")
    rs = importlib.import_module("jaxgin.fused.matmul_reduce_scatter")

    n, state = mesh.size, jaxgin.runtime.current()
    report = []
    for op, m, k, nn, dtype, split, concat in triton_tiles_cases(n):
        tiles = TILES[min(np.dtype(dtype).itemsize, 4)]
        prec = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
        _, same_tiles, xla, _, reference = _programs(mesh, op, dtype, split, concat, tiles, "triton")
        if op == "a2a":
            plan = a2a._Plan(("x",), n, m, nn, k, split == 0, concat == 0, _common.lax_precision(prec), tiles,
                             "chunked")
            body = lambda x, w, plan=plan: a2a._kernel(state, x, w, plan, chunk_layout=_chunked.TRITON_TILES)
        else:
            plan = rs._Plan(("x",), n, m, nn, k, split % 2 == 0, _common.lax_precision(prec), tiles, "chunked")
            body = lambda x, w, plan=plan: rs._kernel(state, x, w, plan, chunk_layout=_chunked.TRITON_TILES)
        x_spec, w_spec, out_spec = specs(op, split or 0)
        keys = jax.random.split(jax.random.key(m * 7 + k), 2)
        x_shape, w_shape = global_shapes(op, n, m, k, nn)
        x = _global(mesh, keys[0], x_shape, dtype, x_spec)
        w = _global(mesh, keys[1], w_shape, dtype, w_spec)
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec))
        got = jax.block_until_ready(f(x, w))
        exact = bool(np.array_equal(_host(got), _host(same_tiles(x, w))))
        loop = functools.partial(loop_against_written_out, fused_body=body, reference=reference,
                                 fold_every=loop_fold(FOLD_EVERY))
        looped = jax.jit(jax.shard_map(loop, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=P()))
        row = dict(op=op, method="chunked, triton_tiles", m=m, k=k, n=nn, dtype=np.dtype(dtype).name, split=split,
                   concat=concat, exact=exact, rel_err_vs_xla=_rel(got, xla(x, w)), loop_calls=LOOP_CALLS,
                   loop_max_rel_diff=float(looped(x, w)))
        print(json.dumps(row), flush=True)
        report.append(row)
    return {"devices": n, "processes": jax.process_count(), "cases": report}


# (op, method, M (per device but for rs), K (per device for rs), N (split_axis=1: per chunk),
# dtype, split_axis, concat_axis): an even a2a, a2a with ragged columns (tiles packed to their
# valid columns), all_gather_matmul, matmul_reduce_scatter; "chunked" runs the Triton kernel on GIN
# jobs too (its tiles are tuned, so only its bytes are predicted).
TRAFFIC_CASES = [
    ("a2a", "triton", 512, 256, 384, jnp.bfloat16, 0, 0),
    ("a2a", "triton", 96, 64, 48, jnp.float32, 1, 0),
    ("a2a", "chunked", 512, 256, 384, jnp.bfloat16, 0, 0),
    ("ag", "triton", 256, 192, 320, jnp.bfloat16, None, None),
    ("ag", "chunked", 256, 192, 320, jnp.bfloat16, None, None),
]
REDUCE_SCATTER_TRAFFIC_CASES = [("rs", "triton", 512, 128, 384, jnp.bfloat16, 0, None)]


def _traffic(mesh, op, method, m, k, nn, dtype, split, concat, calls: int = 4) -> dict:
    """What one call puts through the host transport from this process's GPU, next to what it must
    move to the GPUs of other (emulated) hosts, `remote` of them (on a mixed mesh the host-mates'
    share goes over NVLink): matmul_all_to_all, each such GPU's chunk of x @ w once (remote * CM *
    CN items); all_gather_matmul, this GPU's shard once to each other host (remote hosts * M * K
    items; once per GPU there, remote * M * K, before hierarchical routing: rank_minimum_bytes);
    matmul_reduce_scatter, this GPU's partial of each such GPU's chunk once (remote * CM * CN
    items). Puts: one per tile for matmul_all_to_all and matmul_reduce_scatter, one per row group
    for all_gather_matmul and other host (Triton method, whose tiles are fixed here)."""
    n = mesh.size
    per_host = int(os.environ.get("JAXGIN_TEST_RANKS_PER_HOST", "1"))
    remote, remote_hosts = n - per_host, n // per_host - 1
    if split == 1:
        nn *= n  # N = the columns of one chunk times the axis size
    tiles = TILES[min(np.dtype(dtype).itemsize, 4)]
    how = {"method": method, "tiles": tiles if method == "triton" else None}
    if op == "a2a":
        body = lambda x, w: jaxgin.fused.matmul_all_to_all(x, w, axis_name="x", split_axis=split,  # noqa: E731
                                                           concat_axis=concat, **how)
    elif op == "rs":
        body = lambda x, w: jaxgin.fused.matmul_reduce_scatter(x, w, axis_name="x",  # noqa: E731
                                                               scatter_dimension=split, **how)
    else:
        body = lambda x, w: jaxgin.fused.all_gather_matmul(x, w, axis_name="x", **how)  # noqa: E731
    x_spec, w_spec, out_spec = specs(op, split or 0)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec))
    keys = jax.random.split(jax.random.key(m + nn), 2)
    x_shape, w_shape = global_shapes(op, n, m, k, nn)
    x = _global(mesh, keys[0], x_shape, dtype, x_spec)
    w = _global(mesh, keys[1], w_shape, dtype, w_spec)
    per_call = transport_per_call(lambda: f(x, w), calls)
    itemsize = np.dtype(dtype).itemsize
    if op in ("a2a", "rs"):
        cm, cn = (m // n, nn) if split == 0 else (m, nn // n)
        minimum = remote * cm * cn * itemsize
        puts = remote * -(-cm // tiles.block_m) * -(-cn // tiles.block_n)
        rank_minimum = minimum
    else:
        # the shard crosses to each other host once (jaxgin.hosts: one GPU there forwards it)
        minimum, rank_minimum = remote_hosts * m * k * itemsize, remote * m * k * itemsize
        tm = -(-m // tiles.block_m)
        per = -(-tm // GIN_GROUPS)  # tile rows per row group of a GIN job (at most GIN_GROUPS groups)
        puts = remote_hosts * -(-tm // per)
    return {"op": op, "method": method, "m": m, "k": k, "n": nn, "dtype": np.dtype(dtype).name,
            "rank": jax.process_index(), "world": n, "hosts": n // per_host, "remote_gpus": remote,
            "bytes": per_call["bytes"], "minimum_bytes": minimum, "rank_minimum_bytes": rank_minimum,
            "ratio": per_call["bytes"] / minimum, "puts": per_call["puts"],
            "expected_puts": puts if method == "triton" else None}


def tuning_clock(mesh) -> dict:
    """What the tile tuner measures (_common.time_matmul, the GPU's clock between two stamps) on the
    first GPU: one configuration at M = 512 and M = 4096 (K = 7168, N = 2048, bf16), and one whose
    shared memory no GPU has."""
    device = mesh.devices.flat[0]
    tiles = TileConfig(128, 64, 64, 8, 4, 5)
    seconds = {m: _common.time_matmul(tiles, m, 2048, 7168, jnp.bfloat16, "tf32", device=device) for m in (512, 4096)}
    too_big = _common.time_matmul(TileConfig(128, 256, 128, 8, 8, 5), 512, 2048, 7168, jnp.bfloat16, "tf32",
                                  device=device)
    return {"devices": mesh.size, "seconds": {str(m): s for m, s in seconds.items()}, "too_big": too_big}


if __name__ == "__main__":
    run_mesh_check({"check": check, "check_reduce_scatter": check_reduce_scatter,
                    "check_triton_tiles": check_triton_tiles, "tuning_clock": tuning_clock}[sys.argv[1]], "x")
