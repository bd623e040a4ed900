"""The GPU round's scheduling (tools/gpu_round.py), its reading of pytest's reports, and what the GPU
tests tell it (tests/gpu/round_plan.py), checked without a GPU."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("gpu_round", ROOT / "tools" / "gpu_round.py")
gpu_round = importlib.util.module_from_spec(spec)
sys.modules["gpu_round"] = gpu_round
spec.loader.exec_module(gpu_round)
Job, Schedule = gpu_round.GpuTest, gpu_round.Schedule


def simulate(schedule: Schedule, seconds: dict[str, float]) -> list[tuple[float, str, list[int]]]:
    """Runs the schedule to its end with each test taking seconds[nodeid]; checks at every start
    that no GPU holds more than the caps allow and that a test with GPUs to itself shares none.
    Returns (start time, nodeid, GPUs) in start order."""
    now, ends, starts = 0.0, {}, []
    while schedule.waiting or schedule.running:
        for test, place in schedule.ready():
            starts.append((now, test.nodeid, place))
            ends[test.nodeid] = now + seconds[test.nodeid]
            on = {g: [t for t, p in schedule.running.values() if g in p] for g in range(schedule.gpus)}
            for g, tests in on.items():
                assert not any(t.exclusive for t in tests) or len(tests) == 1, (now, g, tests)
            assert schedule.load == [sum(-(-t.processes // t.gpus) for t in on[g]) for g in on]
        assert schedule.running, f"nothing runs and {len(schedule.waiting)} wait: the schedule is stuck"
        nodeid = min(schedule.running, key=ends.get)
        now = ends.pop(nodeid)
        schedule.finished(schedule.running[nodeid][0])
    return starts


def test_tests_that_need_their_gpus_alone_run_first_and_alone():
    tests = [Job("long-emulated", 4, 8, False, 300), Job("memory-4", 4, 4, True, 30),
             Job("memory-2a", 2, 2, True, 20), Job("memory-2b", 2, 2, True, 20), Job("memory-1", 1, 1, True, 10),
             Job("small", 2, 2, False, 50)]
    schedule = Schedule(4, 28, 10, tests)
    starts = simulate(schedule, {t.nodeid: t.expected_s for t in tests})
    order = [nodeid for _, nodeid, _ in starts]
    assert order[0] == "memory-4" and starts[0][0] == 0.0  # the whole machine first, to itself
    # then the two-GPU ones side by side on disjoint GPUs, the one-GPU one once GPUs are free
    pairs = {nodeid: (when, place) for when, nodeid, place in starts}
    assert pairs["memory-2a"][0] == pairs["memory-2b"][0] == 30.0
    assert not set(pairs["memory-2a"][1]) & set(pairs["memory-2b"][1])
    # nothing else started before the last of them did
    last_exclusive = max(when for when, nodeid, _ in starts if nodeid.startswith("memory"))
    assert min(when for when, nodeid, _ in starts if not nodeid.startswith("memory")) >= last_exclusive


def test_the_others_go_longest_first_within_the_caps():
    tests = [Job(f"w8-{i}", 4, 8, False, 100 + i) for i in range(6)] + [Job("w2", 2, 2, False, 500)]
    first = Schedule(4, 20, 10, tests).ready()
    assert [t.nodeid for t, _ in first] == ["w2", "w8-5", "w8-4"]  # 2 + 8 + 8 processes; a third world 8 exceeds 20
    starts = simulate(Schedule(4, 20, 10, tests), {t.nodeid: t.expected_s for t in tests})
    assert sorted(nodeid for _, nodeid, _ in starts) == sorted(t.nodeid for t in tests)  # each once


def test_a_test_larger_than_the_caps_runs_alone_rather_than_never():
    schedule = Schedule(2, 4, 2, [Job("huge", 2, 16, False, 10), Job("tiny", 1, 1, False, 1)])
    starts = simulate(schedule, {"huge": 10, "tiny": 1})
    assert [nodeid for _, nodeid, _ in starts] == ["huge", "tiny"] and starts[1][0] == 10


def test_ranks_per_gpu_cap_holds_and_tests_spread_to_the_least_loaded_gpus():
    tests = [Job(f"w4-{i}", 2, 4, False, 10) for i in range(4)]
    schedule = Schedule(4, 100, 2, tests)
    places = [place for _, place in schedule.ready()]
    assert places == [[0, 1], [2, 3]]  # 2 ranks per GPU each: the cap leaves no room for a third now
    assert schedule.load == [2, 2, 2, 2]


def test_junit_outcomes(tmp_path):
    cases = {"passed": "<testcase name='t'/>",
             "failed": "<testcase name='t'><failure message='assert 1 == 2'>trace</failure></testcase>",
             "skipped": "<testcase name='t'><skipped message='needs a GPU'/></testcase>",
             "error": "<testcase name='t'><error message='fixture broke'/></testcase>"}
    for outcome, case in cases.items():
        path = tmp_path / f"{outcome}.xml"
        path.write_text(f"<testsuites><testsuite>{case}</testsuite></testsuites>")
        got, message = gpu_round.junit_outcome(path)
        assert got == outcome, (outcome, got)
        assert (message == "") == (outcome == "passed"), message
    (tmp_path / "none.xml").write_text("<testsuites><testsuite/></testsuites>")
    assert gpu_round.junit_outcome(tmp_path / "none.xml") == ("error", "pytest ran no test")


def test_tests_needing_more_gpus_than_there_are_are_set_aside():
    schedule = Schedule(2, 28, 10, [Job("four", 4, 4, False), Job("two", 2, 2, False)])
    assert [t.nodeid for t in schedule.too_large] == ["four"]
    assert [t.nodeid for t, _ in schedule.ready()] == ["two"]


def fake_gpus(tmp_path, count: int) -> str:
    """A PATH on which nvidia-smi lists `count` H100s (the same lines whatever it is asked)."""
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir(exist_ok=True)
    smi.write_text(f"#!/bin/sh\nfor i in $(seq 0 {count - 1}); do "
                   "echo \"GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-$i)\"; done\n")
    smi.chmod(0o755)
    return f"{smi.parent}{os.pathsep}{os.environ['PATH']}"


@pytest.fixture
def four_gpus(tmp_path):
    return fake_gpus(tmp_path, 4)


def test_a_round_runs_each_test_and_writes_the_summary(tmp_path):
    """The round's plumbing end to end on this CPU machine, with nvidia-smi faked: the tests it
    picks skip here (they need PyTorch), so the round reports them skipped, then failed once
    --require-all demands that nothing skips, and says so in gpu-round.json."""
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("PyTorch is installed here: the selected tests would try to run on the faked GPUs")
    env = {**os.environ, "PATH": fake_gpus(tmp_path, 2)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    selection = ["tests/gpu/test_tritongin_gpu.py", "-k", "latency or bandwidth"]
    # (pytest reports a failure while setting a test up, where its skip marks act, as an error)
    for require_all, outcome in ((False, "skipped"), (True, "error")):
        folder = tmp_path / f"round-{require_all}"
        proc = subprocess.run([sys.executable, "tools/gpu_round.py", "run", "--no-install", "--dir", str(folder),
                               *(["--require-all"] if require_all else []), *selection], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # not every test passed
        summary = json.loads((folder / "results" / "gpu-round.json").read_text())
        assert summary["machine"].startswith("2 x ") and summary["tier"] == "fast", summary
        names = sorted(t["name"] for t in summary["tests"])
        assert names == ["test_tritongin_gpu.py::test_peer_ptr_bandwidth", "test_tritongin_gpu.py::test_put_signal_latency"]
        assert {t["outcome"] for t in summary["tests"]} == {outcome}, summary["tests"]
        assert all("needs PyTorch" in t["message"] for t in summary["tests"]), summary["tests"]
        assert all(("JAXGIN_TEST_REQUIRE_GPU=1 demands" in t["message"]) == require_all for t in summary["tests"])
        assert summary["by_file"] == {"test_tritongin_gpu.py": {outcome: 2}} and summary["not_run"] == []
        assert all(t["gpus"] in ([0, 1],) for t in summary["tests"])  # each had both GPUs to itself, in turn

def _collect(path_env, tmp_path, *selection, tier="fast", **settings):
    plan = tmp_path / "plan.json"
    env = {**os.environ, "PATH": path_env, "JAXGIN_ROUND_PLAN": str(plan), "JAXGIN_TEST_TIER": tier, **settings}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *selection],
                   cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    return {entry["nodeid"].split("::", 1)[1]: entry for entry in json.loads(plan.read_text())}


def test_gpu_tests_state_what_they_need(four_gpus, tmp_path):
    plan = _collect(four_gpus, tmp_path, "tests/gpu/test_moe_gpu.py", "tests/gpu/test_fault_cleanup_gpu.py",
                    "tests/gpu/test_reliability_gpu.py")
    assert plan["test_moe_mixed_mesh_emulated_hosts[plain]"] == {
        **plan["test_moe_mixed_mesh_emulated_hosts[plain]"], "gpus": 4, "processes": 8, "exclusive": False}
    assert {k: plan["test_moe_emulated_hosts[plain-world2]"][k] for k in ("gpus", "processes")} == {"gpus": 2,
                                                                                                  "processes": 2}
    memory = plan["test_starved_wait_then_finalize_returns_every_gpus_memory[heaps-only]"]
    assert memory["exclusive"] and memory["gpus"] == 1
    dead = plan["test_dead_peer_fails_survivors_within_the_timeout[lines-heaps-only]"]
    assert dead["exclusive"] and dead["gpus"] == 4  # several survivors: the case that mapped each other's heaps
    assert not plan["test_dead_peer_is_named_by_every_survivor_mixed_mesh_emulated_hosts[moe_dispatch]"]["exclusive"]


def test_the_fast_tier_takes_the_spot_worlds_and_the_soak_tier_every_world(four_gpus, tmp_path):
    fast = _collect(four_gpus, tmp_path, "tests/gpu/test_ops_gpu.py", "tests/gpu/test_moe_gpu.py")
    soak = _collect(four_gpus, tmp_path, "tests/gpu/test_ops_gpu.py", "tests/gpu/test_moe_gpu.py", tier="soak")
    # on 4 GPUs: worlds 2 and 4 (one rank per GPU) in the fast tier, every world in the soak tier
    assert "test_ops_equal_lax_emulated_hosts[8]" in soak and "test_ops_equal_lax_emulated_hosts[8]" not in fast
    assert "test_ops_equal_lax_emulated_hosts[4]" in fast and "test_ops_equal_lax_emulated_hosts[2]" in fast
    # the GIN data paths run at every world in both tiers
    for world in (2, 4, 8):
        assert f"test_moe_emulated_hosts[command_buffers-world{world}]" in fast


def test_an_unknown_tier_is_refused_naming_the_setting(four_gpus):
    env = {**os.environ, "PATH": four_gpus, "JAXGIN_TEST_TIER": "quick"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "tests/gpu/test_ops_gpu.py"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "JAXGIN_TEST_TIER='quick': expected one of ('fast', 'soak')" in proc.stdout + proc.stderr


def test_require_gpu_turns_a_skip_into_a_failure_that_says_why(tmp_path):
    """On this machine there is no GPU: the GPU test skips, and with JAXGIN_TEST_REQUIRE_GPU=1 it
    fails, naming the setting and the skip's reason."""
    test = "tests/gpu/test_runtime_gpu.py::test_wait_times_out_with_a_clear_error"
    env = {k: v for k, v in os.environ.items() if k != "JAXGIN_TEST_REQUIRE_GPU"}
    env["PATH"] = str(tmp_path)  # no nvidia-smi on it
    env["PATH"] += os.pathsep + os.path.dirname(sys.executable)
    plain = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", test], cwd=ROOT,
                           env=env, capture_output=True, text=True)
    assert plain.returncode == 0 and "1 skipped" in plain.stdout, plain.stdout[-2000:]
    demanded = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], cwd=ROOT,
                              env={**env, "JAXGIN_TEST_REQUIRE_GPU": "1"}, capture_output=True, text=True)
    assert demanded.returncode == 1, demanded.stdout[-2000:]
    assert "JAXGIN_TEST_REQUIRE_GPU=1 demands that every GPU test runs" in demanded.stdout
    assert "needs an NVIDIA GPU" in demanded.stdout


