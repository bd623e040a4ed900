"""Plots a benchmarks/*.json report: latency and bandwidth vs message size, XLA vs jaxgin.

    python benchmarks/plot.py collectives.json      # writes collectives.png next to it

Needs matplotlib (pip install matplotlib); without it, it says so and exits with status 3.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def plot(path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads(Path(path).read_text())
    ops = sorted({r["op"] for r in report["results"]}, key=[r["op"] for r in report["results"]].index)
    fig, axes = plt.subplots(2, len(ops), figsize=(5 * len(ops), 8), squeeze=False)
    for col, op in enumerate(ops):
        rows = [r for r in report["results"] if r["op"] == op]
        sizes = [r["bytes_per_device"] for r in rows]
        for row, (key, label) in enumerate((("us", "time per op (us)"), ("GBps", "bytes per device / time (GB/s)"))):
            ax = axes[row][col]
            ax.plot(sizes, [r[f"xla_{key}"] for r in rows], "o-", label="XLA (NCCL)")
            ax.plot(sizes, [r[f"jaxgin_{key}"] for r in rows], "s-", label="jaxgin")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("bytes per device")
            ax.set_ylabel(label)
            ax.set_title(f"{op}, {report['devices']} x {report['device_kind']}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
    fig.tight_layout()
    out = Path(path).with_suffix(".png")
    fig.savefig(out, dpi=110)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", type=Path, help="a JSON report of benchmarks/collectives.py")
    args = parser.parse_args()
    from jaxgin import cli

    cli.require(__file__, "matplotlib", why="it draws the plot", install="matplotlib")
    print(plot(args.report))


if __name__ == "__main__":
    main()
