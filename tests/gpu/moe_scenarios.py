"""GPU scenarios for jaxgin.moe, each run in a fresh process by tests/gpu/test_moe_gpu.py.

    python tests/gpu/moe_scenarios.py check              # one process, all visible GPUs
    python tests/gpu/moe_scenarios.py check RANK WORLD COORDINATOR   # one process per GPU

Per case (random and adversarial routing, top_k 1 to 8, both modes, a capacity that overflows,
masked entries: expert ids -1 and >= E, tokens routed nowhere):
- dispatch equals the reference placement (jax.lax.all_to_all over staging arrays, run on the
  same GPUs) bit for bit: grouped rows, positions, weights, expert counts, dropped entries;
- combine equals the reference combine within one rounding of the returned rows;
- moe_layer equals a dense per-token computation (every expert's weights gathered), values and
  gradients in x, router_logits, w1, w2; the ragged_all_to_all layer is checked the same way where
  XLA's ragged_all_to_all is bounded (RAGGED_BASELINE); with masked entries, moe_layer's pipeline (router, masked ids, dispatch, the layer's expert FFN,
  combine) against the dense computation that skips them, the same values and gradients;
- a capacity that overflows makes moe_layer (without return_stats) warn, counted over processes;
- LOOP_CALLS calls (50, or 500 in the soak tier) in one jit with routing that changes every call,
  dispatch compared exactly and combine within rounding, every call (against
  whole_view_reference: no collectives of its own);
- one configuration called with other modes and capacities in turn (other grids, same buffers);
- with emulated hosts (peers on other hosts through GIN and jaxgin's host transport), the bytes
  and puts one dispatch and one combine move to those peers, next to the least they could.
Prints RESULT: {json}.
"""

import functools
import json
import os
import sys
import warnings

if __name__ == "__main__" and len(sys.argv) > 3:  # one process per GPU: XLA needs leave to run ragged_all_to_all
    # (the baseline layer) over NCCL. (Imported by the CPU tests of the loop's oracle: no change.)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback=true").strip()

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import device_read
import jaxgin
import job
from harness import PhaseClock, by_tier, folded_worst, loop_fold, run_mesh_check, selected, transport_per_call
from jaxgin import op_support
from jaxgin.hosts import entries
from jaxgin.moe import _routing, exchange
from jaxgin.moe.layer import expert_ffn

LOOP_CALLS, FOLD_EVERY = by_tier(50, 500), 50
# Whether moe_layer built on XLA's ragged_all_to_all (jaxgin.moe.ragged) is compared too: on GPUs
# of one host only. Across emulated hosts XLA's collective has no bounded wait, and on a mixed
# mesh it never returned (2026-11-27), which held the whole job.
RAGGED_BASELINE = not job.emulated()


def _host(a) -> np.ndarray:
    return job.gathered(a)


