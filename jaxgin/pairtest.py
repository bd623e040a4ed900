"""``python -m jaxgin.pairtest``: every pair of ranks of a job, both ways, over the path that pair
really takes (LSA: NVLink stores within a host; GIN across hosts), with latency and bandwidth per
pair, naming the slow or failing host. Start it like any program of the job, one process per host
or per GPU:

    python -m jaxgin.launch [job options] -m jaxgin.pairtest [--json] [--out FILE]
    srun python3 -m jaxgin.launch -m jaxgin.pairtest          # inside a SLURM allocation

Pairs run one at a time, the other ranks putting to themselves meanwhile. A pair's two ranks put
a block to each other and each waits for the other's (``jaxgin.put_signal`` /
``jaxgin.wait_signal_from``, peers chosen at run time, so one program serves every pair), in a
loop inside one jitted program, every received word checked on the device: ``latency`` is the
time of one such exchange of --latency-bytes, ``bandwidth`` the bytes each way per second of one
of --bandwidth-bytes. A pair slower than --slow-fraction of the best quarter of its path's pairs
is slow; a rank or host is named when most of its pairs are. A pair that faults (a wait timed
out: JAXGIN_TIMEOUT) or delivers wrong words fails, naming both ranks and hosts, and the job stops
there (a fault leaves the GPU unusable). A rank's host is NCCL_HOSTID where set (what NCCL takes
for the host's identity), else its host name.

Exit status: 0 every pair passed; 5 (``cli.EXIT_DEGRADED``) some are slow; 6
(``cli.EXIT_NOT_READY``) a pair failed. Process 0 prints the report. In reference mode (no GPUs),
and when several ranks share a GPU (emulated hosts), the times are no measure of a link: pass
--slow-fraction 0 there to judge correctness only.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import socket
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import distributed
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxgin
from jaxgin import cli, sizes

AXIS = "ranks"
# Seconds a process waits for the others' report of a pair beyond JAXGIN_TIMEOUT (the longest a
# faulting pair takes to say so) before it names the silent ones.
REPORT_GRACE_S = 120.0
_runs = itertools.count()


@dataclasses.dataclass(frozen=True)
class Pair:
    a: int
    b: int
    path: str  # 'lsa', 'gin' or 'reference'
    latency_us: float | None = None  # one exchange of the latency block, both ways at once
    bandwidth_gbs: float | None = None  # bytes each way per second (1e9), exchanging the bandwidth block
    wrong_words: int = 0
    error: str = ""
    slow: bool = False

    @property
    def failed(self) -> bool:
        return bool(self.error) or self.wrong_words > 0


@dataclasses.dataclass(frozen=True)
class Report:
    hosts: list[str]  # per rank
    pairs: list[Pair]
    slow_ranks: list[int]
    slow_hosts: list[str]
    verdict: str  # 'ready', 'degraded' or 'not ready', as jaxgin.doctor's
    summary: str
    settings: dict

    @property
    def exit_status(self) -> int:
        return {"ready": 0, "degraded": cli.EXIT_DEGRADED, "not ready": cli.EXIT_NOT_READY}[self.verdict]

    def to_json(self) -> dict:
        return {"verdict": self.verdict, "exit_status": self.exit_status, "summary": self.summary,
                "hosts": self.hosts, "slow_ranks": self.slow_ranks, "slow_hosts": self.slow_hosts,
                "settings": self.settings, "pairs": [dataclasses.asdict(p) for p in self.pairs]}


def judge(pairs: list[Pair], hosts: list[str], slow_fraction: float) -> tuple[list[Pair], list[int], list[str]]:
    """Marks the slow pairs, per path, against the best quarter of that path's pairs (bandwidth
    below `slow_fraction` of its 75th percentile, or latency above its 25th percentile divided by
    `slow_fraction`; 0 judges nothing), and names the ranks and hosts most of whose pairs of a path
    are slow. Returns (pairs, slow ranks, slow hosts)."""
    if slow_fraction <= 0:
        return pairs, [], []
    marked = list(pairs)
    for path in sorted({p.path for p in pairs}):
        measured = [i for i, p in enumerate(marked) if p.path == path and not p.failed and p.latency_us is not None]
        if len(measured) < 2:
            continue
        best_bandwidth = np.percentile([marked[i].bandwidth_gbs for i in measured], 75)
        best_latency = np.percentile([marked[i].latency_us for i in measured], 25)
        for i in measured:
            p = marked[i]
            if p.bandwidth_gbs < slow_fraction * best_bandwidth or p.latency_us * slow_fraction > best_latency:
                marked[i] = dataclasses.replace(p, slow=True)

    def most_slow(members) -> bool:
        mine = [p for p in marked if not p.failed and p.latency_us is not None and members(p)]
        by_path = {path: [p for p in mine if p.path == path] for path in {p.path for p in mine}}
        return any(len(ps) >= 2 and 2 * sum(p.slow for p in ps) > len(ps) for ps in by_path.values())

    slow_ranks = [r for r in range(len(hosts)) if most_slow(lambda p, r=r: r in (p.a, p.b))]
    slow_hosts = [h for h in dict.fromkeys(hosts) if most_slow(lambda p, h=h: h in (hosts[p.a], hosts[p.b]))]
    return marked, slow_ranks, slow_hosts


def verdict(pairs: list[Pair], hosts: list[str], slow_ranks: list[int], slow_hosts: list[str]) -> tuple[str, str]:
    """(verdict, summary in words)."""
    failed = [p for p in pairs if p.failed]
    if failed:
        p = failed[0]
        why = p.error.splitlines()[0] if p.error else f"{p.wrong_words} wrong words"
        return "not ready", (f"the pair of ranks {p.a} ({hosts[p.a]}) and {p.b} ({hosts[p.b]}) over {p.path} failed: "
                             f"{why}")
    slow = [p for p in pairs if p.slow]
    if slow:
        named = ", ".join([f"host {h}" for h in slow_hosts] + [f"rank {r} ({hosts[r]})" for r in slow_ranks])
        pairs_text = ", ".join(f"{p.a}<->{p.b}" for p in slow)
        return "degraded", f"slow pairs {pairs_text}" + (f"; most pairs of {named} are slow" if named else "")
    return "ready", f"all {len(pairs)} pairs passed"


def _paths(info: dict, hosts: list[str], lsa: dict[int, tuple[int, int]]) -> dict[tuple[int, int], str]:
    """The path of each pair: what the kernels choose (csrc/device/impl/transport__funcs.h: a peer is
    an LSA peer when it falls in this rank's LSA team, a contiguous range of ranks)."""
    world = len(hosts)
    if info["backend"] == "reference":
        return {(a, b): "reference" for a in range(world) for b in range(a + 1, world)}
    paths = {}
    for a in range(world):
        lsa_rank, lsa_size = lsa[a]
        for b in range(a + 1, world):
            in_team = 0 <= lsa_rank + (b - a) < lsa_size
            paths[a, b] = "lsa" if in_team and not info["force_gin"] else "gin"
    return paths


def _stamp(words: int, sender, i):
    """What `sender` puts in exchange `i`: a different word everywhere, every pair and round."""
    base = jnp.arange(words, dtype=jnp.uint32) * jnp.uint32(2654435761)
    return base + sender.astype(jnp.uint32) * jnp.uint32(40503) + i.astype(jnp.uint32) * jnp.uint32(977)


def _exchange(mesh: Mesh, box: jaxgin.Mailbox, iterations: int):
    """The jitted program: each rank puts to its partner (itself when idle) and waits for the
    partner's put, `iterations` times; returns the wrong words each rank received."""
    words = box.shape[0]

    def body(partner):
        me = jax.lax.axis_index(AXIS)
        peer = partner[0]

        def step(i, wrong):
            token = jaxgin.put_signal(_stamp(words, me, i), box, peer=peer, axis_name=AXIS)
            got = jaxgin.wait_signal_from(box, peer, axis_name=AXIS, after=token)
            return wrong + jnp.sum(got != _stamp(words, peer, i)).astype(jnp.int32)

        start = jax.lax.pcast(jnp.int32(0), AXIS, to="varying")
        return jax.lax.fori_loop(0, iterations, step, start)[None]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))


