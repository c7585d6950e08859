"""Byte sizes written the way people write them: "192MiB", "1 GiB", "4G", 201326592."""

from __future__ import annotations

import re

# Multi-letter units are case-insensitive. A single letter follows vLLM's own
# flags (--kv-cache-memory-bytes 4G is 4 GiB), where "4g" would mean 4e9 bytes:
# too easy to misread, so lowercase single letters are refused.
_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1 << 10, "kb": 1000,
    "mib": 1 << 20, "mb": 1000**2,
    "gib": 1 << 30, "gb": 1000**3,
    "tib": 1 << 40, "tb": 1000**4,
}
_VLLM_LETTERS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def _unit_bytes(unit: str) -> int | None:
    if len(unit) == 1 and unit.lower() != "b":
        return _VLLM_LETTERS.get(unit)
    return _UNITS.get(unit.lower())


def parse_size(value: int | str) -> int:
    """Return a byte count; raise ValueError naming the value if it is not a size."""
    if isinstance(value, bool):  # bool is an int subclass; True is not a size
        raise ValueError(f"not a byte size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"negative byte size: {value!r}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"not a byte size: {value!r}")
    match = _SIZE.match(value)
    if not match or _unit_bytes(match.group(2)) is None:
        raise ValueError(f"not a byte size: {value!r} (write e.g. '192MiB', '4G' or 201326592)")
    number, unit = match.groups()
    scaled = float(number) * _unit_bytes(unit)
    if scaled != int(scaled):
        raise ValueError(f"byte size is not a whole number of bytes: {value!r}")
    return int(scaled)


def looks_like_size(value: object) -> bool:
    """True for strings with a unit ("192MiB"); bare numbers are left as numbers."""
    if not isinstance(value, str):
        return False
    match = _SIZE.match(value)
    return bool(match and match.group(2) and _unit_bytes(match.group(2)) is not None)


def format_mib(n_bytes: float | None) -> str:
    return "—" if n_bytes is None else f"{n_bytes / (1 << 20):,.1f} MiB"