def test_emulated_worlds_can_be_narrowed_for_a_round_on_one_gpu(tmp_path):
    one_gpu = fake_gpus(tmp_path, 1)
    plan = _collect(one_gpu, tmp_path, "tests/gpu/test_fused_gpu.py", "tests/gpu/test_ops_gpu.py",
                    JAXGIN_TEST_EMULATED_WORLDS="2,4")
    assert {k for k in plan if k.startswith("test_fused_ops_emulated_hosts[plain")} == {
        "test_fused_ops_emulated_hosts[plain-2]", "test_fused_ops_emulated_hosts[plain-4]"}
    # the families a world adds nothing to: only the smallest world on one GPU in the fast tier
    assert {k for k in plan if k.startswith("test_ops_equal_lax_emulated_hosts")} == {"test_ops_equal_lax_emulated_hosts[2]"}
    bad = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "tests/gpu/test_ops_gpu.py"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PATH": one_gpu, "JAXGIN_TEST_EMULATED_WORLDS": "3"})
    assert bad.returncode != 0 and "JAXGIN_TEST_EMULATED_WORLDS='3': expected a comma-separated choice of (2, 4, 8)" \
        in bad.stdout + bad.stderr


def test_the_fast_tier_runs_every_case_once_per_family(monkeypatch):
    """The fused and MoE scenarios run every case at one world of a family (the largest with a GPU
    per rank) and their spot cases elsewhere in the fast tier (the same code paths, a third of the
    compiles); the tests expect what the scenarios run."""
    from conftest import gpu_scenario

    harness, fused, moe = gpu_scenario("harness"), gpu_scenario("fused_scenarios"), gpu_scenario("moe_scenarios")
    monkeypatch.setenv("JAXGIN_TEST_TIER", "fast")
    monkeypatch.setattr(harness, "GPUS", 4)
    # every case once, plain, at the largest world that gives each rank a GPU of its own
    assert harness.spot_cases_at(2, [2, 4, 8]) and harness.spot_cases_at(8, [2, 4, 8])
    assert not harness.spot_cases_at(4, [2, 4, 8])
    assert harness.spot_cases_at(4, [2, 4, 8], command_buffers=True)
    assert not harness.spot_cases_at(8, [8])  # the mixed mesh: its one world
    assert not harness.spot_cases_at(4, [2, 4])  # one process over the 4 GPUs (WORLD_SIZES)
    monkeypatch.setattr(harness, "GPUS", 1)
    assert not harness.spot_cases_at(2, [2, 4]) and harness.spot_cases_at(4, [2, 4])
    assert harness._spot_worlds([2, 4, 8], 4) == [2, 4] and harness._spot_worlds([2, 4, 8], 8) == [2, 8]
    assert harness._spot_worlds([2, 4], 1) == [2] and harness._spot_worlds([8], 4) == [8]
    monkeypatch.setenv("JAXGIN_TEST_TIER", "soak")
    assert not harness.spot_cases_at(2, [2, 4, 8])
    assert len(fused.scenario_cases(4, spot=True)) == 2 * len(fused.SPOT_CASES) < len(fused.scenario_cases(4, spot=False))
    assert {c[0][0] for c in fused.scenario_cases(4, spot=True)} == {"a2a", "ag"}  # both ops
    assert [c[0] for c in moe.planned_cases(4, spot=True)] == ["random", "ragged_shapes", "masked_ids"]
    assert len(moe.planned_cases(4, spot=False)) == 7
    # the scenario side reads the setting the test passes
    monkeypatch.setenv("JAXGIN_TEST_SPOT_CASES", "1")
    assert moe.planned_cases(4) == moe.planned_cases(4, spot=True)
    monkeypatch.setenv("JAXGIN_TEST_SPOT_CASES", "0")
    assert moe.planned_cases(4) == moe.cases(4)