class _Job:
    """What the processes share: barriers and reports through jax.distributed's key-value store."""

    def __init__(self, timeout_s: float):
        self.client = distributed.global_state.client
        self.processes = jax.process_count()
        self.me = jax.process_index()
        self.prefix = f"jaxgin/pairtest/{next(_runs)}"
        self.timeout_ms = int(timeout_s * 1000)

    def barrier(self, name: str) -> None:
        if self.client is not None:
            self.client.wait_at_barrier(f"{self.prefix}/{name}", self.timeout_ms)

    def share(self, name: str, mine: dict) -> list[dict]:
        """Every process's `mine` for `name`; a process silent past the timeout reads as
        {'silent': error}."""
        if self.client is None:
            return [mine]
        self.client.key_value_set(f"{self.prefix}/{name}/{self.me}", json.dumps(mine))
        found = []
        for process in range(self.processes):
            try:
                found.append(json.loads(self.client.blocking_key_value_get(f"{self.prefix}/{name}/{process}",
                                                                           self.timeout_ms)))
            except Exception as e:  # the coordination service's timeout or a dead peer: say which process
                found.append({"silent": f"process {process} did not report within {self.timeout_ms // 1000} s "
                                        f"({type(e).__name__}): it died or hangs"})
        return found


def run(*, latency_bytes: int = 8, bandwidth_bytes: int = 4 << 20, latency_iterations: int = 50,
        bandwidth_iterations: int = 10, slow_fraction: float = 0.5) -> Report:
    """Runs the pair test on every device of the job; jaxgin must be initialized. Every process
    calls it with the same arguments."""
    for name, value in (("latency_bytes", latency_bytes), ("bandwidth_bytes", bandwidth_bytes)):
        if value < 8 or value % 4:
            raise ValueError(f"{name}={value}: a positive multiple of 4 bytes, at least 8")
    devices = jax.devices()
    world = len(devices)
    mesh = Mesh(np.array(devices), (AXIS,))
    info = jaxgin.info()
    job = _Job(info["timeout_s"] + REPORT_GRACE_S)
    host = os.environ.get("NCCL_HOSTID") or socket.gethostname()
    local = {d["rank"]: (d.get("lsa_rank", 0), d.get("lsa_size", 1)) for d in info["local_devices"]}
    shared = job.share("hosts", {"host": host, "lsa": {str(r): list(v) for r, v in local.items()}})
    hosts, lsa = [""] * world, {}
    for process, entry in enumerate(shared):
        if "silent" in entry:
            raise jaxgin.JaxginError(f"jaxgin.pairtest: {entry['silent']} before the first pair")
        for r, team in entry["lsa"].items():
            hosts[int(r)], lsa[int(r)] = entry["host"], tuple(team)
    paths = _paths(info, hosts, lsa)
    sharding = NamedSharding(mesh, P(AXIS))
    small = jaxgin.Mailbox("jaxgin_pairtest_latency", shape=(latency_bytes // 4,), dtype=jnp.uint32)
    large = jaxgin.Mailbox("jaxgin_pairtest_bandwidth", shape=(bandwidth_bytes // 4,), dtype=jnp.uint32)
    latency = _exchange(mesh, small, latency_iterations)
    bandwidth = _exchange(mesh, large, bandwidth_iterations)
    mine = {d.id for d in jax.local_devices()}
    rank_of = {d.id: r for r, d in enumerate(devices)}

    def call(program, partners: np.ndarray) -> tuple[float, int]:
        """Seconds of one call and the wrong words this process's devices received."""
        arg = jax.make_array_from_callback((world,), sharding, lambda index: partners[index])
        start = time.perf_counter()
        out = jax.block_until_ready(program(arg))
        seconds = time.perf_counter() - start
        return seconds, int(sum(np.asarray(s.data).sum() for s in out.addressable_shards))

    identity = np.arange(world, dtype=np.int32)
    for program in (latency, bandwidth):  # compile, and first use of every rank's own mailbox slots
        job.barrier(f"compile{program is bandwidth}")
        call(program, identity)
    pairs = []
    for a, b in sorted(paths):
        partners = identity.copy()
        partners[a], partners[b] = b, a
        seconds, wrong, error = {}, 0, ""
        # Every process passes every barrier, a failed one too, so that none waits for a barrier
        # another has skipped; the first call is the pair's untimed first exchange.
        for step, program in (("first", latency), ("latency", latency), ("bandwidth", bandwidth)):
            job.barrier(f"{a}_{b}_{step}")
            if error:
                continue
            try:
                seconds[step], step_wrong = call(program, partners)
                wrong += step_wrong
            except Exception as e:  # a fault on the device (JaxRuntimeError, DeviceFault)
                faults = jaxgin.device_faults() if jaxgin.is_initialized() else []
                error = "\n".join([f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", *faults])
        ours = any(rank_of[d] in (a, b) for d in mine)
        report = {"wrong": wrong, "error": error} | ({"seconds": seconds} if ours and not error else {})
        reports = job.share(f"pair{a}_{b}", report)
        errors = [r.get("error") or r.get("silent") for r in reports if r.get("error") or r.get("silent")]
        timed = [r["seconds"] for r in reports if "seconds" in r]
        pair = Pair(a, b, paths[a, b], wrong_words=sum(r.get("wrong", 0) for r in reports), error="\n".join(errors))
        if timed and not errors:
            pair = dataclasses.replace(
                pair, latency_us=max(t["latency"] for t in timed) / latency_iterations * 1e6,
                bandwidth_gbs=bandwidth_bytes * bandwidth_iterations / max(t["bandwidth"] for t in timed) / 1e9)
        pairs.append(pair)
        if pair.failed:
            break
    pairs, slow_ranks, slow_hosts = judge(pairs, hosts, slow_fraction)
    decided, summary = verdict(pairs, hosts, slow_ranks, slow_hosts)
    settings = {k: v for k, v in sorted(os.environ.items()) if k.startswith(("NCCL_", "JAXGIN_"))}
    return Report(hosts, pairs, slow_ranks, slow_hosts, decided, summary, settings)


def render(report: Report, args: argparse.Namespace) -> str:
    hosts = list(dict.fromkeys(report.hosts))
    lines = [f"jaxgin pairtest: {len(report.hosts)} ranks on {len(hosts)} hosts ({', '.join(hosts)}); each pair both "
             f"ways at once: latency {args.latency_bytes} B x {args.latency_iterations}, bandwidth "
             f"{args.bandwidth_bytes} B x {args.bandwidth_iterations}"]
    for p in report.pairs:
        figures = (f"{p.latency_us:10.1f} us {p.bandwidth_gbs:9.2f} GB/s each way" if p.latency_us is not None
                   else f"{'':>10}    {'':>9}")
        state = "FAILED" if p.failed else "slow" if p.slow else "ok"
        lines.append(f"  {p.a:>4} <-> {p.b:<4} {report.hosts[p.a]} <-> {report.hosts[p.b]}  {p.path:<9} {figures}  {state}")
        if p.failed:
            lines += [f"        {line}" for line in (p.error or f"{p.wrong_words} wrong words").splitlines()]
    lines.append(f"verdict: {report.verdict} (exit status {report.exit_status}): {report.summary}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxgin.pairtest", description=__doc__.split("\n\n")[0])
    p.add_argument("--latency-bytes", type=sizes.argument("--latency-bytes"), default=8)
    p.add_argument("--bandwidth-bytes", type=sizes.argument("--bandwidth-bytes"), default=4 << 20)
    p.add_argument("--latency-iterations", type=int, default=50)
    p.add_argument("--bandwidth-iterations", type=int, default=10)
    p.add_argument("--slow-fraction", type=float, default=0.5,
                   help="a pair slower than this fraction of its path's best quarter is slow (0: judge no speed)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--out", type=Path, help="also write the JSON report to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    jaxgin.initialize()
    report = run(latency_bytes=args.latency_bytes, bandwidth_bytes=args.bandwidth_bytes,
                 latency_iterations=args.latency_iterations, bandwidth_iterations=args.bandwidth_iterations,
                 slow_fraction=args.slow_fraction)
    if jax.process_index() == 0:
        document = report.to_json() | {"latency_bytes": args.latency_bytes, "bandwidth_bytes": args.bandwidth_bytes,
                                       "latency_iterations": args.latency_iterations,
                                       "bandwidth_iterations": args.bandwidth_iterations}
        print(json.dumps(document, indent=1) if args.json else render(report, args), flush=True)
        if args.out:
            args.out.write_text(json.dumps(document, indent=1))
    if report.verdict == "not ready":
        # A device fault left this process's GPU unusable: leave without the teardown, together.
        sys.stdout.flush()
        _Job(REPORT_GRACE_S).barrier("exit")
        os._exit(report.exit_status)
    jaxgin.finalize()
    return report.exit_status


if __name__ == "__main__":
    sys.exit(main())
