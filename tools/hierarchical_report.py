"""benchmarks/results/<machine>/hierarchical.json from a GPU round's mixed-mesh results: what one
call of each op sent over the network (jaxgin's host transport counts every byte and put that
crosses an emulated host) beside the least it could, per rank.

    python3 tools/hierarchical_report.py RESULTS_DIR [RESULTS_DIR ...] --out FILE

RESULTS_DIR holds the round's records (tests/gpu's `record`): mixed_fused_check_*_Nranks.json
(all_gather_matmul: each shard crosses to each other host once) and mixed_moe_check_*_Nranks.json
(MoE dispatch and combine: each token's row crosses once per other host; records from before
that are refused). Each case: {"op", "world", "hosts", "rank", "mode" or "method",
"command_buffers", "network_bytes", "host_minimum_bytes", "rank_minimum_bytes", "network_puts",
"source"}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _processes(path: Path) -> list[dict]:
    return json.loads(path.read_text()).get("processes", [])


def fused_cases(path: Path) -> list[dict]:
    cases = []
    for process in _processes(path):
        for t in process.get("traffic", []):
            if t.get("op") != "ag" or "rank_minimum_bytes" not in t:
                continue
            cases.append({"op": "all_gather_matmul", "method": t["method"], "world": t["world"], "hosts": t["hosts"],
                          "rank": t["rank"], "network_bytes": t["bytes"], "host_minimum_bytes": t["minimum_bytes"],
                          "rank_minimum_bytes": t["rank_minimum_bytes"], "network_puts": t["puts"],
                          "source": path.name})
    return cases


def moe_cases(path: Path) -> list[dict]:
    cases = []
    for process in _processes(path):
        world = process.get("processes")
        for t in process.get("traffic", []):
            if "combine_metadata_bytes" not in t:
                raise SystemExit(f"{path}: a record from before MoE dispatch and combine went once per host "
                                 "(no per-host fields); run the round again")
            d, c = t["dispatch"], t["combine"]
            counts = t["dispatch_counts_bytes"]
            hosts = t["remote_hosts"] + 1
            cases.append({"op": "moe.dispatch", "mode": t["mode"], "world": world, "hosts": hosts, "rank": t["rank"],
                          "network_bytes": d["bytes"],
                          "host_minimum_bytes": t["dispatch_rows_host_minimum_bytes"] + counts,
                          "rank_minimum_bytes": t["dispatch_rows_rank_minimum_bytes"] + counts, "network_puts": d["puts"],
                          "metadata_bytes": t["dispatch_metadata_bytes"], "source": path.name})
            cases.append({"op": "moe.combine", "mode": t["mode"], "world": world, "hosts": hosts,
                          "rank": t["rank"], "network_bytes": c["bytes"],
                          "host_minimum_bytes": t["combine_minimum_bytes"],
                          "rank_minimum_bytes": t["combine_rows_rank_minimum_bytes"], "network_puts": c["puts"],
                          "metadata_bytes": t["combine_metadata_bytes"], "source": path.name})
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    cases = []
    for folder in args.results:
        for path in sorted(folder.glob("mixed_fused_check_*ranks.json")):
            cases += fused_cases(path)
        for path in sorted(folder.glob("mixed_moe_check_*ranks.json")):
            cases += moe_cases(path)
    if not cases:
        raise SystemExit(f"no mixed-mesh traffic records in {[str(f) for f in args.results]}")
    for case in cases:
        case["command_buffers"] = "_graphs_" in case["source"]
        case["network_to_host_minimum"] = case["network_bytes"] / case["host_minimum_bytes"]
        case["rank_to_host_minimum"] = case["rank_minimum_bytes"] / case["host_minimum_bytes"]
    args.out.write_text(json.dumps({"cases": cases}, indent=1) + "\n")
    for c in cases:
        print(f"{c['op']:18} {c.get('method', c.get('mode', '')):15} {'graphs' if c['command_buffers'] else 'plain':6} "
              f"world {c['world']} hosts {c['hosts']} "
              f"rank {c['rank']}: {c['network_bytes']} B in {c['network_puts']} puts, "
              f"{c['network_to_host_minimum']:.3f}x the host minimum (per-GPU sending: {c['rank_to_host_minimum']:.3f}x)")


if __name__ == "__main__":
    main()
