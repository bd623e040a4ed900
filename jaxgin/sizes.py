"""Byte sizes written by people: the one parser behind ``initialize(heap_size=...)``, the
``JAXGIN_*_BYTES`` settings and every size on the command line of ``python -m jaxgin.stress``,
the benchmarks, the examples and the tools.

A size is a whole number of bytes, as an int or a string: ``4096``, ``"4096"``, ``"4096B"``, or a
whole number and a unit: ``KiB``, ``MiB``, ``GiB`` (powers of 1024) or ``KB``, ``MB``, ``GB``
(powers of 1000), in any case, with or without a space (``"64KiB"``, ``"64 kib"``, ``"1 GiB"``).
Fractions (``"1.5GiB"``), other units and a bare ``K`` / ``M`` / ``G`` (1000 or 1024?) are refused
with an error that names the argument and these forms.
"""

from __future__ import annotations

import argparse
import re

UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
FORMS = ("a whole number of bytes (65536) or a whole number and a unit: KiB, MiB, GiB (powers of 1024) or KB, MB, "
         "GB (powers of 1000), e.g. '64KiB', '1 GiB'")
_PATTERN = re.compile(r"\s*(\d+)\s*([KMG]i?B|B)?\s*", flags=re.IGNORECASE)


def parse_size(value: int | str, name: str = "heap_size", *, minimum: int = 1) -> int:
    """Bytes from an int or a string such as '512MiB', '64KB' or '2 GiB' (see the module docstring).

    `name` is what error messages call the value (an argument, an option, a variable); sizes
    below `minimum` are refused."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a byte count or a string like '1GiB', got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        match = _PATTERN.fullmatch(value)
        if match is None:
            hint = ""
            if re.fullmatch(r"\s*\d+\s*[KMG]\s*", value, flags=re.IGNORECASE):
                hint = " (a bare K, M or G could mean powers of 1000 or of 1024: write KiB or KB)"
            raise ValueError(f"{name}={value!r} is not a size{hint}; write {FORMS}")
        size = int(match.group(1)) * UNITS[(match.group(2) or "").lower()]
    else:
        raise TypeError(f"{name} must be a byte count or a string like '1GiB', got {type(value).__name__}")
    if size < minimum:
        if minimum == 1:
            raise ValueError(f"{name} must be positive, got {value!r}")
        raise ValueError(f"{name} must be at least {minimum} bytes, got {value!r} ({size} bytes)")
    return size


def argument(name: str, *, minimum: int = 1):
    """An argparse ``type=`` for a size option: ``parser.add_argument("--max-bytes",
    type=sizes.argument("--max-bytes"))``; a bad value stops the command with argparse's usage
    line and parse_size's message."""

    def parse(text: str) -> int:
        try:
            return parse_size(text, name, minimum=minimum)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = "size"
    return parse
