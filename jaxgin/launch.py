"""How a jaxgin program joins a job of several processes (``jax.distributed``), on one host or many.

    python -m jaxgin.launch [--coordinator HOST:PORT --num-processes N --process-id I]
                            [--local-device-ids 0,1] [--dry-run] (SCRIPT | -m MODULE) [ARGS...]

joins the job this process belongs to, then runs SCRIPT (or MODULE) as ``__main__``, as
``python SCRIPT ARGS`` would: jaxgin's examples and ``jaxgin.pairtest`` start on N hosts this way
without a line of their own about processes. The job is, in this order:

  - the options: the plain recipe, one command per host (``examples/multihost/two_hosts.sh``);
    the coordinator may come from ``JAX_COORDINATOR_ADDRESS`` instead;
  - SLURM's task environment, under ``srun`` (``examples/multihost/slurm.sbatch``): process
    ``SLURM_PROCID`` of ``SLURM_NTASKS``, the coordinator on the step's first node;
  - Open MPI's, under ``mpirun`` (``OMPI_COMM_WORLD_RANK`` of ``OMPI_COMM_WORLD_SIZE``), with the
    coordinator from ``--coordinator`` or ``JAX_COORDINATOR_ADDRESS``;
  - none of them: one process, nothing to join.

With ``--dry-run`` nothing runs: it prints, one line per process, where it runs and the command
that starts it with its place spelled out (``--coordinator``, ``--num-processes``,
``--process-id``, ``--local-device-ids``): inside a SLURM allocation (a batch script) every task
that ``srun`` would start there, else this process alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import runpy
import shlex
import socket
import sys
from collections.abc import Mapping

import jax

from jaxgin.errors import JaxginError

# JAX's own choice for SLURM (jax._src.clusters.slurm_cluster): a port in the top 4096 of the
# range, picked by the job id, so every task of a job computes the same one.
SLURM_PORT_BASE = 65536 - 4096


@dataclasses.dataclass(frozen=True)
class Job:
    """One process's place in a job: what ``jax.distributed.initialize`` gets."""

    coordinator: str
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None  # None: every GPU this process sees
    launcher: str  # 'options', 'slurm' or 'openmpi'

    def command(self, program: list[str]) -> list[str]:
        """The command that starts this process with its place spelled out (what a dry run prints)."""
        ids = ["--local-device-ids", ",".join(map(str, self.local_device_ids))] if self.local_device_ids else []
        return ["python3", "-m", "jaxgin.launch", "--coordinator", self.coordinator, "--num-processes",
                str(self.num_processes), "--process-id", str(self.process_id), *ids, *program]


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compressed host list ('node[01-03,07],gpu5') as host names, in order."""
    hosts: list[str] = []
    for match in re.finditer(r"([^,\[]+)(?:\[([^\]]*)\])?([^,\[]*)", text):
        prefix, ranges, suffix = match.groups()
        if ranges is None:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            first, _, last = part.partition("-")
            last = last or first
            for number in range(int(first), int(last) + 1):
                hosts.append(f"{prefix}{number:0{len(first)}d}{suffix}")
    return hosts


def expand_tasks_per_node(text: str) -> list[int]:
    """SLURM's tasks per node ('4(x2),3') as one count per node."""
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise JaxginError(f"cannot read SLURM's tasks per node {text!r}: expected counts such as '4(x2),3'")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _int(env: Mapping[str, str], name: str) -> int:
    value = env.get(name, "")
    if not value.isdigit():
        raise JaxginError(f"{name}={value!r} is not a whole number; it comes from the launcher")
    return int(value)


