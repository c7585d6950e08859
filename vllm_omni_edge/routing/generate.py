"""Write the routing table from kernel-path artifacts: ``measured_paths.json``.

    python -m vllm_omni_edge.routing.generate results/*-kernel-paths-*/kernel_paths.json

Each artifact (``vllm_omni_edge_bench/harness/kernel_bench.py``) gives, for one CPU class,
every path's time per phase over interleaved passes. When several artifacts cover
the same class and phase, the newest wins. Paths an artifact timed that the plugin no
longer has (not in ``weight_path.PATHS``) are left out: the router cannot offer them. Classes with no artifact get the
"assumed" rows below, each saying where the assumption comes from.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vllm_omni_edge.atomic import atomic_write_bytes
from vllm_omni_edge.routing.weight_path import PATHS, TABLE_PATH

PROJECT_ROOT = Path(__file__).resolve().parents[2]

# Unmeasured classes: order from the one-off microbenchmark in shared/notes/field-measurements.md
# (AMX Xeon, Qwen2.5-1.5B MLP shapes, group 128) and from which kernels exist per class.
ASSUMED = {
    "x86-amx": (["amx_w4a8", "int4pack", "avx2_w4a8", "dequant"],
                "assumed: field-notes microbenchmark on an AMX Xeon (W4A8 0.17 ms vs tinygemm 0.38 ms "
                "at decode shapes; W4A8 near bf16 at prefill, tinygemm ~11x slower); not a harness artifact"),
    "x86-avx512-vnni": (["int4pack", "avx512_w4a8_rows16", "avx2_w4a8", "dequant"],
                        "assumed: superseded by a measured row (AMD EPYC Zen 5, 2026-12-02)"),
    "x86-avx512": (["int4pack", "avx2_w4a8", "dequant"],
                   "assumed: tinygemm has AVX-512 kernels, our op only AVX2 code; not measured here"),
    "x86-avx2": (["int4pack", "avx2_w4a8", "dequant"], "assumed: superseded by a measured row"),
    "other": (["dequant"], "assumed: only the pure-PyTorch fallback runs on any CPU"),
}


class IncompleteArtifactError(ValueError):
    """A kernel_paths.json timed only some paths or phases: it cannot rank them all."""


def rows_from_artifact(path: Path) -> list[dict]:
    record = json.loads(path.read_text())
    if record.get("complete") is False:
        raise IncompleteArtifactError(f"{path} timed a subset (--paths/--phases); it cannot feed the table")
    try:
        where = str(path.resolve().relative_to(PROJECT_ROOT))
    except ValueError:
        where = str(path)
    rows = []
    for phase, by_path in record["result"]["summary"].items():
        for name, s in by_path.items():
            if name not in PATHS:
                continue
            rows.append({"cpu_class": record["cpu_class"], "phase": phase, "path": name, "status": "measured",
                         "median_ms": s["median_ms"], "min_ms": s["min_ms"], "max_ms": s["max_ms"],
                         "source": f"{where} ({record['model']}, {len(s['passes_ms'])} interleaved passes, "
                                   f"{record['result']['threads']} threads)"})
    return rows


def build_table(artifacts: list[Path]) -> dict:
    # The newest artifact for a class and phase replaces that phase's rows whole: times
    # from different runs (or models) are never ranked against each other.
    measured: dict[tuple[str, str], list[dict]] = {}
    for path in sorted(artifacts, key=lambda p: json.loads(p.read_text())["provenance"]["started"]):
        newest: dict[tuple[str, str], list[dict]] = {}
        for row in rows_from_artifact(path):
            newest.setdefault((row["cpu_class"], row["phase"]), []).append(row)
        measured.update(newest)
    rows = [row for phase_rows in measured.values() for row in phase_rows]
    covered = {row["cpu_class"] for row in rows}
    for cpu_class, (order, why) in ASSUMED.items():
        if cpu_class in covered:
            continue
        for phase in ("decode", "prefill"):
            rows += [{"cpu_class": cpu_class, "phase": phase, "path": name, "status": "assumed",
                      "median_ms": None, "min_ms": None, "max_ms": None, "source": f"{why} (rank {i + 1})"}
                     for i, name in enumerate(order)]
    return {"generated_by": "python -m vllm_omni_edge.routing.generate", "rows": rows}


def render_markdown(table: dict) -> str:
    lines = ["| CPU class | phase | path | median ms (min-max) | status | source |", "|---|---|---|---|---|---|"]
    for r in sorted(table["rows"], key=lambda r: (r["cpu_class"], r["phase"], r["median_ms"] or 0)):
        t = "-" if r["median_ms"] is None else f"{r['median_ms']:.1f} ({r['min_ms']:.1f}-{r['max_ms']:.1f})"
        lines.append(f"| {r['cpu_class']} | {r['phase']} | {r['path']} | {t} | {r['status']} | {r['source']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", nargs="+", type=Path, help="kernel_paths.json files")
    parser.add_argument("--out", type=Path, default=TABLE_PATH)
    parser.add_argument("--markdown", action="store_true", help="also print the table as markdown")
    args = parser.parse_args(argv)
    table = build_table(args.artifacts)
    atomic_write_bytes(args.out, (json.dumps(table, indent=1) + "\n").encode())
    if args.markdown:
        sys.stdout.write(render_markdown(table))
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