def _tool(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "tools/gpu_round.py", *args], cwd=ROOT, env=env or os.environ,
                          capture_output=True, text=True, timeout=timeout)


def test_bench_runs_the_default_set_the_gpus_allow(tmp_path):
    planned = {}
    for gpus in (1, 2):
        (tmp_path / str(gpus)).mkdir()
        env = {**os.environ, "PATH": fake_gpus(tmp_path / str(gpus), gpus)}
        env.pop("CUDA_VISIBLE_DEVICES", None)
        proc = _tool("bench", "--dry-run", "--out", str(tmp_path / "out"), env=env)
        assert proc.returncode == 0, proc.stderr
        planned[gpus] = [line.split(":")[0] for line in proc.stdout.splitlines() if not line.startswith("left out")]
        left_out = [line for line in proc.stdout.splitlines() if line.startswith("left out")]
        assert all(s.default for s in (gpu_round.BENCHMARKS[n] for n in planned[gpus]))
        assert len(planned[gpus]) + len(left_out) == sum(s.default for s in gpu_round.BENCHMARKS.values())
    assert planned[1] == ["chunking", "moe", "triton_matmul"]
    assert planned[2] == ["latency", "fused", "chunking", "moe", "triton_matmul"]
    latency = _tool("bench", "--dry-run", "--out", str(tmp_path / "out"), "latency").stdout
    assert f"benchmarks/collectives.py --ops {gpu_round.LATENCY_OPS} --max-bytes 64KiB --out {tmp_path / 'out'} " \
           "--name latency" in latency
    unknown = _tool("bench", "--dry-run", "latnecy")
    assert unknown.returncode == 2 and "no step latnecy: choose from latency, fused" in unknown.stderr


