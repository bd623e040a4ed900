"""jaxgin.moe.dispatch / combine: expert-parallel token exchange inside shard_map.

On GPUs each is one Triton kernel (_kernels.py) run through jaxgin.triton_call; up to 256 tokens
per GPU dispatch's kernel also routes (no kernel before it), above that, and in jobs with GPUs on
other hosts, XLA's fusions route; in
reference mode (CPU) the same placement is computed with jax.lax.all_to_all over worst-case
staging arrays.
Gradients (jax.custom_vjp, shared by both modes so the CPU tests check the rules the GPUs use):
dispatch's backward is a combine (with unit weights, for x) plus the routing weights' cotangents
sent home; combine's backward is a dispatch of the output cotangent. Entries that land nowhere
(masked ids, entries over capacity) contribute nothing forward, so their weights' gradients are 0.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxgin import op_support, settings
from jaxgin.collectives import all_to_all
from jaxgin.ffi import axes as axes_lib
from jaxgin.hosts import rank_hosts
from jaxgin.route import axis_route
from jaxgin.triton_op import OWN_KERNELS_FP_FUSION, triton_call
from jaxgin.moe import _routing
from jaxgin.moe import fp8 as fp8_lib
from jaxgin.moe._routing import Plan, SourceRoute
from jaxgin.op_support import pow2

DISPATCH = "jaxgin.moe.dispatch"
COMBINE = "jaxgin.moe.combine"


@dataclasses.dataclass(frozen=True)
class Handle:
    """What combine needs from a dispatch (a pytree: pass it through jit / shard_map freely)."""

    route: SourceRoute  # this GPU's tokens: where each went
    positions: jax.Array  # int32 [P, T, K]: row of the grouped layout of entry k of the row from s; -1
    weights: jax.Array  # float32 [P, T, K]: routing weight of that entry (0 where it did not land)
    rows: jax.Array  # int32 [P]: rows received from each source
    plan: Plan


jax.tree_util.register_dataclass(Handle, data_fields=["route", "positions", "weights", "rows"], meta_fields=["plan"])


@dataclasses.dataclass(frozen=True)
class Dispatched:
    """dispatch's result. x: [capacity, H], rows grouped by local expert (expert 0's first), rows past
    sum(expert_counts) zero; expert_counts: int32 [local experts], the rows kept per expert;
    dropped: int32 (), entries not delivered: entries that arrived here past the capacity, plus
    this GPU's masked entries (expert id outside [0, num_experts), not sent anywhere);
    handle: for combine."""

    x: jax.Array
    expert_counts: jax.Array
    dropped: jax.Array
    handle: Handle


jax.tree_util.register_dataclass(Dispatched, data_fields=["x", "expert_counts", "dropped", "handle"], meta_fields=[])


def dispatch(x, topk_ids, topk_weights, *, num_experts: int, axis_name, capacity: int | None = None,
             mode: str = "auto", fp8: bool = False) -> Dispatched:
    """Inside shard_map over the expert axis (axis index d holds experts d*E/P ... (d+1)*E/P - 1):
    sends each token of x [T, H] once to every GPU that owns one of its topk_ids [T, K] (global
    expert ids), and lays out what arrives here grouped by local expert (ready for
    jax.lax.ragged_dot with expert_counts as group sizes). Within an expert, rows are ordered by
    source GPU, then by token. topk_weights [T, K] travel along for combine.

    Masked entries: an expert id outside [0, num_experts) (-1 by convention, as in DeepEP and NCCL
    EP; ids >= num_experts too) means "no expert". Such an entry is sent nowhere, adds nothing to
    combine's output, is counted in `dropped`, and gets a zero gradient for its routing weight. A
    token whose entries are all masked is sent nowhere: combine returns zeros for it, and its x
    gradient is 0.

    capacity: rows of the grouped output (default: the worst case, P * T * min(K, E / P)); entries
    that do not fit are dropped and counted in `dropped`, never silently. mode: 'low_latency'
    (small batches, decode), 'high_throughput', or 'auto' (low_latency up to 256 tokens per GPU).
    On GPUs, peers of this host get NVLink stores and other hosts GIN puts: each token's row once
    per destination host, to one GPU there that forwards it over NVLink (jaxgin.hosts), in a few
    large puts per host and call (_kernels.py tells how).

    fp8=True: rows travel as e4m3 with a float32 scale per 128 values (jaxgin.moe.fp8; hidden must
    be a multiple of 128), 0.52x the bytes of bfloat16; the result's x is exactly fp8.rounded(x)
    (fp8.dequantize(*fp8.quantize(x), x.dtype)) in the same layout, and combine takes expert outputs
    in x's dtype as after any dispatch. Gradients pass through the rounding unchanged (x's cotangent
    is the one a dispatch without fp8 gives)."""
    names = axes_lib.axis_names(axis_name, DISPATCH)
    size = axes_lib.axis_size(names, DISPATCH)
    x, topk_ids, topk_weights = _routing.check_inputs(DISPATCH, x, topk_ids, topk_weights)
    if not isinstance(fp8, bool):
        raise TypeError(f"{DISPATCH}: fp8 must be True or False, got {fp8!r}")
    if fp8:
        fp8_lib.check_hidden(DISPATCH, x.shape[1])
    plan = _routing.make_plan(DISPATCH, names, size, x, topk_ids, num_experts, capacity, mode)
    x, topk_ids, topk_weights = op_support.same_varying(names, x, topk_ids, topk_weights)
    grouped, positions, weights, counts, rows, dropped, route, invalid = (_routed_dispatch_fp8 if fp8 else _routed_dispatch)(
        x, topk_weights.astype(jnp.float32), topk_ids.astype(jnp.int32), plan)
    return Dispatched(grouped, counts, dropped + invalid, Handle(route, positions, weights, rows, plan))


def combine(expert_out, handle: Handle):
    """The inverse of the dispatch that made `handle`: expert_out [capacity, H] in dispatch's layout
    (row i = an expert's output for the token dispatch put at row i) goes back to each token's GPU,
    weighted by the routing weights: out[t] = sum over t's top-k entries of weight * expert_out[row],
    [T, H], where entries that landed nowhere (masked ids, over capacity) count as 0. Each token
    gets one row per GPU (that GPU's entries reduced there, float32, then rounded to x's dtype),
    summed at home in float32; from another host, one row per host (its GPUs' rows summed in
    float32 by the host's network entry, jaxgin.hosts, and rounded once). Differentiable in expert_out and, through the handle, in the
    topk_weights given to dispatch."""
    if not isinstance(handle, Handle):
        raise TypeError(f"{COMBINE}: handle must be the .handle of jaxgin.moe.dispatch's result, got {type(handle).__name__}")
    plan = handle.plan
    expert_out = jnp.asarray(expert_out)
    if expert_out.shape != (plan.capacity, plan.hidden):
        raise ValueError(
            f"{COMBINE}: expert_out has shape {list(expert_out.shape)}; it must be [capacity, hidden] = "
            f"[{plan.capacity}, {plan.hidden}] like the dispatched x"
        )
    if expert_out.dtype.name != plan.dtype:
        raise TypeError(f"{COMBINE}: expert_out is {expert_out.dtype.name} but the dispatched x was {plan.dtype}; cast it")
    arrays = op_support.same_varying(plan.names, expert_out, handle.weights, handle.positions, handle.rows)
    return _combine(*arrays, handle.route, plan)


# ---------------------------------------------------------------------------------------------
# Reference mode: the same placement with jax.lax collectives over worst-case staging arrays.


def _all_to_all(a, plan: Plan):
    return jax.lax.all_to_all(a, plan.names, 0, 0, tiled=True)


def dispatch_reference(x, weights, route: SourceRoute, plan: Plan):
    staged_x, staged_meta, staged_w = reference_staging(x, weights, route, plan)
    received = [_all_to_all(a, plan) for a in (staged_x, staged_meta, staged_w, route.send_counts)]
    return reference_placement(*received, plan)


def reference_staging(x, weights, route: SourceRoute, plan: Plan):
    """The sending half of the reference dispatch, on one GPU: [P * T] rows per array, block d
    holding what goes to axis index d (this GPU's staging row there; zero / -1 rows unused)."""
    p, t, k, h = plan.size, plan.tokens, plan.top_k, plan.hidden
    rows = jnp.where(route.slot >= 0, jnp.arange(p, dtype=jnp.int32) * t + route.slot, p * t).reshape(-1)  # [T*P]
    staged_x = jnp.zeros((p * t, h), x.dtype).at[rows].set(jnp.repeat(x, p, axis=0), mode="drop")
    staged_meta = jnp.full((p * t, k), -1, jnp.int32).at[rows].set(route.meta.reshape(t * p, k), mode="drop")
    staged_w = jnp.zeros((p * t, k), jnp.float32).at[rows].set(jnp.repeat(weights, p, axis=0), mode="drop")
    return staged_x, staged_meta, staged_w


def reference_placement(got_x, got_meta, got_w, counts, plan: Plan):
    """The receiving half of the reference dispatch, on one GPU, from block s of every source's
    staging (concatenated in source order, [P * T] rows) and every source's send_counts row for
    this GPU ([P, EL + 1])."""
    p, t, k, h = plan.size, plan.tokens, plan.top_k, plan.hidden
    got_x, codes, got_w = got_x.reshape(p, t, h), got_meta.reshape(p, t, k), got_w.reshape(p, t, k)
    positions, kept, dropped = _routing.placement(counts, codes, plan.capacity, plan.local_experts)
    grouped = jnp.zeros((plan.capacity, h), got_x.dtype)
    for j in range(k):
        target = jnp.where(positions[:, :, j] >= 0, positions[:, :, j], plan.capacity).reshape(-1)
        grouped = grouped.at[target].set(got_x.reshape(p * t, h), mode="drop")
    weights_out = jnp.where(positions >= 0, got_w, 0.0)
    return grouped, positions, weights_out, kept, counts[:, plan.local_experts], dropped


def combine_reference(y, weights, positions, rows, route: SourceRoute, plan: Plan):
    del rows  # rows past a source's count have no positions
    back = _all_to_all(reference_partial_rows(y, weights, positions, plan), plan)
    return reference_sum_at_home(back, route, plan)


def reference_partial_rows(y, weights, positions, plan: Plan):
    """The reducing half of the reference combine, on one GPU: [P * T, H], block s holding one
    row per token of source s (its entries here, weighted, rounded like the kernel's rows)."""
    safe = jnp.maximum(positions, 0)
    picked = y[safe].astype(jnp.float32) * jnp.where(positions >= 0, weights, 0.0)[..., None]  # [P, T, K, H]
    partial = jnp.sum(picked, axis=2).astype(y.dtype)
    return partial.reshape(plan.size * plan.tokens, plan.hidden)


def reference_sum_at_home(back, route: SourceRoute, plan: Plan):
    """The home half of the reference combine: each token's rows from the GPUs it went to
    (block d of `back` from axis index d), summed in float32."""
    back = back.reshape(plan.size, plan.tokens, plan.hidden)
    slot = route.slot
    mine = back[jnp.arange(plan.size)[None, :], jnp.maximum(slot, 0)]  # [T, P, H]
    mine = jnp.where((slot >= 0)[..., None], mine.astype(jnp.float32), 0.0)
    return jnp.sum(mine, axis=1).astype(back.dtype)


# ---------------------------------------------------------------------------------------------
# GPU kernels.

# (tokens per block, hidden columns per step, warps, dispatch's sending programs per 8 SMs). Low
# latency: small blocks so a few hundred tokens still spread over many SMs, each program's rows in
# two wide steps of 8 warps (a step's loads wait in turn; combine is bound by that wait); high
# throughput: larger blocks for fewer, longer stores, and 3/8 of the SMs sending (NVLink-bound)
# while the rest place rows (HBM-bound), so neither kind of store waits behind the other.
_BLOCKS = {_routing.LOW_LATENCY: (2, 4096, 8, 4), _routing.HIGH_THROUGHPUT: (8, 1024, 8, 3)}
# combine's (tokens per block, hidden columns per step, warps), chosen apart from dispatch's by each
# kernel's device time: combine waits on its loads, so 16 warps keep more of them in flight, and
# low latency takes a token per item so that even one GPU's items outnumber the SMs.
_COMBINE_BLOCKS = {_routing.LOW_LATENCY: (1, 4096, 16), _routing.HIGH_THROUGHPUT: (8, 1024, 16)}
_ZERO_ROWS = 16


def _combine_blocks(plan: Plan) -> tuple[int, int, int]:
    """The mode's _COMBINE_BLOCKS preset; JAXGIN_MOE_BLOCKS overrides it as it does dispatch's."""
    if settings.get("JAXGIN_MOE_BLOCKS"):
        return _blocks(plan)[:3]
    return _COMBINE_BLOCKS[plan.mode]


def _blocks(plan: Plan) -> tuple[int, int, int, int]:
    """Dispatch's _BLOCKS preset for the mode. JAXGIN_MOE_BLOCKS="bt,bh,warps,senders" overrides it
    and combine's (benchmarks/moe.py --blocks compares settings with it)."""
    override = settings.get("JAXGIN_MOE_BLOCKS")
    if override:
        try:
            bt, bh, warps, senders = (int(v) for v in override.split(","))
            if not (bt > 0 and bh > 0 and warps > 0 and 0 < senders < 8):
                raise ValueError
        except ValueError:
            raise ValueError(
                f"JAXGIN_MOE_BLOCKS={override!r}: expected 'tokens,hidden,warps,senders' (positive ints, senders: "
                "dispatch's sending programs per 8 SMs, 1 to 7), e.g. '8,1024,8,2'"
            ) from None
        return bt, bh, warps, senders
    return _BLOCKS[plan.mode]


def _staged_row(plan: Plan, fp8: bool) -> tuple[int, str]:
    """(elements, dtype) of a row in dispatch's staging and send areas: x's, or fp8's packed words."""
    if fp8:
        return fp8_lib.packed_width(plan.hidden), jnp.dtype(fp8_lib.PACKED_DTYPE).name
    return plan.hidden, plan.dtype


def _buffers(state, plan: Plan, fp8: bool = False):
    """The heap buffers of one exchange configuration (op_support.placed): flags and counters start
    at zero on every GPU, as the kernels need. When the job has GIN peers, also the send areas GIN
    puts read from (a NIC reads only the heap), the relay areas where the sources of other hosts
    put what this GPU forwards to its host-mates (_kernels._forward_from_network), a data flag per
    source, and 3 signals per source: counts, data, combine. fp8: dispatch(fp8=True)'s own
    configuration, staging packed rows, with no combine buffers or signals (combine runs in x's
    configuration)."""
    from jaxgin.moe import _kernels  # needs Triton: only the kernels' lowering gets here

    gin = op_support.gin_in_job(state)
    per_host = _host_gpus(state, plan) if gin else 1
    key = ("moe_fp8" if fp8 else "moe", plan.names, plan.size, plan.tokens, plan.hidden, plan.top_k,
           plan.local_experts, plan.dtype, gin)

    def place():
        p, t, h, k, el = plan.size, plan.tokens, plan.hidden, plan.top_k, plan.local_experts
        sw, staged = _staged_row(plan, fp8)
        sym = lambda shape, dtype: op_support.heap_array(state, shape, dtype)  # noqa: E731
        buffers = dict(
            stage_x=sym((2, p, t, sw), staged), stage_meta=sym((2, p, t, k), np.int32),
            stage_w=sym((2, p, t, k), np.float32), stage_counts=sym((2, p, el + 1), np.int32),
            stage_starts=sym((2, p, t + 1), np.int32),
            dispatch_flags=sym((p,), np.int64), block_flags=sym((p, t), np.int64),
            dispatch_state=sym((_kernels.DISPATCH_STATE_WORDS,), np.int64),
        )
        if not fp8:
            buffers.update(back=sym((2, p, t, h), plan.dtype), combine_flags=sym((3 * p,), np.int64),
                           combine_state=sym((_kernels.COMBINE_STATE_WORDS + (2 + p) * gin,), np.int64))
        if gin:
            buffers.update(
                send_x=sym((2, p, t, sw), staged), send_meta=sym((2, p, t, k), np.int32),
                send_w=sym((2, p, t, k), np.float32), send_head=sym((2, p, el + 1), np.int32),
                send_starts=sym((2, p, t + 1), np.int32), data_ready=sym((p,), np.int64),
                signals=state.signals.allocate((2 if fp8 else 4) * p),
                send_slot=sym((2, p, t), np.int32), send_n=sym((2 * p,), np.int32),
                relay_x=sym((2, p, t, sw), staged), relay_meta=sym((2, p, per_host, t, k), np.int32),
                relay_w=sym((2, p, t, k), np.float32), relay_slot=sym((2, p, per_host, t), np.int32),
                relay_n=sym((2 * p,), np.int32),
            )
            if not fp8:
                buffers.update(send_back=sym((2, p, t, h), plan.dtype), send_union=sym((2, p, t, h), plan.dtype),
                               send_map=sym((2, p, _map_words(plan, per_host)), np.int32),
                               map_recv=sym((2, p, _map_words(plan, per_host)), np.int32))
        else:  # the kernels compile without their GIN paths and never touch these
            buffers.update(
                send_x=buffers["stage_x"], send_meta=buffers["stage_meta"], send_w=buffers["stage_w"],
                send_head=buffers["stage_counts"], send_starts=buffers["stage_starts"],
                data_ready=buffers["dispatch_flags"], signals=0,
                send_slot=buffers["stage_starts"], send_n=buffers["stage_starts"], relay_x=buffers["stage_x"],
                relay_meta=buffers["stage_meta"], relay_w=buffers["stage_w"], relay_slot=buffers["stage_starts"],
                relay_n=buffers["stage_starts"],
            )
            if not fp8:
                buffers.update(send_back=buffers["back"], send_union=buffers["back"], send_map=buffers["stage_starts"],
                               map_recv=buffers["stage_starts"])
        return buffers

    return op_support.placed(state, key, place), gin


def _host_gpus(state, plan: Plan) -> int:
    """The most GPUs of one host along the expert axis (bounded by the host size: the relay areas
    keep a row of metadata per GPU of this host)."""
    return min(plan.size, int(np.bincount(rank_hosts(state, DISPATCH)).max()))


def _map_words(plan: Plan, per_host: int) -> int:
    """int32 words of one union map (exchange._union_maps): a row count, then per union row the
    staging row on each GPU of the host."""
    return 1 + plan.tokens * per_host


def _union_maps(route: SourceRoute, hslot, hrows, axis_hosts, me, per_host: int):
    """int32 [P, _map_words]: for each other host, under its network entry's axis index e for this
    GPU (jaxgin.hosts), what combine tells e: the union's row count hrows[e], then for each union
    row u and each GPU of that host (by its place there) the token's staging row on that GPU (-1:
    none), rows u * per_host .. . Rows of other axis indices are unused."""
    p = axis_hosts.shape[0]
    t = route.slot.shape[0]
    same = axis_hosts[:, None] == axis_hosts[None, :]  # [P, P]
    place = jnp.sum(jnp.tril(same, -1), axis=1)  # each index's place among its host's indices
    size = jnp.sum(same, axis=1)
    # entry[d]: the index of d's host whose place is this GPU's place modulo that host's size
    entry = jnp.argmax(same & (place[None, :] == (place[me] % size)[:, None]), axis=1)
    e = jnp.broadcast_to(entry[None, :], (t, p))
    u = jnp.where(hslot >= 0, hslot, t)  # rows of hosts a token does not go to fall off the end
    cols = jnp.broadcast_to(place[None, :], (t, p))
    maps = jnp.full((p, t + 1, per_host), -1, jnp.int32).at[e, u, cols].set(route.slot, mode="drop")[:, :t]
    return jnp.concatenate([hrows[entry][:, None], maps.reshape(p, t * per_host)], axis=1)


def _host_unions(state, route: SourceRoute, axis):
    """What dispatch and combine across hosts take beside the routing: (int32 [world] constant,
    each rank's host, which the kernels look up their axis peers' in; the host of each axis index;
    _routing.host_union's hslot and hrows for route's slots). axis: axis_route's array."""
    hosts = jnp.asarray(rank_hosts(state, DISPATCH))
    axis_hosts = hosts[axis[1:]]
    return (hosts, axis_hosts, *_routing.host_union(route.slot, axis_hosts))


def _sms(state) -> int:
    return op_support.sm_count(state.local_devices[0])


def _grid(state, items: int) -> int:
    """At most one program per SM: programs loop over their work items, so more would only wait
    for an SM (see _kernels.py)."""
    return max(1, min(_sms(state), items))


def _dispatch_grid(state, plan: Plan, blocks: int, senders_per_8: int, counting: bool = False) -> tuple[int, int]:
    """(programs, of which senders): dispatch's senders get senders_per_8 / 8 of the SMs (none with
    one GPU), its placers the rest, each no more than their work items; at most one per SM.
    counting: the routing kernel's first sender only posts the counts (one more sender)."""
    sms = _sms(state)
    senders = 0 if plan.size == 1 else max(1, min(blocks, sms * senders_per_8 // 8)) + int(counting)
    placers = max(1, min(sms - senders, max(blocks, -(-plan.capacity // _ZERO_ROWS))))
    return senders + placers, senders


def dispatch_kernel(state, x, weights, route: SourceRoute, plan: Plan, fp8: bool = False, trace: bool = False):
    """dispatch on GPUs along a routing made before (route()'s arrays); fp8: rows cross as e4m3
    values and scales, quantized as the kernel stages them and dequantized as it places them (the
    result is fp8.rounded(x)'s rows); trace: also the records of _kernels.dispatch_traced_kernel,
    int32 [programs, 16], last."""
    op_support.require_tritongin(DISPATCH)
    from jaxgin.moe import _kernels  # needs Triton (optional: GPU lowering only)

    launch = _dispatch_launch(state, plan, fp8)
    buf = launch.pop("buffers")
    axis = axis_route(plan.names)
    if launch["GIN"]:  # each token once per other host (_routing.host_union)
        hosts, _, hslot, hrows = _host_unions(state, route, axis)
    else:
        hosts, hslot, hrows = (jnp.zeros((1,), jnp.int32),) * 3
    records = [jax.core.ShapedArray((launch["grid"][0], 16), jnp.int32)] if trace else []
    outs = triton_call(
        _kernels.dispatch_traced_kernel if trace else _kernels.dispatch_kernel,
        x, route.slot, route.before, route.meta, weights, route.send_counts,
        axis, hslot, hrows, hosts, *buf, out_shape=[*_dispatch_outputs(plan, x.dtype), *records], **launch,
        pure=True,
    )
    grouped, positions, weights_out, counts, rows, dropped = outs[:6]
    return grouped, positions, weights_out, counts, rows, dropped.reshape(()), *outs[6:]


def _dispatch_outputs(plan: Plan, dtype) -> list:
    """The dispatch kernels' first outputs: grouped rows, positions, weights, expert counts, rows per
    source, dropped entries."""
    p, t, h, k, el, c = plan.size, plan.tokens, plan.hidden, plan.top_k, plan.local_experts, plan.capacity
    return [
        jax.core.ShapedArray((c, h), dtype), jax.core.ShapedArray((p, t, k), jnp.int32),
        jax.core.ShapedArray((p, t, k), jnp.float32), jax.core.ShapedArray((el,), jnp.int32),
        jax.core.ShapedArray((p,), jnp.int32), jax.core.ShapedArray((1,), jnp.int32),
    ]


def _dispatch_launch(state, plan: Plan, fp8: bool, routing: bool = False) -> dict:
    """What both dispatch kernels launch with: the heap buffers in their argument order ("buffers"),
    the grid, warps and compile-time parameters (routing: the kernel that routes, _dispatch_grid's
    counting)."""
    p, t, h, k, el, c = plan.size, plan.tokens, plan.hidden, plan.top_k, plan.local_experts, plan.capacity
    bt, bh, warps, senders_per_8 = _blocks(plan)
    bh = min(bh, pow2(h))
    if fp8:
        bh = max(bh, fp8_lib.BLOCK)  # whole scale blocks per step
    buf, gin = _buffers(state, plan, fp8)
    sw, staged = _staged_row(plan, fp8)
    programs, senders = _dispatch_grid(state, plan, -(-t // bt), senders_per_8, counting=routing)
    names = ("stage_x", "stage_meta", "stage_w", "stage_counts", "stage_starts", "dispatch_flags", "block_flags",
             "dispatch_state", "send_x", "send_meta", "send_w", "send_head", "send_starts", "data_ready", "signals",
             "send_slot", "send_n", "relay_x", "relay_meta", "relay_w", "relay_slot", "relay_n")
    return dict(
        buffers=[buf[name] for name in names], grid=(programs,),
        num_warps=warps, num_stages=1, enable_fp_fusion=OWN_KERNELS_FP_FUSION,
        T=t, H=h, K=k, P=p, EL=el, C=c, BT=bt, BH=bh, BK=pow2(k), BP=pow2(p), BE=pow2(el + 1), BZ=_ZERO_ROWS,
        BB=pow2(-(-t // bt) + 1), NS=senders, XB=jnp.dtype(staged).itemsize, GIN=int(gin), SW=sw, FP8=int(fp8),
        L=_host_gpus(state, plan) if gin else 1,
    )


def routes_in_kernel(state, plan: Plan) -> bool:
    """Whether dispatch on GPUs routes inside its own kernel (dispatch_routing_kernel): up to
    LOW_LATENCY_MAX_TOKENS tokens per GPU, in a job without GIN peers."""
    return plan.tokens <= _routing.LOW_LATENCY_MAX_TOKENS and not op_support.gin_in_job(state)


def dispatch_routing_kernel(state, x, weights, topk_ids, plan: Plan, fp8: bool = False, trace: bool = False):
    """dispatch on GPUs from the ids: up to LOW_LATENCY_MAX_TOKENS tokens per GPU one kernel that
    routes as it goes (_kernels.dispatch_routing_kernel); above them (routing inside the dispatch
    kernel grows with the square of the tokens), and with GIN peers (their host unions need
    route()'s slots), route()'s arrays from the routing kernels (_routing_device.route_alone) then
    dispatch_kernel. Returns dispatch_kernel's arrays, then route()'s (SourceRoute, masked
    entries); with `trace` also the kernel's records, int32 [programs, 16]
    (dispatch_routing_traced_kernel, dispatch_traced_kernel)."""
    op_support.require_tritongin(DISPATCH)
    from jaxgin.moe import _kernels, _routing_device  # need Triton (optional: GPU lowering only)

    if not routes_in_kernel(state, plan):
        route, masked = _routing_device.route_alone(topk_ids, plan)
        grouped, positions, weights_out, counts, rows, dropped, *records = dispatch_kernel(
            state, x, weights, route, plan, fp8, trace)
        return (grouped, positions, weights_out, counts, rows, dropped, route, masked, *records)
    p, t, k, el = plan.size, plan.tokens, plan.top_k, plan.local_experts
    launch = _dispatch_launch(state, plan, fp8, routing=True)
    buf = launch.pop("buffers")
    i32 = lambda *shape: jax.core.ShapedArray(shape, jnp.int32)  # noqa: E731
    routing = _routing_device.constexprs(t, k, p, el)
    outs = triton_call(
        _kernels.dispatch_routing_traced_kernel if trace else _kernels.dispatch_routing_kernel,
        x, topk_ids, weights, axis_route(plan.names), *buf,
        out_shape=[*_dispatch_outputs(plan, x.dtype),
                   i32(t, p), i32(t, p), i32(t, p, k), i32(t, k), i32(p, el + 1), i32(1),
                   *([i32(launch["grid"][0], 16)] if trace else [])],
        SCAN=routing["SCAN"], BR=routing["BE"], **launch,
        pure=True,
    )
    grouped, positions, weights_out, counts, rows, dropped, slot, before, meta, dest, send_counts, masked = outs[:12]
    return (grouped, positions, weights_out, counts, rows, dropped.reshape(()),
            SourceRoute(slot, before, meta, dest, send_counts), masked.reshape(()), *outs[12:])


def combine_kernel(state, y, weights, positions, rows, route: SourceRoute, plan: Plan):
    op_support.require_tritongin(COMBINE)
    from jaxgin.moe import _kernels  # needs Triton (optional: GPU lowering only)

    p, t, h, k = plan.size, plan.tokens, plan.hidden, plan.top_k
    bt, bh, warps = _combine_blocks(plan)
    bh = min(bh, pow2(h))
    buf, gin = _buffers(state, plan)
    axis = axis_route(plan.names)
    per_host = _host_gpus(state, plan) if gin else 1
    if gin:  # rows come back once per other host: where each host's GPUs keep their partials
        hosts, axis_hosts, hslot, hrows = _host_unions(state, route, axis)
        union_map = _union_maps(route, hslot, hrows, axis_hosts, axis[0], per_host)
    else:
        hosts, hslot, union_map = (jnp.zeros((1,), jnp.int32),) * 3
    return triton_call(
        _kernels.combine_kernel, y, weights, positions, rows, route.slot, axis, hslot, hosts, union_map,
        buf["back"], buf["combine_flags"], buf["combine_state"], buf["send_back"], buf["send_union"],
        buf["send_map"], buf["map_recv"], buf["signals"] + 2 * p * gin,
        grid=(_grid(state, p * -(-t // bt)),), out_shape=jax.core.ShapedArray((t, h), y.dtype),
        num_warps=warps, num_stages=1, enable_fp_fusion=OWN_KERNELS_FP_FUSION,
        T=t, H=h, K=k, P=p, BT=bt, BH=bh, BK=pow2(k), BP=pow2(p), XB=jnp.dtype(plan.dtype).itemsize, GIN=int(gin),
        L=per_host, MW=_map_words(plan, per_host),
        pure=True,
    )


# ---------------------------------------------------------------------------------------------
# The differentiable ops (one custom_vjp each, for both modes).


_dispatch_forward = op_support.by_backend(dispatch_reference, dispatch_kernel)
_combine_forward = op_support.by_backend(combine_reference, combine_kernel)


def _routed_dispatch_op(reference, kernel):
    """dispatch from the ids as a custom_vjp op (the plan its last, static, argument): `kernel` on
    GPUs, else route() then `reference`; both return dispatch's arrays, then the routing made
    (SourceRoute, masked entries), which the backward (_dispatch_bwd) keeps with positions and rows."""

    def routed_reference(x, weights, topk_ids, plan):
        route, masked = _routing.route(topk_ids, plan)
        return (*reference(x, weights, route, plan), route, masked)

    forward = op_support.by_backend(routed_reference, kernel)

    def fwd(x, weights, topk_ids, plan):
        out = forward(x, weights, topk_ids, plan)
        return out, (out[6], out[1], out[4])

    op = jax.custom_vjp(forward, nondiff_argnums=(3,))
    op.defvjp(fwd, _dispatch_bwd)
    return op


def _dispatch_bwd(plan, saved, cts):
    route, positions, rows = saved
    ct_x, _, ct_w = cts[0], cts[1], cts[2]
    landed = positions >= 0
    # x: each of a token's landed entries contributes its row's cotangent: a combine with weight 1.
    dx = _combine_forward(ct_x, landed.astype(jnp.float32), positions, rows, route, plan)
    # weights: entry (s, r, k)'s cotangent goes home to source s, row r. A masked entry (dest -1)
    # went nowhere and gets 0: the row it would read belongs to another token, or to none.
    home = _exchange_back(jnp.where(landed, ct_w, 0.0), plan)  # [P GPUs, T rows, K]
    sent = route.dest >= 0
    dest = jnp.maximum(route.dest, 0)
    rows_at = jnp.take_along_axis(route.slot, dest, axis=1)  # [T, K]: the token's row on its entry's GPU
    dw = home[dest, jnp.maximum(rows_at, 0), jnp.arange(plan.top_k)[None, :]]
    return dx, jnp.where(sent, dw, 0.0), None


def _exchange_back(a, plan):
    p, t, k = plan.size, plan.tokens, plan.top_k
    return all_to_all(a.reshape(p * t, k), plan.names, 0, 0, tiled=True).reshape(p, t, k)


def _combine_fwd(y, weights, positions, rows, route, plan):
    out = _combine_forward(y, weights, positions, rows, route, plan)
    return out, (y, weights, positions, route)


def _combine_bwd(plan, saved, ct):
    y, weights, positions, route = saved
    # The output cotangent of every token goes to each row its entries landed at (a dispatch with
    # the same routing reproduces the same layout).
    spread = _dispatch_forward(ct, jnp.zeros((plan.tokens, plan.top_k), jnp.float32), route, plan)[0]
    spread = spread.astype(jnp.float32)
    target = jnp.where(positions >= 0, positions, plan.capacity).reshape(-1)
    row_weight = jnp.zeros((plan.capacity,), jnp.float32).at[target].add(weights.reshape(-1), mode="drop")
    dy = (row_weight[:, None] * spread).astype(y.dtype)
    per_row = jnp.sum(spread * y.astype(jnp.float32), axis=1)
    dw = jnp.where(positions >= 0, per_row[jnp.maximum(positions, 0)], 0.0)
    return dy, dw, None, None, None


def dispatch_fp8_reference(x, weights, route: SourceRoute, plan: Plan):
    """dispatch_reference of x's fp8 rows, packed (fp8.pack: a plan of their own width and dtype),
    returned dequantized in x's layout."""
    packed = dataclasses.replace(plan, hidden=fp8_lib.packed_width(plan.hidden),
                                 dtype=jnp.dtype(fp8_lib.PACKED_DTYPE).name)
    grouped, *rest = dispatch_reference(fp8_lib.pack(*fp8_lib.quantize(x)), weights, route, packed)
    return (fp8_lib.dequantize(*fp8_lib.unpack(grouped, plan.hidden), x.dtype), *rest)


def dispatch_fp8_routing_kernel(state, x, weights, topk_ids, plan: Plan):
    return dispatch_routing_kernel(state, x, weights, topk_ids, plan, fp8=True)


# The plan (static, hashable) is the last argument of each op; the integer arrays get no cotangent.
_routed_dispatch = _routed_dispatch_op(dispatch_reference, dispatch_routing_kernel)
_combine = jax.custom_vjp(_combine_forward, nondiff_argnums=(5,))
_combine.defvjp(_combine_fwd, _combine_bwd)
# backward through the rounding as if it were not there
_routed_dispatch_fp8 = _routed_dispatch_op(dispatch_fp8_reference, dispatch_fp8_routing_kernel)
