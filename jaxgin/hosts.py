"""The hosts of a job, and which GPU of a host receives what a GPU of another host sends it.

Across hosts the NIC is the scarce link, so ops that send one GPU's data to several GPUs of
another host send it over the network once, to one GPU of that host (its *entry* for that
sender), which forwards it over NVLink to its host-mates. The entry for sender s on host B is the
GPU of B at s's place among its own host's GPUs, modulo B's size (GPUs counted in axis order):
with hosts of equal size, GPU i of every host sends to GPU i of every other, so each GPU's NIC
carries one sender per host. The kernels compute the same rule on the device
(jaxgin.op_kernels.network_entry); `entries` is its plain statement, for tests and byte counts.

Hosts are the device library's: ranks that reach each other over NVLink (an NCCL LSA team: equal
sizes, consecutive ranks), or every rank alone when GIN is forced.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxgin.errors import JaxginError


def rank_hosts(state, op: str) -> np.ndarray:
    """int32 [world size]: the host of each rank, as the device library tells NVLink peers from GIN
    ones (ranks rank - lsa_rank ... + lsa_size - 1 share a host). `op` names the caller in the
    error for a layout the rule cannot express."""
    world = state.world_size
    if state.options.force_gin:
        return np.arange(world, dtype=np.int32)
    infos = [state.runtime.device_info(i) for i in range(len(state.local_devices))]
    size = int(infos[0]["lsa_size"])
    for info in infos:
        rank, lsa_rank, lsa_size = int(info["rank"]), int(info["lsa_rank"]), int(info["lsa_size"])
        if lsa_size != size or world % size or rank - lsa_rank != rank // size * size:
            raise JaxginError(
                f"{op}: routing across hosts needs hosts of equal GPU counts with consecutive ranks; rank {rank} "
                f"is GPU {lsa_rank} of a host of {lsa_size} in a job of {world} ranks (this process's first GPU's "
                f"host has {size}). Give every host the same number of GPUs, ranked host by host"
            )
    return (np.arange(world) // size).astype(np.int32)


def entries(axis_hosts: Sequence[int]) -> np.ndarray:
    """int [P, P] for the hosts of axis indices 0 .. P-1: entry[s, d] is the axis index on d's host
    that receives over the network what s sends to that host; d itself where s and d share a host."""
    hosts = np.asarray(axis_hosts)
    p = hosts.size
    members = {h: [i for i in range(p) if hosts[i] == h] for h in hosts.tolist()}
    out = np.empty((p, p), dtype=np.int64)
    for s in range(p):
        place = members[hosts[s]].index(s)
        for d in range(p):
            group = members[hosts[d]]
            out[s, d] = d if hosts[d] == hosts[s] else group[place % len(group)]
    return out
