"""Where every token goes and where it lands: the routing arithmetic dispatch and combine share.

Source side (plain JAX, before any communication): token t is sent once to every GPU d that owns
one of its experts, into row slot[t, d] of the staging area this GPU has on d (rows in token
order). With it travel, per top-k entry, a code (local expert e + EL * rank, or -1 where the entry's
expert is on another GPU) and the routing weight. rank is the entry's position among this GPU's
entries for the same expert, in (token, k) order, so the receiver can place it without talking to
anyone else. send_counts[d] = entries per local expert of d, then the number of tokens sent to d.

Receiver side: entries are grouped by local expert, within an expert by source GPU, within a
source by rank. With pairs[s, e] = entries from s for e:
    position = base[e] + sum(pairs[:s, e]) + rank,  base[e] = sum over e' < e of all entries for e'
Entries at or past the capacity C are dropped and counted; expert_counts are what was kept.
The kernels (_kernels.py) and the reference (exchange.py) both place by these formulas.
_routing_device.py computes route()'s arrays in one Triton kernel (GPUs, up to 256 tokens).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import jax
import jax.numpy as jnp
import numpy as np

LOW_LATENCY = "low_latency"
HIGH_THROUGHPUT = "high_throughput"
MODES = (LOW_LATENCY, HIGH_THROUGHPUT)
LOW_LATENCY_MAX_TOKENS = 256  # mode="auto" picks low_latency up to this many tokens per GPU


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static description of one dispatch/combine configuration (hashable: part of the traced op)."""

    names: tuple[Hashable, ...]
    size: int  # P, GPUs along the expert axis
    tokens: int  # T per GPU
    hidden: int  # H
    top_k: int  # K
    local_experts: int  # EL = num_experts // P
    capacity: int  # C, rows of the expert-grouped output
    dtype: str
    mode: str

    @property
    def num_experts(self) -> int:
        return self.size * self.local_experts


@dataclasses.dataclass(frozen=True)
class SourceRoute:
    """Source-side routing of one dispatch (arrays, computed by route())."""

    slot: jax.Array  # int32 [T, P]: staging row on GPU d, -1 where token t does not go to d
    before: jax.Array  # int32 [T, P]: tokens before t that go to GPU d (slot where t goes there too)
    meta: jax.Array  # int32 [T, P, K]: code of entry k for GPU d, -1 where its expert is elsewhere
    dest: jax.Array  # int32 [T, K]: GPU of entry k's expert, -1 where the entry is masked (id outside [0, E))
    send_counts: jax.Array  # int32 [P, EL + 1]: entries per local expert of d, then tokens sent to d


jax.tree_util.register_dataclass(SourceRoute, data_fields=["slot", "before", "meta", "dest", "send_counts"], meta_fields=[])


# Rows of one block in the prefix counts below: the work is (entries x _BLOCK) comparisons, all
# fused by XLA into a few elementwise-reduce kernels (no sort, no scatter).
_BLOCK = 256