def test_every_step_runs_a_script_that_takes_its_options():
    """The steps name scripts and options of this repository: a script renamed or an option
    dropped fails here, not on a lent GPU."""
    steps = [*gpu_round.BENCHMARKS.values(), *gpu_round.example_steps().values(), gpu_round.CLUSTER_CHECK,
             gpu_round.CLUSTER_EXAMPLES]
    assert set(gpu_round.example_steps()) == {p.stem for p in (ROOT / "examples").glob("*.py")}
    shown = {}  # a script's --help, for options it makes from a table rather than spells out
    for step in steps:
        script = ROOT / step.script[0]
        assert script.is_file(), step
        source = script.read_text()
        for option in (a for a in step.script[1:] if a.startswith("--")):
            if f'"{option}"' in source:
                continue
            if script not in shown:
                shown[script] = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True,
                                               timeout=300, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}).stdout
            assert option in shown[script].split(), (step.name, option)


def test_a_step_that_outlasts_its_time_is_stopped_with_its_children(tmp_path, capsys):
    child = tmp_path / "child.pid"
    step = gpu_round.Step("sleepy", ["-c", "import subprocess, sys, time; "
                                     "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
                                     f"open({str(child)!r}, 'w').write(str(p.pid)); print('child started', flush=True); "
                                     "time.sleep(120)"], seconds=3)
    entry = gpu_round.run_step(step, tmp_path)
    assert entry["exit"] == 124 and entry["seconds"] < 30, entry
    log = (tmp_path / "sleepy.log").read_text()
    assert "child started" in log and "stopped after 3 s" in log
    pid = int(child.read_text())
    for _ in range(50):  # gone, or a zombie waiting for a parent to reap it
        status = Path(f"/proc/{pid}/status")
        if not status.exists() or "\nState:\tZ" in status.read_text():
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the step's child {pid} outlived the step")
    failing = gpu_round.Step("failing", ["-c", "print('a warning line'); print('what went wrong'); raise SystemExit(3)"], 30)
    assert gpu_round.run_step(failing, tmp_path)["exit"] == 3
    printed = capsys.readouterr().out
    assert "what went wrong" in printed and "a warning line" not in printed and "--- failing: exit 3" in printed


