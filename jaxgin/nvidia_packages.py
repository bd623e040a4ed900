"""Where PyPI's nvidia-* wheels (NCCL, nvcc, CUPTI, nvJitLink, ...) put their files: the folders
of the ``nvidia`` namespace package they all install into."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def roots() -> list[Path]:
    """The ``nvidia`` namespace package's folders, in import order; [] when no such wheel is installed."""
    spec = importlib.util.find_spec("nvidia")
    return [Path(root) for root in (spec.submodule_search_locations or [])] if spec else []


def find(relative: str) -> Path | None:
    """The first existing ``<root>/<relative>`` over roots(), or None."""
    for root in roots():
        candidate = root / relative
        if candidate.exists():
            return candidate
    return None