def _exclusive_prefix(a):
    """int32 [N, C] -> out[i, c] = sum over j < i of a[j, c]. Blocked: within a block by a
    lower-triangular masked sum, across blocks by a cumsum of block totals (N / _BLOCK rows)."""
    n, c = a.shape
    nb = -(-n // _BLOCK)
    blocks = jnp.pad(a, ((0, nb * _BLOCK - n), (0, 0))).reshape(nb, _BLOCK, c)
    totals = jnp.sum(blocks, axis=1)
    before = jnp.cumsum(totals, axis=0) - totals
    earlier = jnp.tril(jnp.ones((_BLOCK, _BLOCK), bool), -1)  # [i, j]: j comes before i
    within = jnp.sum(jnp.where(earlier[None, :, :, None], blocks[:, None, :, :], 0), axis=2, dtype=jnp.int32)
    return (before[:, None, :] + within).reshape(nb * _BLOCK, c)[:n]


def _rank_among_equal(keys, bins: int):
    """keys int32 [N] in [0, bins) -> (rank[i] = number of j < i with keys[j] == keys[i],
    totals[b] = number of keys equal to b). Blocked like _exclusive_prefix, with per-block
    histograms instead of one-hot prefix sums (N x bins would not fit the within-block form)."""
    n = keys.shape[0]
    nb = -(-n // _BLOCK)
    blocks = jnp.pad(keys, (0, nb * _BLOCK - n), constant_values=bins).reshape(nb, _BLOCK)  # pad: no bin
    hist = jnp.sum(blocks[:, :, None] == jnp.arange(bins, dtype=jnp.int32), axis=1, dtype=jnp.int32)  # [nb, bins]
    before = jnp.cumsum(hist, axis=0) - hist
    earlier = jnp.tril(jnp.ones((_BLOCK, _BLOCK), bool), -1)
    within = jnp.sum((blocks[:, :, None] == blocks[:, None, :]) & earlier[None], axis=2, dtype=jnp.int32)
    rank = jnp.take_along_axis(before, jnp.minimum(blocks, bins - 1), axis=1) + within
    return rank.reshape(-1)[:n], jnp.sum(hist, axis=0)


def route(topk_ids, plan: Plan) -> tuple[SourceRoute, jax.Array]:
    """(routing, masked entries: those with an expert id outside [0, num_experts), such as -1; they
    are not sent anywhere, have dest -1, and are reported as dropped)."""
    t, k, p, el = plan.tokens, plan.top_k, plan.size, plan.local_experts
    ids = topk_ids.astype(jnp.int32)
    valid = (ids >= 0) & (ids < plan.num_experts)
    ids = jnp.where(valid, ids, plan.num_experts)  # a bin past the last expert, owned by no GPU
    dest, local = jnp.where(valid, ids // el, -1), ids % el
    goes = jnp.any(dest[:, :, None] == jnp.arange(p, dtype=jnp.int32), axis=1)  # [T, P]
    before = _exclusive_prefix(goes.astype(jnp.int32))
    slot = jnp.where(goes, before, -1)
    # rank of each entry among this GPU's entries for the same expert, in (token, k) order
    rank, per_expert = _rank_among_equal(ids.reshape(-1), plan.num_experts + 1)
    code = local + el * rank.reshape(t, k)
    meta = jnp.where(dest[:, None, :] == jnp.arange(p, dtype=jnp.int32)[None, :, None], code[:, None, :], -1)
    send_counts = jnp.concatenate(
        [per_expert[:-1].reshape(p, el), jnp.sum(goes, axis=0, dtype=jnp.int32)[:, None]], axis=1
    )
    return SourceRoute(slot, before, meta, dest, send_counts), per_expert[-1]


def host_union(slot, axis_hosts):
    """Dispatch across hosts sends a token once per other host (jaxgin.hosts). slot: route()'s
    [T, P]; axis_hosts: int32 [P], the host of each axis index. Returns (hslot [T, P]: the token's
    row in the union of what goes to d's host, in token order, -1 where it goes to no GPU there;
    hrows [P]: rows of that union)."""
    same = axis_hosts[:, None] == axis_hosts[None, :]  # [P, P]
    goes_host = jnp.any((slot >= 0)[:, None, :] & same[None, :, :], axis=2)  # [T, P]
    hslot = jnp.where(goes_host, _exclusive_prefix(goes_host.astype(jnp.int32)), -1)
    return hslot.astype(jnp.int32), jnp.sum(goes_host, axis=0, dtype=jnp.int32)


def placement(counts, codes, capacity: int, local_experts: int):
    """Receiver-side layout. counts: int32 [P, EL + 1] received from each source (send_counts
    rows); codes: int32 [P, T, K] received codes (-1: none). Returns (positions [P, T, K], -1 where
    nothing lands; expert_counts [EL]; dropped entries ())."""
    el = local_experts
    pairs = counts[:, :el]
    total = jnp.sum(pairs, axis=0)
    base = jnp.cumsum(total) - total
    before_source = jnp.cumsum(pairs, axis=0) - pairs  # [P, EL]
    e = jnp.where(codes >= 0, codes % el, 0)
    rank = codes // el
    sources = jnp.arange(codes.shape[0])[:, None, None]
    position = base[e] + before_source[sources, e] + rank
    position = jnp.where((codes >= 0) & (position < capacity), position, -1)
    kept = jnp.clip(capacity - base, 0, total).astype(jnp.int32)
    return position.astype(jnp.int32), kept, (jnp.sum(total) - jnp.sum(kept)).astype(jnp.int32)


def worst_case_capacity(plan_size: int, tokens: int, top_k: int, local_experts: int) -> int:
    """Rows the expert-grouped output needs when every entry of every GPU lands here."""
    return plan_size * tokens * min(top_k, local_experts)


def check_inputs(op: str, x, topk_ids, topk_weights):
    x, topk_ids, topk_weights = jnp.asarray(x), jnp.asarray(topk_ids), jnp.asarray(topk_weights)
    if x.ndim != 2:
        raise ValueError(f"{op}: x must be [tokens, hidden], got shape {list(x.shape)}")
    if x.dtype.name not in ("bfloat16", "float16", "float32"):
        raise TypeError(f"{op}: x has dtype {x.dtype.name}; supported: bfloat16, float16, float32")
    if topk_ids.ndim != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"{op}: topk_ids must be [tokens, top_k] with tokens = x.shape[0] = {x.shape[0]}, got shape "
            f"{list(topk_ids.shape)}"
        )
    if not jnp.issubdtype(topk_ids.dtype, jnp.integer):
        raise TypeError(f"{op}: topk_ids must be integers (expert ids), got {topk_ids.dtype.name}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"{op}: topk_weights has shape {list(topk_weights.shape)} but topk_ids has {list(topk_ids.shape)}; "
            "they must match (one weight per chosen expert)"
        )
    if not jnp.issubdtype(topk_weights.dtype, jnp.floating):
        raise TypeError(f"{op}: topk_weights must be floating point, got {topk_weights.dtype.name}")
    return x, topk_ids, topk_weights


def make_plan(op, names, size, x, topk_ids, num_experts, capacity, mode) -> Plan:
    if not isinstance(num_experts, (int, np.integer)) or isinstance(num_experts, bool) or num_experts <= 0:
        raise TypeError(f"{op}: num_experts must be a positive int, got {num_experts!r}")
    if num_experts % size:
        raise ValueError(
            f"{op}: num_experts={num_experts} must be a multiple of the expert axis size {size} (each GPU holds "
            f"num_experts / {size} experts)"
        )
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    local = num_experts // size
    if top_k < 1:
        raise ValueError(f"{op}: topk_ids has top_k = 0 columns; route each token to at least one expert")
    worst = worst_case_capacity(size, tokens, top_k, local)
    if capacity is None:
        capacity = max(worst, 1)
    elif not isinstance(capacity, (int, np.integer)) or isinstance(capacity, bool) or capacity < 1:
        raise ValueError(f"{op}: capacity must be a positive int (rows of the expert-grouped output), got {capacity!r}")
    if tokens * local >= 2**31 or size * tokens * top_k >= 2**31:
        raise ValueError(f"{op}: {tokens} tokens x {local} local experts overflow the int32 routing codes")
    if mode == "auto":
        mode = LOW_LATENCY if tokens <= LOW_LATENCY_MAX_TOKENS else HIGH_THROUGHPUT
    elif mode not in MODES:
        raise ValueError(f"{op}: mode must be 'auto', {MODES[0]!r} or {MODES[1]!r}, got {mode!r}")
    return Plan(tuple(names), size, tokens, hidden, top_k, local, int(capacity), x.dtype.name, mode)