def test_bench_records_each_steps_exit_in_its_summary(tmp_path):
    """A benchmark run for real (here it finds no GPU and says so): its log, its exit status in
    bench.json, and the bench's own status."""
    env = {**os.environ, "PATH": fake_gpus(tmp_path, 1)}
    proc = _tool("bench", "--no-install", "--out", str(tmp_path / "out"), "tune_matmul", env=env, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert summary["machine"].startswith("1 x ") and summary["left_out"] == []
    [step] = summary["steps"]
    assert step["name"] == "tune_matmul" and step["exit"] in (3, 4), step  # no GPU here, or no torch
    assert "tune_triton_matmul.py: needs" in (tmp_path / "out" / "tune_matmul.log").read_text()
    assert f"--- tune_matmul: exit {step['exit']}" in proc.stdout


def test_a_session_runs_its_phases_in_the_background_and_wait_brings_them(tmp_path):
    folder, out = tmp_path / "session", tmp_path / "out"
    out.mkdir()
    phases = ["bench --dry-run latency", "GREETING=hello sh -c 'echo $GREETING > $RESULTS/said.txt'",
              f"await file {tmp_path / 'never'} 1", "examples --dry-run"]
    started = _tool("session", "--dir", str(folder), *phases)
    assert started.returncode == 0 and "wait SECONDS" in started.stdout, started.stderr
    waited = _tool("wait", "30", "--dir", str(folder), env={**os.environ, "OUT": str(out)})
    assert "round finished" in waited.stdout, waited.stdout
    assert (folder / "done").read_text() == "0 0 1"  # the gate never opened: phase 4 did not run
    assert "phase 3: exit 1; it never came, so the session ends" in (out / "session.log").read_text()
    assert f"--out {folder / 'phase-1'} --name latency" in (folder / "phase-1.log").read_text()
    assert (folder / "phase-2" / "said.txt").read_text() == "hello\n"
    with tarfile.open(out / "round-files.tar.gz") as archive:
        assert {"phase-1.log", "phase-2/said.txt"} <= set(archive.getnames())
    refused = _tool("session", "--dir", str(tmp_path / "refused"), "bench", "await nccl soon")
    assert refused.returncode == 2 and "expected: await nccl VERSION" in refused.stderr
    assert not (tmp_path / "refused").exists()  # refused before anything started


def test_a_round_started_after_another_keeps_the_summary_it_goes_on_from(tmp_path, monkeypatch):
    """`start --skip-passed ROOT/results/gpu-round.json` (the last round's summary) makes ROOT afresh:
    the summaries it names are read first and handed to the new round under ROOT/earlier/."""
    root = tmp_path / "round"
    (root / "results").mkdir(parents=True)
    summary = root / "results" / "gpu-round.json"
    summary.write_text('{"tests": [{"name": "a.py::t", "outcome": "passed", "seconds": 3}]}')
    argv = ["--deadline", "300", "--skip-passed", str(summary), "--durations", str(tmp_path / "missing.json"),
            "--durations", str(summary), "-k", "x"]
    kept_argv, kept = gpu_round.keep_earlier_summaries(argv, root)
    assert kept_argv == ["--deadline", "300", "--skip-passed", str(root / "earlier/0-gpu-round.json"),
                         "--durations", str(tmp_path / "missing.json"),
                         "--durations", str(root / "earlier/1-gpu-round.json"), "-k", "x"]
    monkeypatch.setattr(gpu_round, "copy_tree", lambda r: (shutil.rmtree(r), r.mkdir()))  # no repository copy
    monkeypatch.setattr(gpu_round, "git_commit", lambda *a, **k: "abc")
    monkeypatch.setenv("ROUND_COMMIT", "abc")
    monkeypatch.setenv("ROUND_TREE", "def")
    monkeypatch.setattr(gpu_round.subprocess, "Popen", lambda *a, **k: types.SimpleNamespace(pid=12345))
    gpu_round.in_background(root, ["run", *kept_argv], "round.log", keep=kept)
    assert not summary.exists()  # the folder was made afresh ...
    assert (root / "pid").read_text() == "12345"  # for wait to see whether the round still runs
    assert json.loads((root / "earlier/0-gpu-round.json").read_text())["tests"][0]["outcome"] == "passed"  # ... and kept it


def test_a_summary_to_skip_that_is_not_there_is_refused_before_the_round_starts(tmp_path):
    missing = tmp_path / "round" / "gpu-round.json"
    started = _tool("start", "--skip-passed", str(missing), "--dir", str(tmp_path / "next"))
    assert started.returncode == 2, started
    assert f"--skip-passed {missing}: no such file" in started.stderr and "DIR/results/gpu-round.json" in started.stderr
    assert not (tmp_path / "next").exists()


def test_a_round_leaves_out_what_passed_in_any_of_the_parts_named(four_gpus, tmp_path, monkeypatch):
    """A round split over parts (run side by side, or cut by a deadline) goes on with --skip-passed
    once per earlier summary: a test that passed in any of them is left out, one that failed is not."""
    monkeypatch.setenv("PATH", four_gpus)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    latency, bandwidth = "test_tritongin_gpu.py::test_put_signal_latency", "test_tritongin_gpu.py::test_peer_ptr_bandwidth"
    standalone = "test_tritongin_gpu.py::test_standalone_exchanges[2]"
    parts = []
    for number, outcomes in enumerate([{latency: "passed", standalone: "failed"}, {bandwidth: "passed"}]):
        parts.append(tmp_path / f"part{number}.json")
        parts[-1].write_text(json.dumps({"tests": [{"name": n, "outcome": o} for n, o in outcomes.items()]}))
    args = types.SimpleNamespace(selection=["tests/gpu/test_tritongin_gpu.py", "-k", "latency or bandwidth or standalone"],
                                 durations=[], skip_passed=[str(p) for p in parts], tier="fast")
    names = {t.name for t in gpu_round.Round(args, tmp_path / "round").plan()}
    assert latency not in names and bandwidth not in names
    assert standalone in names and "test_tritongin_gpu.py::test_standalone_exchanges[4]" in names


def test_wait_stops_at_once_when_the_rounds_process_is_gone(tmp_path, monkeypatch, capsys):
    """A round whose background process died before it finished (no `done`): wait says so and
    returns 1 at once instead of waiting out its seconds."""
    root = tmp_path / "round"
    root.mkdir()
    (root / "round.log").write_text("Traceback (most recent call last):\nFileNotFoundError: x\n")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (root / "pid").write_text(str(gone.pid))
    monkeypatch.setenv("OUT", str(tmp_path))
    began = time.monotonic()
    assert gpu_round.wait(root, 60) == 1
    assert time.monotonic() - began < 10
    said = capsys.readouterr().out
    assert "round ended without finishing: its process is gone" in said and "FileNotFoundError: x" in said
    (root / "pid").write_text(str(os.getpid()))  # alive: the wait runs its time
    assert gpu_round.wait(root, 0.1) == 0 and "round still running" in capsys.readouterr().out


def test_the_summary_names_the_tree_that_ran_even_with_a_stale_git(tmp_path):
    """A device's copy may carry a .git from an older sync, whose HEAD is not what runs (the round of
    2026-11-27 said 0cf6e17 for 2ee5fbf): the tree hash of the files themselves is, and the commit
    is named only when its tree is that one."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git = lambda *a: subprocess.run(["git", *a], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()  # noqa: E731
    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    (repo / ".gitignore").write_text("build/\n")
    (repo / "a.py").write_text("one\n")
    git("add", "-A")
    git("commit", "-qm", "old")
    (repo / "a.py").write_text("two\n")
    (repo / "b.py").write_text("new\n")
    git("add", "-A")
    git("commit", "-qm", "new")
    new_tree = git("rev-parse", "HEAD^{tree}")
    git("reset", "-q", "--soft", "HEAD~1")  # the .git says "old"; the files are "new"
    (repo / "build").mkdir()
    (repo / "build" / "x.o").write_text("ignored\n")
    assert gpu_round.git_tree(repo) == new_tree
    old_head = git("rev-parse", "HEAD")
    assert gpu_round.git_commit(repo).startswith(f"unknown (the copy's HEAD {old_head[:12]} holds another tree")
    git("add", "-A")
    git("commit", "-qm", "again")  # now HEAD holds the files: it is the commit that runs
    assert gpu_round.git_commit(repo) == git("rev-parse", "HEAD")
    (tmp_path / "no_git").mkdir()
    assert gpu_round.git_tree(tmp_path / "no_git") == "unknown"
    assert gpu_round.git_commit(tmp_path / "no_git") == "unknown"