def _rel(a, b) -> float:
    a, b = _host(a).astype(np.float64), _host(b).astype(np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def cases(n):
    # (name, tokens per GPU, hidden, ffn, experts, top_k, dtype, capacity, mode, routing)
    return [
        ("random", 128, 512, 64, 8 * n, 4, jnp.bfloat16, None, "low_latency", "random"),
        ("ragged_shapes", 300, 384, 48, 4 * n, 2, jnp.float32, None, "high_throughput", "random"),
        ("all_to_expert_0", 64, 256, 32, 2 * n, 1, jnp.bfloat16, None, "auto", "one_expert"),
        ("top8", 96, 256, 32, 16, 8, jnp.bfloat16, None, "auto", "random"),
        ("empty_experts", 80, 256, 32, 4 * n, 2, jnp.float32, None, "high_throughput", "even_experts"),
        ("capacity_overflow", 64, 128, 32, 2 * n, 2, jnp.float32, 40, "auto", "one_gpu"),
        ("masked_ids", 96, 256, 32, 4 * n, 4, jnp.float32, None, "auto", "masked"),
    ]


# The cases a scenario at a smaller world runs (job.spot_cases): low latency in bfloat16, high
# throughput with ragged shapes in float32, masked entries.
SPOT_CASES = (0, 1, 6)


def planned_cases(n, spot=None):
    """The cases the scenario runs at axis size n: every one, or with `spot` (default:
    job.spot_cases()) SPOT_CASES only."""
    spot = job.spot_cases() if spot is None else spot
    return [cases(n)[i] for i in SPOT_CASES] if spot else cases(n)


def _logits(key, tokens, experts, routing):
    logits = jax.random.normal(key, (tokens, experts), jnp.float32)
    if routing == "one_expert":
        return logits.at[:, 0].add(100.0)
    if routing == "even_experts":
        return jnp.where(jnp.arange(experts) % 2 == 0, logits, -1e4)
    if routing == "one_gpu":  # every token prefers the experts of axis index 0
        local = experts // jax.device_count()
        return jnp.where(jnp.arange(experts) < local, logits + 50.0, logits)
    return logits


def _routed(logits, top_k, experts, routing):
    """The router's (weights, ids); for the "masked" routing with entries masked in every way: every
    fifth token routed nowhere (all -1), entry 0 of every third token -1, the last entry of every
    fourth token an id >= experts, entry 1 of every seventh token -7."""
    weights, ids = jaxgin.moe.router(logits, top_k)
    if routing == "masked":
        t, k = jnp.arange(ids.shape[0])[:, None], jnp.arange(top_k)[None, :]
        ids = jnp.where((t % 3 == 0) & (k == 0), -1, ids)
        ids = jnp.where((t % 4 == 1) & (k == top_k - 1), experts + t % 3, ids)
        ids = jnp.where((t % 7 == 2) & (k == 1), -7, ids)
        ids = jnp.where(t % 5 == 2, -1, ids)
    return weights, ids


def _dense(x, logits, w1, w2, top_k, routing="random"):
    """Each token through its experts one by one (all experts' weights gathered): the definition.
    Masked entries (ids outside [0, E)) contribute nothing."""
    experts = w1.shape[0]
    weights, ids = _routed(logits, top_k, experts, routing)
    valid = (ids >= 0) & (ids < experts)
    weights, ids = jnp.where(valid, weights, 0.0), jnp.clip(ids, 0, experts - 1)
    a, b = w1[ids], w2[ids]  # [T, K, H, F], [T, K, F, H]
    h = jax.nn.silu(jnp.einsum("th,tkhf->tkf", x.astype(jnp.float32), a.astype(jnp.float32)))
    y = jnp.einsum("tkf,tkfh->tkh", h.astype(x.dtype).astype(jnp.float32), b.astype(jnp.float32))
    return jnp.sum(y.astype(x.dtype).astype(jnp.float32) * weights[..., None], axis=1).astype(x.dtype)


def _reference_dispatch(x, ids, weights, plan):
    """The reference placement; its dropped count includes the masked entries, as dispatch's does."""
    route, masked = _routing.route(ids, plan)
    grouped, positions, weights_out, counts, rows, dropped = exchange.dispatch_reference(x, weights, route, plan)
    return (grouped, positions, weights_out, counts, rows, dropped + masked), route


def _kernel_calls() -> dict:
    """How many dispatch and combine kernels have run on each of this process's GPUs: the call
    counter each kernel's last program advances (the first word, jaxgin.op_kernels.CALLS, of every MoE
    configuration's state buffers)."""
    state = jaxgin.runtime.current()
    totals = {"dispatch": [0] * len(state.local_devices), "combine": [0] * len(state.local_devices)}
    for key, buffers in state.placements.items():
        if key[0] != "moe":
            continue
        for op in totals:
            for d in range(len(state.local_devices)):
                totals[op][d] += int(device_read.read(buffers[f"{op}_state"].local(d), 1)[0])
    return totals


def _launches_per_call(run, calls: int = 3) -> dict:
    """Kernels launched per call of run() on each GPU, as a sorted set per op (after one warm call)."""
    jax.block_until_ready(run())
    before = _kernel_calls()
    for _ in range(calls):
        jax.block_until_ready(run())
    after = _kernel_calls()
    return {op: sorted({(a - b) / calls for a, b in zip(after[op], before[op])}) for op in after}


def _expert_stand_in(rows):
    """What the checks put between dispatch and combine: the grouped rows themselves, scaled and
    shifted (distinct per row, so any misplaced row shows in the combine)."""
    return (rows.astype(jnp.float32) * 1.5 + 0.25).astype(rows.dtype)


def _wrong_and_difference(same, got, ref):
    """[2]: 1 if any of the dispatch comparisons `same` failed, and the largest difference between
    the combine `got` and the reference's `ref`."""
    wrong = jnp.logical_not(jnp.all(same)).astype(jnp.float32)
    return jnp.stack([wrong, jnp.max(jnp.abs(got.astype(jnp.float32) - ref.astype(jnp.float32)))])


def _against_reference(x, logits, *, top_k, experts, routing, capacity, mode):
    """One dispatch and combine (inside shard_map over "ep") next to the reference placement:
    ([1, 7] whether grouped rows, positions, weights, expert counts, rows per source, dropped
    entries and the routing in the handle are equal; combine's result; the reference combine; [1]
    dropped entries)."""
    weights, ids = _routed(logits, top_k, experts, routing)
    sent = jaxgin.moe.dispatch(x, ids, weights, num_experts=experts, axis_name="ep", capacity=capacity, mode=mode)
    plan = sent.handle.plan
    (ref_x, ref_pos, ref_w, ref_counts, ref_rows, ref_dropped), route = _reference_dispatch(x, ids, weights, plan)
    y = _expert_stand_in(sent.x)
    got = jaxgin.moe.combine(y, sent.handle)
    ref = exchange.combine_reference(y, ref_w, ref_pos, ref_rows, route, plan)
    same = _same_dispatch(sent, (ref_x, ref_pos, ref_w, ref_counts, ref_rows, ref_dropped))
    same_route = jnp.all(jnp.stack([jnp.array_equal(getattr(sent.handle.route, name), getattr(route, name))
                                    for name in ("slot", "before", "meta", "dest", "send_counts")]))
    return jnp.append(same, same_route)[None], got, ref, sent.dropped[None]


def _same_dispatch(sent, reference):
    """[6] whether dispatch's grouped rows, positions, weights, expert counts, rows per source and
    dropped entries equal the reference's (in that order)."""
    ref_x, ref_pos, ref_w, ref_counts, ref_rows, ref_dropped = reference
    return jnp.array([
        jnp.array_equal(sent.x, ref_x), jnp.array_equal(sent.handle.positions, ref_pos),
        jnp.array_equal(sent.handle.weights, ref_w), jnp.array_equal(sent.expert_counts, ref_counts),
        jnp.array_equal(sent.handle.rows, ref_rows), sent.dropped == ref_dropped,
    ])


def _rows_for(stacked, d: int | jax.Array):
    """What axis index d receives in a tiled all_to_all (split and concatenated along axis 0) of
    the per-source arrays `stacked` [P, P * R, ...]: block d of every source, in source order."""
    p = stacked.shape[0]
    return stacked.reshape(p, p, -1, *stacked.shape[2:])[:, d].reshape(-1, *stacked.shape[2:])


def whole_view_reference(xs, ids_all, weights_all, plan, me, expert_fn):
    """The reference dispatch and combine of every GPU of the axis, computed on this one without
    a collective (what each GPU stages, then block by block what each receives: the all_to_all
    written out), for the loop below: its calls then add no collectives of the reference's own,
    which in emulated worlds each cost a round of the ranks' GPU time slices. From every source's
    x [P, T, H], expert ids and weights [P, T, K]: this GPU's dispatch outputs, and the combine of
    expert_fn(grouped rows) of every GPU back to this GPU's tokens. Dropped entries include the
    masked ones, as dispatch counts them."""
    p = plan.size
    routes, masked = jax.vmap(lambda ids: _routing.route(ids, plan))(ids_all)
    staged = jax.vmap(lambda x, w, r: exchange.reference_staging(x, w, r, plan))(xs, weights_all, routes)
    placed = jax.vmap(lambda d: exchange.reference_placement(
        *(_rows_for(a, d) for a in (*staged, routes.send_counts)), plan))(jnp.arange(p))
    grouped, positions, weights_out = placed[:3]
    partial = jax.vmap(lambda y, w, pos: exchange.reference_partial_rows(y, w, pos, plan))(
        jax.vmap(expert_fn)(grouped), weights_out, positions)
    combined = exchange.reference_sum_at_home(_rows_for(partial, me), jax.tree.map(lambda a: a[me], routes), plan)
    *dispatched, dropped = (a[me] for a in placed)
    return (*dispatched, dropped + masked[me]), combined  # masked entries count as dropped, as in dispatch


def _loop_against_whole_view(x, logits, *, calls, top_k, experts, routing, capacity, mode, fold_every=50):
    """`calls` dispatches and combines back to back in one program (inside shard_map over "ep"),
    data and routing changing every call, each compared with whole_view_reference: [dispatch
    calls that differed (0 or 1), largest combine difference], over every GPU. Every GPU routes
    every GPU's tokens, so that the op and the reference get the very same weights (a batched
    router may round differently). The worst is folded over the GPUs every `fold_every` calls
    (harness.folded_worst)."""
    xs = jax.lax.all_gather(x, "ep")  # [P, T, H]
    ls = jax.lax.all_gather(logits, "ep")
    me = jax.lax.axis_index("ep")

    def call(i, worst):
        li = ls * jnp.cos(i * 0.3) + jnp.sin(i * 0.7 + jnp.arange(experts, dtype=jnp.float32))
        xi = (xs.astype(jnp.float32) + jnp.sin(i * 0.11)).astype(x.dtype)
        weights_all, ids_all = jax.vmap(lambda l: _routed(l, top_k, experts, routing))(li)
        sent = jaxgin.moe.dispatch(xi[me], ids_all[me], weights_all[me], num_experts=experts, axis_name="ep",
                                   capacity=capacity, mode=mode)
        got = jaxgin.moe.combine(_expert_stand_in(sent.x), sent.handle)
        reference, ref = whole_view_reference(xi, ids_all, weights_all, sent.handle.plan, me, _expert_stand_in)
        return jnp.maximum(worst, _wrong_and_difference(_same_dispatch(sent, reference), got, ref))

    return folded_worst(call, jnp.zeros((2,), jnp.float32), calls=calls, fold_every=fold_every, axis_name="ep")


def _grids_in_turn(mesh) -> dict:
    """One configuration (the same shapes, so the same heap buffers and device counters) called
    with different grids in turn, three rounds: low_latency, high_throughput (other token blocks,
    other senders), and a capacity that drops entries (other placers). Each call compared with the
    reference, as in the loop. Counters kept per call number would go wrong at the first switch."""
    n, tokens, hidden, experts, top_k = mesh.size, 64, 256, 4 * mesh.size, 2
    spec = P("ep")
    sharding = NamedSharding(mesh, spec)
    keys = jax.random.split(jax.random.key(11), 2)
    x = jax.device_put(jax.random.normal(keys[0], (n * tokens, hidden), jnp.float32).astype(jnp.bfloat16), sharding)
    logits = jax.device_put(jax.random.normal(keys[1], (n * tokens, experts), jnp.float32), sharding)

    def program(mode, capacity):
        def compared(x, logits):
            same, got, ref, _ = _against_reference(x, logits, top_k=top_k, experts=experts, routing="random",
                                                   capacity=capacity, mode=mode)
            return _wrong_and_difference(same, got, ref)[None]

        return jax.jit(jax.shard_map(compared, mesh=mesh, in_specs=(spec, spec), out_specs=spec))

    programs = [program("low_latency", None), program("high_throughput", None), program("low_latency", tokens // 2)]
    worst = np.zeros(2)
    for _ in range(3):
        for run in programs:
            worst = np.maximum(worst, _host(jax.block_until_ready(run(x, logits))).max(axis=0))
    return {"calls": 3 * len(programs), "mismatches": float(worst[0]), "combine_max_diff": float(worst[1])}


def check(mesh) -> dict:
    n = mesh.size
    spec = P("ep")
    report = []
    for name, tokens, hidden, ffn, experts, top_k, dtype, capacity, mode, routing in selected(planned_cases(n)):
        clock = PhaseClock()
        keys = jax.random.split(jax.random.key(tokens * 31 + hidden), 6)
        sharding = NamedSharding(mesh, spec)
        put = lambda a: jax.device_put(np.asarray(a), sharding)  # noqa: E731
        x = put(jax.random.normal(keys[0], (n * tokens, hidden), jnp.float32).astype(dtype))
        logits = put(_logits(keys[1], n * tokens, experts, routing))
        w1 = put((jax.random.normal(keys[2], (experts, hidden, ffn), jnp.float32) / np.sqrt(hidden)).astype(dtype))
        w2 = put((jax.random.normal(keys[3], (experts, ffn, hidden), jnp.float32) / np.sqrt(ffn)).astype(dtype))
        ct = put(jax.random.normal(keys[4], (n * tokens, hidden), jnp.float32).astype(dtype))

        both = functools.partial(_against_reference, top_k=top_k, experts=experts, routing=routing,
                                 capacity=capacity, mode=mode)

        exact_fn = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec, spec, spec)))
        same, got, ref, dropped = exact_fn(x, logits)
        launches = _launches_per_call(lambda: exact_fn(x, logits))  # each kernel once per call
        same = _host(same).all(axis=0).tolist()
        combine_err = _rel(got, ref)
        clock.lap("exact")

        if routing != "masked":
            layer = lambda x, l, a, b: jaxgin.moe.moe_layer(x, l, a, b, top_k=top_k, axis_name="ep",  # noqa: E731
                                                            capacity=capacity, mode=mode)
        else:  # moe_layer's own router never masks: its pipeline with masked ids
            def layer(x, l, a, b):
                weights, ids = _routed(l, top_k, experts, routing)
                sent = jaxgin.moe.dispatch(x, ids, weights, num_experts=experts, axis_name="ep", mode=mode)
                return jaxgin.moe.combine(expert_ffn(sent.x, a, b, sent.expert_counts, jax.nn.silu), sent.handle)

        def dense(x, l, a, b):
            return _dense(x, l, jax.lax.all_gather(a, "ep", tiled=True), jax.lax.all_gather(b, "ep", tiled=True), top_k,
                          routing)

        sm = lambda f: jax.shard_map(f, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec)  # noqa: E731
        row = dict(case=name, tokens=tokens, hidden=hidden, experts=experts, top_k=top_k, dtype=np.dtype(dtype).name,
                   mode=mode, capacity=capacity, dispatch_exact=same, dropped=int(_host(dropped).sum()),
                   combine_rel_err=combine_err, launches_per_call=launches)
        if routing == "masked":
            ids = jax.jit(jax.shard_map(lambda l: _routed(l, top_k, experts, routing)[1], mesh=mesh, in_specs=spec,
                                        out_specs=spec))(logits)
            ids = _host(ids)
            row["masked_entries"] = int(((ids < 0) | (ids >= experts)).sum())
        # Each jaxgin program is finished before the next program is compiled: over the host
        # transport (emulated hosts), XLA's compiler (loading and autotuning kernels) and the
        # transport's copies for a program still running wait for each other (docs/guide.md).
        if capacity is None:  # the dense definition has no capacity
            ours = jax.block_until_ready(jax.jit(sm(layer))(x, logits, w1, w2))
            want = jax.jit(sm(dense))(x, logits, w1, w2)  # compiled once, for both layers below
            row["layer_rel_err"] = _rel(ours, want)
            loss = lambda f: (lambda x, l, a, b, ct: jnp.sum(sm(f)(x, l, a, b).astype(jnp.float32)  # noqa: E731
                                                           * ct.astype(jnp.float32)))
            g_layer = jax.block_until_ready(jax.jit(jax.grad(loss(layer), argnums=(0, 1, 2, 3)))(x, logits, w1, w2, ct))
            g_dense = jax.jit(jax.grad(loss(dense), argnums=(0, 1, 2, 3)))(x, logits, w1, w2, ct)
            row["grad_rel_err"] = {k: _rel(a, b) for k, a, b in zip(("x", "logits", "w1", "w2"), g_layer, g_dense)}
            if RAGGED_BASELINE and jax.default_backend() == "gpu" and routing != "masked":  # none on XLA:CPU
                ragged = lambda x, l, a, b: jaxgin.moe.ragged.moe_layer(x, l, a, b, top_k=top_k, axis_name="ep")  # noqa: E731
                row["ragged_layer_rel_err"] = _rel(jax.jit(sm(ragged))(x, logits, w1, w2), want)

        else:  # moe_layer without return_stats warns on the devices that dropped entries
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                jax.block_until_ready(jax.jit(sm(layer))(x, logits, w1, w2))
                jax.effects_barrier()
            mine = sum(str(w.message).startswith("jaxgin.moe.moe_layer:") and "were dropped" in str(w.message)
                       for w in caught)
            row["layer_drop_warnings"] = int(_host(np.array([mine])).sum())

        clock.lap("layer_and_gradients")

        # LOOP_CALLS calls back to back, routing changing every call, each compared with the reference.
        loop = functools.partial(_loop_against_whole_view, calls=LOOP_CALLS, top_k=top_k, experts=experts,
                                 routing=routing, capacity=capacity, mode=mode, fold_every=loop_fold(FOLD_EVERY))
        looped = jax.jit(jax.shard_map(loop, mesh=mesh, in_specs=(spec, spec), out_specs=P()))
        looped = looped.lower(x, logits).compile()
        clock.lap("loop_compile")
        loop_wrong, loop_err = np.asarray(looped(x, logits)).tolist()  # (iterating the array would compile)
        clock.lap("loop_run")
        row.update(loop_calls=LOOP_CALLS, loop_dispatch_mismatches=loop_wrong, loop_combine_max_diff=loop_err,
                   seconds=clock.seconds)
        print(json.dumps(row), flush=True)
        report.append(row)
    clock = PhaseClock()
    result = {"devices": n, "processes": jax.process_count(), "cases": report, "ragged_baseline": RAGGED_BASELINE}
    if not job.spot_cases():  # the same kernels at every world: once per family, with every case (77 s at world 8)
        result.update(rows_only=_rows_only_launches(mesh), grids_in_turn=_grids_in_turn(mesh),
                      fp8=_fp8_exact(mesh), routing_kernel=_routing_kernel_exact())
        clock.lap("rows_only_grids_and_fp8")
    if jaxgin.info()["gin_transport"] == "host":  # every byte between GPUs goes through the host transport
        result["traffic"] = [_traffic(mesh, tokens, mode) for tokens, mode in ((256, "low_latency"),
                                                                               (512, "high_throughput"))]
        clock.lap("traffic")
    result["seconds"] = clock.seconds
    return result


