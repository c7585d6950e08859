"""docs/edge/results.md: where we stand now, and one line per results directory.

    edge-harness results-index                                   # print the page
    edge-harness results-index --write docs/edge/results.md      # write it
    edge-harness results-index --check docs/edge/results.md      # exit 1 if it is stale

The standing table is the one README carries (``standing.render`` over the runs listed in
docs/edge/standing-runs.txt). The index reads each directory under ``results/``: the date
from its name, what it measured from its artifacts (a grid's description, or the kind of
artifact and its model), the box from its provenance, and links to its report (``report.md``,
or the artifact's own markdown or JSON when the run has no report) and to ``notes.md`` when the
run has notes. Nothing on the page is typed by hand.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import yaml

from vllm_omni_edge_bench.harness import standing
from vllm_omni_edge_bench.harness.provenance import PROJECT_ROOT

RESULTS = PROJECT_ROOT / "results"
PAGE = PROJECT_ROOT / "docs" / "edge" / "results.md"
# Reports in the order a run's own write-up is looked for.
REPORTS = ("report.md", "decode_profile.md", "decode_decompose.md", "step_ab.md", "floor.md", "omni-stages.md")


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().replace("|", "\\|")


def box(cpu: dict[str, Any] | None) -> str:
    """Cores, CPU model and the vector ISA that decides routing, from a provenance ``cpu`` block."""
    if not cpu:
        return "not recorded"
    flags = cpu.get("kernel_flags", {})
    if flags.get("amx_tile"):
        isa = "AMX"
    elif flags.get("avx512_vnni"):
        isa = "AVX-512 VNNI" + (" + AVX-VNNI" if flags.get("avx_vnni") else "")
    elif flags.get("avx512f"):
        isa = "AVX-512"
    elif flags.get("avx2"):
        isa = "AVX2"
    else:
        isa = "no AVX2"
    model = re.sub(r"\((R|TM)\)", "", str(cpu.get("model_name", "CPU")))
    return f"{cpu.get('physical_cores')}-core {model}, {isa}"


def _grid(run: Path) -> tuple[str, dict | None] | None:
    if not (run / "grid.yaml").is_file():
        return None
    description = _one_line(str(yaml.safe_load((run / "grid.yaml").read_text()).get("description") or run.name))
    status = _json(run / "summary.json")["status"] if (run / "summary.json").is_file() else "no summary"
    if status != "ok":
        description += f" (status: {status})"
    provenance = _json(run / "provenance.json") if (run / "provenance.json").is_file() else {}
    return description, provenance.get("cpu")


def _kernel_paths(run: Path) -> tuple[str, dict | None] | None:
    if not (run / "kernel_paths.json").is_file():
        return None
    record = _json(run / "kernel_paths.json")
    phases = " and ".join(record["result"]["summary"])
    subset = ", a subset of paths" if record.get("complete") is False else ""
    model = Path(str(record["model"])).name
    return (f"kernel benchmark for routing ({record['cpu_class']}): {model}, {phases}, "
            f"{record['result']['threads']} thread(s){subset}", record["provenance"].get("cpu"))


def _decode_profile(run: Path) -> tuple[str, dict | None] | None:
    if not (run / "decode_profile.json").is_file():
        return None
    record = _json(run / "decode_profile.json")
    return (f"decode profile (an observation): {record['model_name']}, layout `{record['layout']}`",
            record["provenance"].get("cpu"))


def _decode_decompose(run: Path) -> tuple[str, dict | None] | None:
    if not (run / "decode_decompose.json").is_file():
        return None
    record = _json(run / "decode_decompose.json")
    kwargs = ", ".join(f"{k}={v!r}" for k, v in record["llm_kwargs"].items())
    return (f"decode step split by stubbing ops (an observation): {Path(record['model']).name}, "
            f"`LLM({kwargs})`, {record['rounds']} rounds", record["provenance"].get("cpu"))


def _step_ab(run: Path) -> tuple[str, dict | None] | None:
    if not (run / "step_ab.json").is_file():
        return None
    record = _json(run / "step_ab.json")
    kwargs = ", ".join(f"{k}={v!r}" for k, v in record["llm_kwargs"].items())
    return (f"levers {', '.join(record['levers'])} off at alternate decode steps of one engine (an "
            f"observation): {Path(record['model']).name}, `LLM({kwargs})`, {record['rounds']} requests",
            record["provenance"].get("cpu"))


def _floor(run: Path) -> tuple[str, dict | None] | None:
    if not (run / "floor.json").is_file():
        return None
    record = _json(run / "floor.json")
    return (f"the runtime floor: PSS of each process role's imports ({len(record['profiles'])} profiles)",
            record["provenance"].get("cpu"))


def _omni_stages(run: Path) -> tuple[str, dict | None] | None:
    if not (run / "omni-stages.json").is_file():
        return None
    record = _json(run / "omni-stages.json")["run"]
    cpu = _json(run / "provenance.json").get("cpu") if (run / "provenance.json").is_file() else None
    return (f"vLLM-Omni per-stage memory and latency: {Path(record['model']).name}, arms "
            f"{', '.join(record['arms'])}, {record['passes']} passes", cpu)


def _reliability(run: Path) -> tuple[str, dict | None] | None:
    if not (run / "findings.json").is_file():
        return None
    record = _json(run / "findings.json")
    return f"reliability findings over the OpenAI server: {', '.join(k for k in record if k != 'recorded_at')}", None


def _gguf_check(run: Path) -> tuple[str, str] | None:
    if not (run / "check.json").is_file():
        return None
    record = _json(run / "check.json")
    return f"GGUF file converted and scored against llama.cpp: {_one_line(record['source'])}", record["box"]


def _gguf_requant(run: Path) -> tuple[str, dict | None] | None:
    if not (run / "requant.json").is_file():
        return None
    record = _json(run / "requant.json")
    cpu = _json(run / "provenance.json").get("cpu") if (run / "provenance.json").is_file() else None
    return (f"GGUF re-quantized to cpu_int4, KLD against the GGUF's own dequantization: "
            f"{record['label']} ({len(record['results'])} file(s))", cpu or record.get("box"))


def _spoken_question(run: Path) -> tuple[str, dict | str | None] | None:
    if not (run / "spoken_question.json").is_file():
        return None
    record = _json(run / "spoken_question.json")
    # Runs written before the measure recorded provenance name their box in notes.md.
    where = record["provenance"].get("cpu") if "provenance" in record else "named in notes.md"
    return (f"spoken question over vLLM-Omni (tests/omni/spoken_question_measure.py): Whisper "
            f"{record.get('asr', 'float')} -> {record['answer_model']}, {len(record['passes'])} passes, "
            f"per-stage PSS and latency", where)


def _int4_prefill_bench(run: Path) -> tuple[str, dict | str | None] | None:
    if not (run / "int4_prefill_bench.json").is_file():
        return None
    record = _json(run / "int4_prefill_bench.json")
    rows = ", ".join(record["layer_ms"])
    gemms = "oneDNN and AMX tiles" if "amx" in next(iter(record["layer_ms"].values()), {}) else "oneDNN"
    return (f"rows16 prefill threshold sweep (int4_prefill_bench): W4A8 tiles vs bf16 path ({gemms}) vs dense "
            f"at {rows} rows, {record['threads']} threads; the bf16 path on "
            f"{ {'bf16': 'oneDNN', 'amx': 'AMX tiles'}[record.get('crossover_gemm', 'bf16')]} wins from "
            f"{record['crossover_rows']}",
            record.get("cpu") or "named in notes.md")


KINDS: tuple[Callable[[Path], tuple[str, Any] | None], ...] = (
    _grid, _kernel_paths, _decode_profile, _decode_decompose, _step_ab, _floor, _omni_stages, _reliability, _gguf_check, _gguf_requant,
    _spoken_question, _int4_prefill_bench)


def describe(run: Path) -> tuple[str, str]:
    """What a run measured and the box it ran on."""
    for kind in KINDS:
        found = kind(run)
        if found is not None:
            what, where = found
            return what, where if isinstance(where, str) else box(where)
    raise FileNotFoundError(f"{run}: no artifact the index knows how to read")


def _link(run: Path, name: str, page_dir: Path) -> str:
    target = run / name
    relative = Path(*[".."] * len(page_dir.relative_to(PROJECT_ROOT).parts)) / target.relative_to(PROJECT_ROOT)
    return f"[{name}]({relative.as_posix()})"


def index_row(run: Path, page_dir: Path) -> str:
    what, where = describe(run)
    report = next((name for name in REPORTS if (run / name).is_file()), None)
    if report is None:
        report = next(p.name for p in sorted(run.glob("*.json")))
    links = [_link(run, report, page_dir)]
    if (run / "notes.md").is_file():
        links.append(_link(run, "notes.md", page_dir))
    return f"| {run.name[:10]} | `{run.name}` | {what} | {where} | {', '.join(links)} |"


def runs(results: Path = RESULTS) -> list[Path]:
    """Every results directory, newest first."""
    return sorted((p for p in results.iterdir() if p.is_dir()), key=lambda p: p.name, reverse=True)


def render(results: Path = RESULTS, page: Path = PAGE) -> str:
    table = standing.render(standing.listed_runs(), standing.listed_arms())
    rows = [index_row(run, page.parent) for run in runs(results)]
    return "\n".join([
        "# Results",
        "",
        "Generated by `edge-harness results-index --write docs/edge/results.md` from the artifacts under "
        "`results/`; do not edit by hand. Each run's own report stays with its artifacts; `notes.md` beside it "
        "holds what the run showed, written when it ran. Figures from different boxes are not compared with "
        "each other; how each figure is taken is in [methodology.md](methodology.md).",
        "",
        "## Where we stand",
        "",
        "The runs listed in [standing-runs.txt](standing-runs.txt) (the same table as README's):",
        "",
        table,
        "",
        "## Runs",
        "",
        "One line per results directory, newest first. The box is read from the run's provenance "
        "(cores, CPU model, the vector ISA routing goes by).",
        "",
        "| date | run | what it measured | box | report |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ])
