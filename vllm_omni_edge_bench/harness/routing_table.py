"""Write the product's routing table (``vllm_omni_edge/routing/measured_paths.json``) from
kernel-path artifacts kept beside this module.

    edge-harness routing-table              # regenerate the shipped table and docs/edge/routing.md's copy
    edge-harness routing-table --check      # exit 1 if either is not what the sources give

``routing_sources/`` holds one ``<run>.json`` per kernel benchmark run that feeds the table (a
byte-for-byte copy of ``results/<run>/kernel_paths.json``, written by ``kernel_bench``) and
``assumed.json``, the ranks for CPU classes no artifact covers. When several artifacts cover
the same class and phase, the newest replaces that phase's rows whole. Only paths the product
can run (its kernels and the dense second layout) are ranked, so removing a kernel from the
product removes its rows at the next regeneration. The product only reads the JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_omni_edge.atomic import atomic_write_bytes
from vllm_omni_edge.routing.weight_path import PATHS, PHASES, TABLE_PATH
from vllm_omni_edge_bench.harness.provenance import PROJECT_ROOT

SOURCES = Path(__file__).with_name("routing_sources")
ASSUMED = SOURCES / "assumed.json"
GENERATED_BY = "edge-harness routing-table"
ROUTING_DOC = PROJECT_ROOT / "docs" / "edge" / "routing.md"
BEGIN, END = "<!-- routing-table:begin (edge-harness routing-table) -->", "<!-- routing-table:end -->"


class IncompleteArtifactError(ValueError):
    """A kernel_paths.json timed only some paths or phases: it cannot rank them all."""


def source_artifacts(sources: Path = SOURCES) -> list[Path]:
    return sorted(p for p in sources.glob("*.json") if p != sources / ASSUMED.name)


def runnable_paths() -> frozenset[str]:
    """The paths the product can run: what the router may rank (``weight_path.PATHS``)."""
    return frozenset(PATHS)


def rows_from_artifact(path: Path) -> list[dict]:
    """Every path's time per phase; the row names the run's artifact under ``results/``."""
    record = json.loads(path.read_text())
    if record.get("complete") is False:
        raise IncompleteArtifactError(f"{path} timed a subset (--paths/--phases); it cannot feed the table")
    where = f"results/{path.stem}/kernel_paths.json"
    return [{"cpu_class": record["cpu_class"], "phase": phase, "path": name, "status": "measured",
             "median_ms": s["median_ms"], "min_ms": s["min_ms"], "max_ms": s["max_ms"],
             "source": f"{where} ({record['model']}, {len(s['passes_ms'])} interleaved passes, "
                       f"{record['result']['threads']} threads)"}
            for phase, by_path in record["result"]["summary"].items() for name, s in by_path.items()]


def build_table(artifacts: list[Path], assumed: Path = ASSUMED, paths: frozenset[str] | None = None) -> dict:
    paths = runnable_paths() if paths is None else paths
    # The newest artifact for a class and phase replaces that phase's rows whole: times
    # from different runs (or models) are never ranked against each other.
    measured: dict[tuple[str, str], list[dict]] = {}
    for path in sorted(artifacts, key=lambda p: json.loads(p.read_text())["provenance"]["started"]):
        newest: dict[tuple[str, str], list[dict]] = {}
        for row in rows_from_artifact(path):
            newest.setdefault((row["cpu_class"], row["phase"]), []).append(row)
        measured.update(newest)
    rows = [row for phase_rows in measured.values() for row in phase_rows if row["path"] in paths]
    covered = {row["cpu_class"] for row in rows}
    for cpu_class, entry in json.loads(assumed.read_text())["classes"].items():
        if cpu_class in covered:
            continue
        order = [name for name in entry["order"] if name in paths]
        for phase in PHASES:
            rows += [{"cpu_class": cpu_class, "phase": phase, "path": name, "status": "assumed",
                      "median_ms": None, "min_ms": None, "max_ms": None, "source": f"{entry['why']} (rank {i + 1})"}
                     for i, name in enumerate(order)]
    return {"generated_by": GENERATED_BY, "rows": rows}


def render_json(table: dict) -> str:
    return json.dumps(table, indent=1) + "\n"


def render_markdown(table: dict) -> str:
    lines = ["| CPU class | phase | path | median ms (min-max) | status | source |", "|---|---|---|---|---|---|"]
    for r in sorted(table["rows"], key=lambda r: (r["cpu_class"], r["phase"], r["median_ms"] or 0)):
        t = "-" if r["median_ms"] is None else f"{r['median_ms']:.1f} ({r['min_ms']:.1f}-{r['max_ms']:.1f})"
        lines.append(f"| {r['cpu_class']} | {r['phase']} | {r['path']} | {t} | {r['status']} | {r['source']} |")
    return "\n".join(lines) + "\n"


def with_markdown(doc_text: str, table: dict) -> str:
    """The document with the block between the markers replaced by the table."""
    if BEGIN not in doc_text or END not in doc_text:
        raise ValueError(f"no {BEGIN!r} ... {END!r} block to rewrite")
    start, end = doc_text.index(BEGIN) + len(BEGIN), doc_text.index(END)
    return doc_text[:start] + "\n" + render_markdown(table) + doc_text[end:]


def stale(out: Path = TABLE_PATH, doc: Path = ROUTING_DOC, sources: Path = SOURCES) -> list[Path]:
    """The files that are not what the sources give."""
    table = build_table(source_artifacts(sources), sources / ASSUMED.name)
    files = [(out, render_json(table)), (doc, with_markdown(doc.read_text(), table))]
    return [path for path, text in files if not path.is_file() or path.read_text() != text]


def regenerate(out: Path = TABLE_PATH, doc: Path | None = ROUTING_DOC,
               sources: Path = SOURCES) -> tuple[dict, list[Path]]:
    """Write the table (and the document's copy) from the sources; the files that changed."""
    table = build_table(source_artifacts(sources), sources / ASSUMED.name)
    files = [(out, render_json(table))]
    if doc is not None:
        files.append((doc, with_markdown(doc.read_text(), table)))
    changed = [path for path, text in files if not path.is_file() or path.read_text() != text]
    for path, text in files:
        if path in changed:
            atomic_write_bytes(path, text.encode())
    return table, changed