def _traffic(mesh, tokens: int, mode: str, calls: int = 4) -> dict:
    """What one dispatch and one combine put through the host transport from this process's GPU,
    per call, next to the least they could, counting only the GPUs of other (emulated) hosts (on a
    mixed mesh, a host-mate's share goes over NVLink): for dispatch, each token's row once per such
    destination host (H x item size each) plus the counts row per such GPU; for combine, one row
    per (token, other host) that this GPU returns as that token's network entry on its host (the
    host's GPUs' partials summed), plus a map per other host of where its GPUs keep the partials
    of this GPU's tokens. What travels beyond the rows is routing metadata, reported apart."""
    n, hidden, top_k, experts, dtype = mesh.size, 2048, 4, 8 * mesh.size, jnp.bfloat16
    spec = P("ep")
    sharding = NamedSharding(mesh, spec)
    keys = jax.random.split(jax.random.key(tokens), 2)
    x = jax.device_put(jax.random.normal(keys[0], (n * tokens, hidden), jnp.float32).astype(dtype), sharding)
    logits = jax.device_put(jax.random.normal(keys[1], (n * tokens, experts), jnp.float32), sharding)
    weights, ids = jax.jit(lambda l: jaxgin.moe.router(l, top_k))(logits)
    sm = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))  # noqa: E731
    go = lambda x, i, w: jaxgin.moe.dispatch(x, i, w, num_experts=experts, axis_name="ep", mode=mode)  # noqa: E731
    only_dispatch = sm(lambda x, i, w: go(x, i, w).x)
    round_trip = sm(lambda x, i, w: (lambda d: jaxgin.moe.combine(d.x, d.handle))(go(x, i, w)))

    dispatch = transport_per_call(lambda: only_dispatch(x, ids, weights), calls)
    both = transport_per_call(lambda: round_trip(x, ids, weights), calls)
    me = jax.process_index()  # one GPU per process: its rank along the axis
    per_host = int(os.environ.get("JAXGIN_TEST_RANKS_PER_HOST", "1"))
    remote = [r for r in range(n) if r // per_host != me // per_host]
    itemsize = np.dtype(dtype).itemsize
    mine = np.asarray(_host(ids)).reshape(n, tokens, top_k)[me]
    plan_local = experts // n
    dest = mine // plan_local
    remote_dests = [set(row.tolist()) & set(remote) for row in dest]  # each token's GPUs on other hosts
    sent_rows = sum(map(len, remote_dests))
    # dispatch sends a token once per destination host (jaxgin.hosts), not once per destination GPU
    union = {}  # rows of the union for each other host
    for dests in remote_dests:
        for h in {d // per_host for d in dests}:
            union[h] = union.get(h, 0) + 1
    host_rows = sum(union.values())
    counts_bytes = len(remote) * (plan_local + 1) * 4
    dispatch_min = host_rows * hidden * itemsize + counts_bytes
    # combine returns, for each source of another host whose entry on this host is this GPU
    # (jaxgin.hosts), one row per token of it that came to this host
    entry = entries([r // per_host for r in range(n)])
    every = np.asarray(_host(ids)).reshape(n, tokens, top_k) // plan_local  # [source, token, k]: GPU
    my_host = [d for d in range(n) if d // per_host == me // per_host]
    returned = sum(int(np.isin(every[s], my_host).any(axis=1).sum()) for s in remote if entry[s, me] == me)
    combine_min = returned * hidden * itemsize
    combine_metadata = sum(4 * (1 + rows * per_host) for rows in union.values())  # this GPU's maps
    combine_puts = sum(1 for s in remote if entry[s, me] == me) + len(union)
    reduced_here = sum(int((every[s] == me).any(axis=1).sum()) for s in remote)  # one row each, per GPU
    blocks = -(-tokens // exchange._blocks(_routing.Plan(("ep",), n, tokens, hidden, top_k, plan_local, 1,
                                                         np.dtype(dtype).name, mode))[0])
    # beside the rows: block starts per GPU; per host the union's weights (K float32 a row) and row
    # count, and per GPU of it each union row's codes there and staging row (K + 1 int32)
    metadata = (len(remote) * (blocks + 1) * 4 + host_rows * top_k * 4 + len(union) * 4
                + host_rows * per_host * (top_k + 1) * 4)
    puts = 2 * len(remote) + len(union) * (3 + 2 * per_host)  # every union here has rows
    combine = {k: both[k] - dispatch[k] for k in both}
    return {
        "tokens": tokens, "hidden": hidden, "top_k": top_k, "experts": experts, "mode": mode, "rank": me,
        "remote_gpus": len(remote), "remote_hosts": len({r // per_host for r in remote}),
        "dispatch": dispatch, "dispatch_minimum_bytes": dispatch_min, "dispatch_metadata_bytes": metadata,
        "dispatch_expected_puts": puts, "dispatch_hosts_reached": len(union), "dispatch_counts_bytes": counts_bytes,
        "dispatch_ratio": dispatch["bytes"] / max(dispatch_min, 1),
        "dispatch_rows_rank_minimum_bytes": sent_rows * hidden * itemsize,
        "dispatch_rows_host_minimum_bytes": host_rows * hidden * itemsize,
        "combine": combine, "combine_minimum_bytes": combine_min, "combine_metadata_bytes": combine_metadata,
        "combine_expected_puts": combine_puts, "combine_ratio": combine["bytes"] / max(combine_min, 1),
        "combine_rows_rank_minimum_bytes": reduced_here * hidden * itemsize,
    }


def _fp8_exact(mesh) -> dict:
    """dispatch(fp8=True) against its own reference, per mode: the dispatch (without fp8) of the
    rows it rounds to, bit for bit, counts and drops included (bfloat16, hidden 512): how many values
    differ, and on how many GPUs the counts or drops do."""
    spec = P("ep")
    n, tokens, hidden, experts, top_k = mesh.size, 96, 512, 8 * mesh.size, 4
    keys = jax.random.split(jax.random.key(17), 2)
    sharding = NamedSharding(mesh, spec)
    x = jax.device_put(np.asarray(jax.random.normal(keys[0], (n * tokens, hidden), jnp.float32) * 3, jnp.bfloat16),
                       sharding)
    logits = jax.device_put(np.asarray(_logits(keys[1], n * tokens, experts, "random")), sharding)
    fp8 = jaxgin.moe.fp8
    rounded = jax.block_until_ready(jax.jit(fp8.rounded)(x))
    exact = {}
    for mode in ("low_latency", "high_throughput"):
        def both(x, rounded, logits, mode=mode):
            weights, ids = _routed(logits, top_k, experts, "random")
            kw = dict(num_experts=experts, axis_name="ep", mode=mode, capacity=tokens * top_k // 2)
            got = jaxgin.moe.dispatch(x, ids, weights, fp8=True, **kw)
            want = jaxgin.moe.dispatch(rounded, ids, weights, **kw)
            differing = jnp.sum(jax.lax.bitcast_convert_type(got.x, jnp.int16)
                                != jax.lax.bitcast_convert_type(want.x, jnp.int16))
            counts = jnp.array_equal(got.expert_counts, want.expert_counts) & (got.dropped == want.dropped)
            return jnp.stack([differing, jnp.where(counts, 0, 1)])[None]

        f = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
        per_gpu = _host(jax.block_until_ready(f(x, rounded, logits)))
        exact[mode] = {"values_differing": int(per_gpu[:, 0].sum()), "counts_differing_gpus": int(per_gpu[:, 1].sum())}
    return exact


# (GPUs, tokens, top_k, local experts, masked ids): the routing kernel's GPU counts are logical, so
# one GPU checks the shapes of larger worlds; tokens past one program's 16 and up to the 256 of one
# counting step (128 at 4 warps, 200 and 256 at 8), top_k padded to a power of two, masked ids.
ROUTING_KERNEL_SHAPES = ((1, 96, 4, 8, False), (4, 128, 8, 64, False), (8, 256, 8, 32, False),
                         (2, 200, 6, 5, True), (3, 37, 3, 7, True))


def _device_route(ids, plan):
    """route()'s arrays from the routing kernel on GPUs (_routing_device.route_alone: the device
    functions dispatch routes with inside its kernel), from route() itself in reference mode."""
    def on_gpu(state, i, p):
        from jaxgin.moe import _routing_device  # needs Triton

        return _routing_device.route_alone(i, p)

    return op_support.by_backend(_routing.route, on_gpu)(ids, plan)


def _routing_kernel_exact() -> list[dict]:
    """The device routing (what dispatch runs inside its kernel up to LOW_LATENCY_MAX_TOKENS tokens,
    here as the routing kernel alone, at GPU counts one GPU cannot dispatch over) against XLA's
    _routing.route on the same ids, array by array, on this process's first GPU. Triton's
    interpreter checks the same on CPUs, but not the GPU's own lowering."""
    device = jax.local_devices()[0]
    checked = []
    for p, t, k, el, masked in ROUTING_KERNEL_SHAPES:
        rng = np.random.default_rng(p * 1000 + t)
        ids = rng.integers(-1 if masked else 0, p * el + (2 if masked else 0), size=(t, k)).astype(np.int32)
        plan = _routing.Plan(("ep",), p, t, 1, k, el, 1, "bfloat16", _routing.LOW_LATENCY)
        on_gpu = jax.device_put(ids, device)
        got, got_masked = jax.jit(lambda i: _device_route(i, plan))(on_gpu)
        want, want_masked = jax.jit(lambda i: _routing.route(i, plan))(on_gpu)
        equal = {name: bool(np.array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name))))
                 for name in ("slot", "before", "meta", "dest", "send_counts")}
        equal["masked"] = int(got_masked) == int(want_masked)
        checked.append(dict(gpus=p, tokens=t, top_k=k, local_experts=el, masked_entries=int(want_masked), equal=equal))
    return checked


def _rows_only_launches(mesh) -> dict:
    """Dispatch launches per call in the program where XLA's dynamic-slice fusion doubled the
    kernel before jaxgin.triton_call guarded its operands: 128 tokens per GPU, only the rows used,
    so the routing's `before` operand is an aligned slice of a padded prefix sum."""
    spec = P("ep")
    n, tokens, hidden, experts, top_k = mesh.size, 128, 1024, 32 * mesh.size, 8
    sharding = NamedSharding(mesh, spec)
    keys = jax.random.split(jax.random.key(7), 2)
    x = jax.device_put(jax.random.normal(keys[0], (n * tokens, hidden), jnp.float32).astype(jnp.bfloat16), sharding)
    logits = jax.device_put(jax.random.normal(keys[1], (n * tokens, experts), jnp.float32), sharding)
    weights, ids = jax.jit(lambda l: jaxgin.moe.router(l, top_k))(logits)
    rows_only = jax.jit(jax.shard_map(
        lambda x, i, w: jaxgin.moe.dispatch(x, i, w, num_experts=experts, axis_name="ep", capacity=1280).x,
        mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
    return _launches_per_call(lambda: rows_only(x, ids, weights))


if __name__ == "__main__":
    run_mesh_check(check, "ep")
