"""Pick the cpu_int4 path per CPU class and phase from the measured table.

The table (``measured_paths.json`` beside this file) is generated from kernel benchmark
artifacts by the harness (``edge-harness routing-table``; never typed by hand):
each row is one path's time for one phase on one CPU class, with the artifact it
came from. CPU classes this project could not measure carry "assumed" rows that
say where the assumption comes from.

A layer keeps one packed layout, so the kernel that runs it is the one ranked
fastest for **decode** (one token at a time is the edge workload); kernels whose decode
spread overlaps the fastest's count as tied and go by prefill. The prefill
ranking is reported too: where a dense copy (the second layout,
``VLLM_OMNI_EDGE_INT4_LAYOUTS=two``) or another kernel would prefill faster, the
decision says by how much, so the memory-for-prefill trade is the user's, with the
number in hand. ``VLLM_OMNI_EDGE_INT4_KERNEL`` overrides the router.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from vllm_omni_edge.cpu_features import CpuFeatures
from vllm_omni_edge.routing.cpu_classes import routing_class

TABLE_PATH = Path(__file__).with_name("measured_paths.json")
DENSE = "dense"  # the second layout: F.linear on a dense copy
# What the table may rank: the cpu_int4 kernels' names and the dense copy.
PATHS = ("amx_w4a8", "int4pack", "avx2_w4a8", "avx2_w4a8_rows8", "avx512_w4a8_rows16", "dequant", DENSE)
PHASES = ("decode", "prefill")


class RoutingTableError(ValueError):
    """The shipped table is missing or malformed."""


@dataclass(frozen=True)
class Row:
    cpu_class: str
    phase: str
    path: str
    status: str  # "measured" | "assumed"
    median_ms: float | None
    min_ms: float | None
    max_ms: float | None
    source: str  # the artifact (measured) or the reason (assumed)


@dataclass(frozen=True)
class Decision:
    cpu_class: str
    decode_order: tuple[str, ...]
    prefill_order: tuple[str, ...]
    status: str
    source: str
    prefill_note: str

    def as_dict(self) -> dict:
        return asdict(self)


@functools.cache
def load_table(path: Path = TABLE_PATH) -> tuple[Row, ...]:
    try:
        data = json.loads(Path(path).read_text())
        return tuple(Row(**row) for row in data["rows"])
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as exc:
        raise RoutingTableError(f"routing table {path} is unreadable: {exc}") from exc


def ranked(rows: tuple[Row, ...], cpu_class: str, phase: str) -> list[Row]:
    """This class's rows for one phase, fastest first; measured rows outrank assumed ones."""
    mine = [r for r in rows if r.cpu_class == cpu_class and r.phase == phase]
    measured = sorted((r for r in mine if r.status == "measured"), key=lambda r: r.median_ms)
    return measured or [r for r in mine if r.status == "assumed"]


def tie_broken_by_prefill(kernels: list[Row], prefill: list[Row]) -> list[Row]:
    """Kernels whose decode min–max overlaps the fastest's are tied; the faster prefill goes first.

    On a shared box a decode median alone ranks a tie by noise: on the AMX box the 4-bit
    paths decoded within each other's spread (memory-bound) while their prefill differed
    2-4x (kernel_bench, 2026-12-02).
    """
    if not kernels or kernels[0].status != "measured" or kernels[0].max_ms is None:
        return kernels
    fastest = kernels[0]
    tied = [r for r in kernels if r.min_ms is not None and r.min_ms <= fastest.max_ms]
    prefill_ms = {r.path: r.median_ms for r in prefill if r.median_ms is not None}
    tied.sort(key=lambda r: prefill_ms.get(r.path, float("inf")))
    return tied + [r for r in kernels if r not in tied]


def decide(cpu_class: str, rows: tuple[Row, ...] | None = None) -> Decision:
    rows = load_table() if rows is None else rows
    decode, prefill = ranked(rows, cpu_class, "decode"), ranked(rows, cpu_class, "prefill")
    if not decode:
        decode = prefill = ranked(rows, "other", "decode")  # unknown class: the any-CPU row
    kernels = tie_broken_by_prefill([r for r in decode if r.path != DENSE], prefill)
    status = kernels[0].status if kernels else "assumed"
    note = ""
    if prefill and kernels and prefill[0].path != kernels[0].path and prefill[0].median_ms and status == "measured":
        chosen = next((r for r in prefill if r.path == kernels[0].path), None)
        if chosen is not None and chosen.median_ms:
            note = (f"prefill would run {chosen.median_ms / prefill[0].median_ms:.2f}x faster on "
                    f"{prefill[0].path}" + (" (VLLM_OMNI_EDGE_INT4_LAYOUTS=two keeps that copy)"
                                            if prefill[0].path == DENSE else ""))
    return Decision(
        cpu_class=cpu_class,
        decode_order=tuple(r.path for r in kernels),
        prefill_order=tuple(r.path for r in prefill),
        status=status,
        source=kernels[0].source if kernels else "no row",
        prefill_note=note,
    )


@functools.cache
def decision_for(cpu_class: str) -> Decision:
    """``decide`` on the shipped table, once per class (every layer asks)."""
    return decide(cpu_class)


def decision_for_this_cpu() -> Decision:
    return decision_for(routing_class(CpuFeatures.detect()))


def routed_order(features: CpuFeatures) -> tuple[str, ...]:
    """Kernel names, fastest first for decode on these features' CPU class (what kernels ask)."""
    return decision_for(routing_class(features)).decode_order


def route_summary(features: CpuFeatures) -> str:
    """The decision for these features' class in one line, for a kernel choice's reason."""
    d = decision_for(routing_class(features))
    note = f"; {d.prefill_note}" if d.prefill_note else ""
    return f"{d.cpu_class} {d.status}: decode order {'>'.join(d.decode_order)}{note}"
