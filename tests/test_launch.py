"""python -m jaxgin.launch and examples/multihost/: where each process of a job learns its place
(options, SLURM, Open MPI), the dry runs of the SLURM batch script and the plain two-host recipe,
and the commands those dry runs print, run here as a job of two processes on the CPU: the
quickstart and the MoE example, each through jax.distributed."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from jaxgin import launch
from jaxgin.errors import JaxginError

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's or jaxgin's variables, python3 being this Python."""
    keep = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "OMPI_", "JAX_", "NCCL_", "JAXGIN_")) and k != "XLA_FLAGS"}
    keep["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{keep.get('PATH', '')}"
    return keep | extra


@pytest.mark.parametrize("text, hosts", [
    ("node01", ["node01"]),
    ("node01,gpu7", ["node01", "gpu7"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("a[8-10]b,c[1]", ["a8b", "a9b", "a10b", "c1"]),
    ("rack1-n[098-101],login", ["rack1-n098", "rack1-n099", "rack1-n100", "rack1-n101", "login"]),
])
def test_slurm_host_lists(text, hosts):
    assert launch.expand_hostlist(text) == hosts


def test_slurm_tasks_per_node():
    assert launch.expand_tasks_per_node("4(x2),3") == [4, 4, 3]
    with pytest.raises(JaxginError, match=r"cannot read SLURM's tasks per node '4x2'"):
        launch.expand_tasks_per_node("4x2")


SLURM_JOB = {"SLURM_JOB_ID": "77321", "SLURM_JOB_NODELIST": "gpu[07-08],gpu11", "SLURM_TASKS_PER_NODE": "4(x2),2",
             "SLURM_NTASKS": "10", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}


def test_every_slurm_task_computes_its_place_as_the_dry_run_plans_it():
    """What the batch script's dry run prints for each task is what that task, started by srun,
    computes from its own SLURM variables; the coordinator is the one JAX's SLURM support picks."""
    from jax._src.clusters import slurm_cluster

    plan = launch.slurm_plan(SLURM_JOB)
    assert [host for host, _ in plan] == ["gpu07"] * 4 + ["gpu08"] * 4 + ["gpu11"] * 2
    assert [job.local_device_ids for _, job in plan] == [(0,), (1,), (2,), (3,)] * 2 + [(0,), (1,)]
    node_of = {"gpu07": 0, "gpu08": 1, "gpu11": 2}
    for host, planned in plan:
        task = SLURM_JOB | {"SLURM_STEP_NODELIST": SLURM_JOB["SLURM_JOB_NODELIST"],
                            "SLURM_STEP_TASKS_PER_NODE": SLURM_JOB["SLURM_TASKS_PER_NODE"],
                            "SLURM_PROCID": str(planned.process_id), "SLURM_NODEID": str(node_of[host]),
                            "SLURM_LOCALID": str(planned.local_device_ids[0])}
        assert launch.job_from(task) == planned
    with pytest.MonkeyPatch.context() as m:
        for name, value in (SLURM_JOB | {"SLURM_STEP_NODELIST": SLURM_JOB["SLURM_JOB_NODELIST"]}).items():
            m.setenv(name, value)
        m.delenv("JAX_COORDINATOR_PORT", raising=False)
        assert plan[0][1].coordinator == slurm_cluster.SlurmCluster.get_coordinator_address(None, None) == "gpu07:65033"


def test_a_task_alone_on_its_node_or_bound_to_one_gpu_drives_what_it_sees():
    one_per_node = SLURM_JOB | {"SLURM_TASKS_PER_NODE": "1(x3)", "SLURM_NTASKS": "3"}
    assert {job.local_device_ids for _, job in launch.slurm_plan(one_per_node)} == {None}
    bound = SLURM_JOB | {"CUDA_VISIBLE_DEVICES": "2"}  # srun --gpus-per-task=1
    assert {job.local_device_ids for _, job in launch.slurm_plan(bound)} == {None}


def test_openmpi_and_options():
    ompi = {"OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "JAX_COORDINATOR_ADDRESS": "h0:1234"}
    assert launch.job_from(ompi) == launch.Job("h0:1234", 8, 5, (1,), "openmpi")
    with pytest.raises(JaxginError, match="under mpirun, say where process 0 listens: --coordinator HOST:PORT"):
        launch.job_from({k: v for k, v in ompi.items() if k != "JAX_COORDINATOR_ADDRESS"})
    assert launch.job_from({}, coordinator="h0:9", num_processes=2, process_id=1) == launch.Job("h0:9", 2, 1, None, "options")
    with pytest.raises(JaxginError, match=r"--process-id 2 is not in \[0, 2\)"):
        launch.job_from({}, coordinator="h0:9", num_processes=2, process_id=2)
    with pytest.raises(JaxginError, match="--num-processes and --process-id go together, with --coordinator"):
        launch.job_from({}, num_processes=2, process_id=0)
    assert launch.job_from({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None  # one task: nothing to join
    assert launch.job_from({}) is None


def _run(command: list[str], env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _run_job(commands: list[str], env: dict, timeout: float = 300) -> list[tuple[int, str, str]]:
    """The printed commands, each in a process of its own here, all at once."""
    procs = [subprocess.Popen(["bash", "-c", c], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for c in commands]
    finished = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        finished.append((p.returncode, out, err))
    return finished


def test_two_hosts_dry_run_prints_each_hosts_command_and_they_run_the_quickstart():
    port = _free_port()
    out = _run(["bash", "examples/multihost/two_hosts.sh", "127.0.0.1", "localhost"],
               _env(JAXGIN_DRY_RUN="1", JAXGIN_PORT=str(port), JAXGIN_TIMEOUT="20"))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    expected = [f"{host}: cd {shlex.quote(str(ROOT))} && env JAXGIN_TIMEOUT=20 python3 -m jaxgin.launch --coordinator "
                f"127.0.0.1:{port} --num-processes 2 --process-id {i} examples/quickstart.py"
                for i, host in enumerate(["127.0.0.1", "localhost"])]
    assert lines == expected
    finished = _run_job([line.split(": ", 1)[1] for line in lines], _env())
    for code, stdout, stderr in finished:
        assert code == 0, stderr[-3000:]
        assert "jaxgin 0.1.0 on 8 cpu devices: backend=reference" in stdout  # 4 devices in each of 2 processes
        assert "exchange OK over the reference path: 64 sender/receiver pairs" in stdout
        assert "JAX ops OK on 8 devices" in stdout


def test_two_hosts_needs_two_hosts():
    out = _run(["bash", "examples/multihost/two_hosts.sh", "node01"], _env(JAXGIN_DRY_RUN="1"))
    assert out.returncode == 2 and "name at least two hosts" in out.stderr


def test_slurm_dry_run_prints_each_tasks_command_and_they_run_the_moe_example():
    port = _free_port()
    allocation = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "localhost", "SLURM_TASKS_PER_NODE": "2",
                  "SLURM_NTASKS": "2", "SLURM_JOB_NUM_NODES": "1", "JAX_COORDINATOR_PORT": str(port)}
    out = _run(["bash", "examples/multihost/slurm.sbatch", "examples/moe_layer.py"], _env(JAXGIN_DRY_RUN="1", **allocation))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines == [f"rank {i} of 2 on localhost: python3 -m jaxgin.launch --coordinator localhost:{port} "
                     f"--num-processes 2 --process-id {i} --local-device-ids {i} examples/moe_layer.py" for i in range(2)]
    finished = _run_job([line.split(": ", 1)[1] for line in lines], _env())
    for code, stdout, stderr in finished:
        assert code == 0, stderr[-3000:]
        assert "8 CPU devices (reference path)" in stdout and "jaxgin.moe.moe_layer" in stdout


def test_launch_runs_a_module_and_a_script_as_main(tmp_path):
    script = tmp_path / "show.py"
    script.write_text("import sys\nprint('main' if __name__ == '__main__' else __name__, sys.argv)\n")
    out = _run([sys.executable, "-m", "jaxgin.launch", str(script), "a", "--b"], _env())
    assert out.returncode == 0 and out.stdout == f"main [{str(script)!r}, 'a', '--b']\n", out.stderr
    out = _run([sys.executable, "-m", "jaxgin.launch", "--dry-run", "-m", "jaxgin.pairtest", "--json"], _env())
    assert out.stdout.endswith(": python3 -m jaxgin.pairtest --json\n") and out.stdout.startswith("one process on ")
    out = _run([sys.executable, "-m", "jaxgin.launch", "--num-processes", "2", "x.py"], _env())
    assert out.returncode == 2 and "--num-processes and --process-id go together" in out.stderr