def _local_devices(env: Mapping[str, str], tasks_on_node: int, local_rank: int) -> tuple[int, ...] | None:
    """Which GPUs a task drives: every GPU it sees when it is alone on its node or sees one GPU
    (the launcher bound it: --gpus-per-task), else the one of its local rank among those it sees."""
    visible = [g for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    if tasks_on_node <= 1 or len(visible) == 1:
        return None
    return (local_rank,)


def _slurm_coordinator(env: Mapping[str, str], nodelist: str) -> str:
    hosts = expand_hostlist(env[nodelist])
    port = env.get("JAX_COORDINATOR_PORT") or str(SLURM_PORT_BASE + _int(env, "SLURM_JOB_ID") % 4096)
    return f"{hosts[0]}:{port}"


def _slurm_task(env: Mapping[str, str]) -> Job:
    """This task's job under srun."""
    nodelist = "SLURM_STEP_NODELIST" if "SLURM_STEP_NODELIST" in env else "SLURM_JOB_NODELIST"
    per_node = expand_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1")
    node = int(env.get("SLURM_NODEID", "0"))
    tasks_on_node = per_node[node] if node < len(per_node) else 1
    local = _int(env, "SLURM_LOCALID")
    return Job(_slurm_coordinator(env, nodelist), _int(env, "SLURM_NTASKS"), _int(env, "SLURM_PROCID"),
               _local_devices(env, tasks_on_node, local), "slurm")


def slurm_plan(env: Mapping[str, str]) -> list[tuple[str, Job]]:
    """Every task srun would start in this allocation (block distribution: node by node), with its
    host: what the dry run of a batch script prints."""
    hosts = expand_hostlist(env["SLURM_JOB_NODELIST"])
    per_node = expand_tasks_per_node(env.get("SLURM_TASKS_PER_NODE") or "1")
    if len(per_node) != len(hosts):
        raise JaxginError(f"SLURM_TASKS_PER_NODE={env.get('SLURM_TASKS_PER_NODE')!r} names {len(per_node)} nodes but "
                          f"SLURM_JOB_NODELIST={env['SLURM_JOB_NODELIST']!r} has {len(hosts)}")
    total = sum(per_node)
    coordinator = _slurm_coordinator(env, "SLURM_JOB_NODELIST")
    plan, rank = [], 0
    for host, tasks in zip(hosts, per_node):
        for local in range(tasks):
            plan.append((host, Job(coordinator, total, rank, _local_devices(env, tasks, local), "slurm")))
            rank += 1
    return plan


def job_from(env: Mapping[str, str], *, coordinator: str | None = None, num_processes: int | None = None,
             process_id: int | None = None, local_device_ids: tuple[int, ...] | None = None) -> Job | None:
    """This process's job: from the options, else SLURM's task environment, else Open MPI's; None
    for a process that is alone."""
    coordinator = coordinator or env.get("JAX_COORDINATOR_ADDRESS") or None
    if num_processes is not None or process_id is not None:
        if coordinator is None or num_processes is None or process_id is None:
            raise JaxginError("--num-processes and --process-id go together, with --coordinator HOST:PORT (or "
                              "JAX_COORDINATOR_ADDRESS): process 0's host and a free port every process can reach")
        if not 0 <= process_id < num_processes:
            raise JaxginError(f"--process-id {process_id} is not in [0, {num_processes}) (--num-processes {num_processes})")
        return Job(coordinator, num_processes, process_id, local_device_ids, "options")
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        job = _slurm_task(env)
        return dataclasses.replace(job, coordinator=coordinator or job.coordinator,
                                   local_device_ids=local_device_ids or job.local_device_ids)
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        if coordinator is None:
            raise JaxginError("under mpirun, say where process 0 listens: --coordinator HOST:PORT, or "
                              "mpirun -x JAX_COORDINATOR_ADDRESS=HOST:PORT (HOST: the first host of the job)")
        local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
        tasks_on_node = int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"))
        return Job(coordinator, _int(env, "OMPI_COMM_WORLD_SIZE"), _int(env, "OMPI_COMM_WORLD_RANK"),
                   local_device_ids or _local_devices(env, tasks_on_node, local), "openmpi")
    return None


def join(job: Job | None) -> None:
    """jax.distributed.initialize for `job`; nothing for None (one process)."""
    if job is None:
        return
    ids = list(job.local_device_ids) if job.local_device_ids is not None else None
    jax.distributed.initialize(job.coordinator, num_processes=job.num_processes, process_id=job.process_id,
                               local_device_ids=ids)


_VALUE_OPTIONS = ("--coordinator", "--num-processes", "--process-id", "--local-device-ids")


def _split(argv: list[str]) -> tuple[list[str], str, str, list[str]]:
    """(launch's own options, 'script' or 'module', the program, its arguments)."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "-m" and i + 1 < len(argv):
            return argv[:i], "module", argv[i + 1], argv[i + 2:]
        if arg == "--" and i + 1 < len(argv):
            return argv[:i], "script", argv[i + 1], argv[i + 2:]
        if arg.startswith("-"):
            i += 2 if arg in _VALUE_OPTIONS else 1
            continue
        return argv[:i], "script", arg, argv[i + 1:]
    return argv, "", "", []


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jaxgin.launch", usage="%(prog)s [options] (SCRIPT | -m MODULE) [ARGS...]",
        description="Join a job of several processes through jax.distributed, then run a script or module.")
    parser.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's host and a free port (default: "
                        "JAX_COORDINATOR_ADDRESS, or the first node of a SLURM step)")
    parser.add_argument("--num-processes", type=int, metavar="N")
    parser.add_argument("--process-id", type=int, metavar="I")
    parser.add_argument("--local-device-ids", metavar="0,1", help="the GPUs (indices among those visible) this "
                        "process drives; default: all it sees, or one per task where a launcher starts several per node",
                        type=lambda text: tuple(int(g) for g in text.split(",")))
    parser.add_argument("--dry-run", action="store_true", help="print what each process would run, run nothing")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, kind, program, program_args = _split(argv)
    parser = _parser()
    args = parser.parse_args(ours)
    if not program:
        parser.error("name the SCRIPT to run (or -m MODULE)")
    shown = [*(["-m"] if kind == "module" else []), program, *program_args]
    try:
        if args.dry_run and "SLURM_JOB_NODELIST" in os.environ:
            for host, job in slurm_plan(os.environ):
                print(f"rank {job.process_id} of {job.num_processes} on {host}: {shlex.join(job.command(shown))}")
            return 0
        job = job_from(os.environ, coordinator=args.coordinator, num_processes=args.num_processes,
                       process_id=args.process_id, local_device_ids=args.local_device_ids)
    except JaxginError as e:
        parser.error(str(e))
    if args.dry_run:
        if job is None:
            print(f"one process on {socket.gethostname()}: {shlex.join(['python3', *shown])}")
        else:
            print(f"rank {job.process_id} of {job.num_processes} on {socket.gethostname()}: "
                  f"{shlex.join(job.command(shown))}")
        return 0
    join(job)
    sys.argv = [program, *program_args]
    if kind == "module":
        runpy.run_module(program, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(program)))
        runpy.run_path(program, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
