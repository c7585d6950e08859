"""The current-standing table: one row per measured configuration, generated from artifacts.

    edge-harness standing                 # print the table for the runs in STANDING_RUNS
    edge-harness standing --update FILE   # rewrite the table between the markers in FILE

Which runs stand now is a list of results directories (``STANDING_RUNS``, one per line,
relative to the repository). Every figure is a median over the run's passes, with the
spread; ratios against llama.cpp are taken pass by pass within the same run (arm / the
run's llama.cpp arm). A run whose summary is not ``ok`` is refused by name.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from vllm_omni_edge_bench.harness.provenance import PROJECT_ROOT
from vllm_omni_edge_bench.harness.report import load_artifacts
from vllm_omni_edge_bench.harness.stats import spread

STANDING_RUNS = PROJECT_ROOT / "docs" / "edge" / "standing-runs.txt"
BEGIN, END = "<!-- standing:begin (edge-harness standing --update) -->", "<!-- standing:end -->"


class StandingError(ValueError):
    """A listed run that cannot stand in the table."""


def _listed(path: Path) -> list[list[str]]:
    lines = [line.split("#", 1)[0].split() for line in path.read_text().splitlines()]
    return [words for words in lines if words]


def listed_runs(path: Path = STANDING_RUNS) -> list[Path]:
    """The results directories, in order (each line's first word)."""
    return [PROJECT_ROOT / words[0] for words in _listed(path)]


def listed_arms(path: Path = STANDING_RUNS) -> dict[Path, tuple[str, ...]]:
    """The arms a line names after its directory (the table keeps only those); a line
    that names none keeps every arm."""
    return {PROJECT_ROOT / words[0]: tuple(words[1:]) for words in _listed(path) if len(words) > 1}


# /proc/cpuinfo vendor_id -> the name the table shows.
VENDORS = {"GenuineIntel": "Intel", "AuthenticAMD": "AMD"}


def _box(art: dict[str, Any]) -> str:
    cpu = art["provenance"]["cpu"]
    flags = cpu.get("kernel_flags", {})
    isa = "AMX" if flags.get("amx_tile") else "AVX-512 VNNI" if flags.get("avx512_vnni") else "AVX2"
    box = f"{cpu.get('physical_cores')}-core {isa}"
    if cpu.get("family") is not None:  # runs before provenance recorded it name the ISA only
        vendor = VENDORS.get(cpu.get("vendor"), cpu.get("vendor"))
        words = [vendor] if vendor else []
        box += " (" + " ".join(words + [f"family {cpu['family']} model {cpu.get('model')}"]) + ")"
    return box


def _figure(fig: dict[str, Any] | None, digits: int = 1) -> str:
    if fig is None:
        return "–"
    if fig["unit"] == "bytes":
        scale, unit = 1 << 20, " MiB"
        return f"{fig['median'] / scale:,.0f}{unit} ({fig['min'] / scale:,.0f}–{fig['max'] / scale:,.0f})"
    return f"{fig['median']:,.{digits}f} ({fig['min']:,.{digits}f}–{fig['max']:,.{digits}f})"


def _ratio(ours: dict[str, Any] | None, theirs: dict[str, Any] | None) -> str:
    if ours is None or theirs is None or len(ours["values"]) != len(theirs["values"]):
        return "–"
    ratios = [a / b for a, b in zip(ours["values"], theirs["values"]) if b]
    if len(ratios) != len(ours["values"]):
        return "–"
    r = spread(ratios)
    return f"{r['median']:.2f}× ({r['min']:.2f}–{r['max']:.2f})"


def _named(table: dict[str, Any], prefix: str) -> dict[str, Any] | None:
    return next((fig for name, fig in table.items() if name.startswith(prefix) and "(engine)" not in name), None)


def _what_runs(art: dict[str, Any], arm: dict[str, Any]) -> str:
    if arm.get("engine") == "llamacpp":
        return f"llama.cpp ({Path(arm['model']).name.split('.')[-2]}, {arm['llamacpp']['n_threads']} threads)"
    if arm.get("user_command"):
        first = next((r["result"]["command"] for r in art["passes"]
                      if r["arm"] == arm["name"] and r.get("result") and r["result"].get("command")), None)
        if first:
            return "`" + re.sub(r"/\S+/(?=[^/\s]+)", "", re.sub(r" --port \d+", " --port P", first)) + "`"
    flags = " ".join(f"{k}={v}" for k, v in (arm.get("env") or {}).items())
    return f"{arm['name']}" + (f" ({flags})" if flags else "")


def rows(results_dir: Path, arms: tuple[str, ...] = ()) -> list[str]:
    art = load_artifacts(results_dir)
    unknown = set(arms) - {a["name"] for a in art["grid"]["arms"]}
    if unknown:
        raise StandingError(f"{results_dir.name}: no arm {', '.join(sorted(unknown))} in this run")
    summary = art["summary"]
    if summary["status"] != "ok":
        raise StandingError(f"{results_dir.name}: status {summary['status']}: {'; '.join(summary['reasons'][:3])}")
    figures, wanted = summary["arms"], arms
    llama = next((a["name"] for a in art["grid"]["arms"] if a.get("engine") == "llamacpp"), None)
    base = figures.get(llama, {})
    out = []
    for arm in art["grid"]["arms"]:
        if wanted and arm["name"] not in wanted:
            continue
        table = figures[arm["name"]]
        decode, prefill = _named(table, "tg"), _named(table, "pp")
        is_base = arm["name"] == llama
        out.append(" | ".join([
            "", Path(arm["model"]).name if arm.get("engine") == "llamacpp" else arm["model"],
            _what_runs(art, arm), _figure(decode), "1" if is_base else _ratio(decode, _named(base, "tg")),
            _figure(prefill, 0), "1" if is_base else _ratio(prefill, _named(base, "pp")),
            _figure(table.get("cold_start")), _figure(table.get("tree PSS steady")),
            f"{_box(art)}, `{results_dir.name}`", ""]).strip())
    return out


def render(runs: list[Path], arms: dict[Path, tuple[str, ...]] | None = None) -> str:
    head = ["| model | what runs | decode tok/s | × llama.cpp | prefill tok/s | × llama.cpp | start to first token, s "
            "| tree PSS | box, run |", "|---|---|---|---|---|---|---|---|---|"]
    body = [row for run in runs for row in rows(run, (arms or {}).get(run, ()))]
    note = ("Medians over the run's passes (min–max); ratios pass by pass against llama.cpp in the same run; "
            "a command in backticks is the user's literal command, no environment flags; PSS over the whole "
            "process tree; start is a warm start (compile cache filled).")
    return "\n".join([*head, *body, "", note])


def update(path: Path, table: str) -> bool:
    """Rewrite the block between the markers; True if the file changed."""
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise StandingError(f"{path}: no {BEGIN!r} ... {END!r} block to rewrite")
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    new = text[:start] + "\n" + table + "\n" + text[end:]
    if new != text:
        path.write_text(new)
    return new != text


def current_block(path: Path) -> str:
    text = path.read_text()
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip("\n")
