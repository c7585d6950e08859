"""report.md and PNGs from a results directory, and from nothing else.

Tables follow llama-bench: one row per arm and figure, median with its spread,
the ratio to the control arm, and what really ran (from the worker's evidence,
not from what the arm asked for). A grid that is not ``ok`` gets its status and
reasons instead of medians.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from vllm_omni_edge_bench.harness.stats import OK, spread, summarise
from vllm_omni_edge_bench.harness.sizes import format_mib

ROLES_ORDER = ("frontend", "engine_core", "worker", "resource_tracker", "other", "harness_client")
USER_MARK = "†"
USER_MARK_TEXT = (f"{USER_MARK} user_command arm: its figures come from the user's literal command (below the "
                  "Arms table), with no environment flags and no harness flags")


def load_artifacts(results_dir: Path) -> dict[str, Any]:
    results_dir = Path(results_dir)
    provenance = json.loads((results_dir / "provenance.json").read_text())
    passes = [json.loads(p.read_text()) for p in sorted((results_dir / "passes").glob("*.json"))]
    passes.sort(key=lambda r: r["seq"])
    grid = provenance["effective_grid"]
    summary_path = results_dir / "summary.json"
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
    else:  # the run was cut short before writing it
        summary = summarise(passes, [a["name"] for a in grid["arms"]], grid["control"], grid["passes"])
    primes = {r["arm"]: r for r in (json.loads(p.read_text())
                                    for p in sorted((results_dir / "prime" / "passes").glob("*.json")))}
    return {"dir": results_dir, "provenance": provenance, "passes": passes, "grid": grid, "summary": summary,
            "primes": primes}


def _order_text(grid: dict) -> str:
    """How the passes were ordered beyond plain interleaving, for the report's header."""
    ways = [way for key, way in (("rotate_start", "rotating start"),
                                 ("reverse_alternate", "every other pass reversed")) if grid.get(key)]
    return f" with {' and '.join(ways)}" if ways else ""


def _prime_text(art: dict[str, Any]) -> str:
    """Each primed arm's status, with why it was not ok: an invalid prime is often the start
    that compiled, which the reader should see rather than take on trust."""
    parts = []
    for arm, status in art["provenance"]["primed"].items():
        reasons = (art.get("primes", {}).get(arm) or {}).get("reasons") or []
        parts.append(f"{arm} {status}" + (f" ({'; '.join(reasons[:2])})" if status != "ok" and reasons else ""))
    return ", ".join(parts)


def format_value(value: float, unit: str) -> str:
    if unit == "bytes":
        return format_mib(value)
    if unit == "tok/s":
        return f"{value:,.1f} tok/s"
    if unit == "ms":
        return f"{value:,.1f} ms"
    if unit == "s":
        return f"{value:,.2f} s"
    if unit == "fraction":
        return f"{value:.3f}"
    if unit == "x real time":
        return f"{value:,.2f}× real time"
    return f"{value:,.4g} {unit}"


def _llamacpp_backend(result: dict[str, Any], workers: list[dict[str, Any]]) -> str:
    """llama.cpp: compiled SIMD, weight buffer types (CPU_Mapped = mmap'd file, CPU_REPACK, AMX), file type, threads."""
    capability = (result.get("versions") or {}).get("cpu_capability", "?")
    if not workers:
        return f"llama.cpp {capability} (no evidence)"
    worker = workers[0]
    parts = [f"llama.cpp {worker.get('llama_cpp_python', '?')} {capability}",
             "weights " + "+".join(worker.get("weight_buffer_types") or ["?"]),
             (worker.get("settings") or {}).get("print_info.file type", "?"),
             f"{worker.get('n_threads')} threads", f"flash_attn {worker.get('flash_attn')}"]
    if worker.get("repacked_tensors"):
        parts.append(f"{worker['repacked_tensors']} tensors repacked ({'/'.join(worker.get('repack_layouts') or [])})")
    return ", ".join(str(p) for p in parts)


IN_PROCESS_SPEECH = ("faster-whisper", "whispercpp")


def _speech_backend(result: dict[str, Any], workers: list[dict[str, Any]]) -> str:
    """faster-whisper / whisper.cpp: version, effective compute type or file type, threads, concurrency."""
    if not workers:
        return f"{result.get('engine')} (no evidence)"
    w = workers[0]
    if w.get("engine") == "faster-whisper":
        parts = [f"faster-whisper {w.get('faster_whisper')} (CTranslate2 {w.get('ctranslate2')})",
                 f"compute {w.get('compute_type')}", f"{w.get('cpu_threads')} threads x {w.get('num_workers')} workers"]
    elif w.get("engine") == "whispercpp":
        simd = [f for f in ("AVX512", "AVX2", "AVX") if f"{f} = 1" in (w.get("system_info") or "")]
        parts = [f"whisper.cpp (pywhispercpp {w.get('pywhispercpp')})", simd[0] if simd else "scalar",
                 f"ggml {w.get('ftype')}", f"{w.get('n_threads')} threads", "one context"]
    else:
        parts = [str(w.get("engine"))]
    return ", ".join(str(p) for p in parts)


def backend_of_pass(record: dict[str, Any]) -> str:
    """What ran, from the worker's evidence; what was configured only if there is none."""
    result = record.get("result") or {}
    if result.get("engine") == "llamacpp":
        return _llamacpp_backend(result, (record.get("evidence") or {}).get("workers") or [])
    if result.get("engine") in IN_PROCESS_SPEECH:
        return _speech_backend(result, (record.get("evidence") or {}).get("workers") or [])
    capability = (result.get("versions") or {}).get("cpu_capability", "?")
    workers = (record.get("evidence") or {}).get("workers") or []
    if not workers:
        eager = (result.get("frontend_config") or {}).get("enforce_eager")
        configured = "eager" if eager else "compiled" if eager is False else "?"
        return f"{capability}, configured {configured} (no worker evidence)"
    worker = workers[0]
    parts = [capability, "compiled" if worker.get("compiled") else "eager"]
    if worker.get("amx_tiles"):
        parts.append("AMX tiles")
    dtypes = worker.get("weights_bytes_by_dtype") or {}
    if dtypes:
        parts.append("weights " + "+".join(sorted(dtypes)))
    for name, kernel in sorted((worker.get("kernels") or {}).items()):
        parts.append(f"{name}={kernel}")
    return ", ".join(str(p) for p in parts)


def backend_of_arm(passes: list[dict[str, Any]], arm: str) -> str:
    seen = sorted({backend_of_pass(r) for r in passes if r["arm"] == arm and r.get("result")})
    if not seen:
        return "—"
    return seen[0] if len(seen) == 1 else "varies by pass: " + " | ".join(seen)


def _ratio_text(ratio: dict[str, Any] | None) -> str:
    if not ratio:
        return ""
    return f"{ratio['median']:.3f}× ({ratio['min']:.3f}–{ratio['max']:.3f})"


def _header(art: dict[str, Any]) -> list[str]:
    prov, grid, summary = art["provenance"], art["grid"], art["summary"]
    git = prov.get("git") or {}
    cpu = prov.get("cpu") or {}
    sha = (git.get("sha") or "no commit")[:12] + (" (dirty)" if git.get("dirty") else "")
    packages = ", ".join(f"{k} {v or 'not installed'}" for k, v in (prov.get("packages") or {}).items())
    lines = [f"# {grid['name']}: {summary['status']}", ""]
    if (prov.get("overrides") or {}).get("smoke"):
        lines += [f"**Smoke run** (`--smoke`, {grid['passes']} pass(es) per arm): it shows the arms run; "
                  "its figures are not measurements and are not to be published.", ""]
    if grid.get("description"):
        lines += [grid["description"], ""]
    lines += [
        f"- passes: {grid['passes']} per arm, interleaved{_order_text(grid)}; "
        f"control: `{grid['control']}`",
        *([f"- primed (one unmeasured pass per vLLM arm before the passes): "
           + _prime_text(art)] if prov.get("primed") else []),
        f"- run: {prov.get('started')} → {prov.get('finished')}; code {sha}",
        f"- packages: {packages}",
        f"- CPU: {cpu.get('model_name')}, {cpu.get('logical_cpus')} logical CPUs, "
        f"PyTorch capability {cpu.get('torch_cpu_capability')}; memory {format_mib((prov.get('memory') or {}).get('total_bytes'))}",
        f"- command: `{' '.join(prov.get('command', []))}`",
        "",
    ]
    return lines


def _user_arms(art: dict[str, Any]) -> list[str]:
    return [a["name"] for a in art["grid"]["arms"] if a.get("user_command")]


def _arm_label(art: dict[str, Any], arm: str) -> str:
    return f"{arm} {USER_MARK}" if arm in _user_arms(art) else arm


def _user_commands(art: dict[str, Any]) -> list[str]:
    """Each user_command arm's command as its first pass ran it, and the notes its passes left."""
    lines = []
    for arm in _user_arms(art):
        results = [r["result"] for r in art["passes"] if r["arm"] == arm and r.get("result")]
        first = next((r for r in results if r.get("command")), None)
        lines.append(f"- {arm}: " + (f"`{first['command']}` (as pass {first['pass_index']} ran it)"
                                      if first else "no pass recorded its command"))
        notes = dict.fromkeys(note for r in results for note in r.get("notes") or [])
        lines += [f"  - note: {note}" for note in notes]
    return ["", USER_MARK_TEXT + ":", "", *lines] if lines else []


def _arms_table(art: dict[str, Any]) -> list[str]:
    lines = ["## Arms: what each asked for", "", "| arm | engine | model | llm_kwargs | env | expect |",
             "|---|---|---|---|---|---|"]
    for arm in art["grid"]["arms"]:
        def inline(mapping: dict) -> str:
            return ", ".join(f"{k}={v}" for k, v in mapping.items()) or "—"

        control = " (control)" if arm["name"] == art["grid"]["control"] else ""
        lines.append(f"| {_arm_label(art, arm['name'])}{control} | "
                     f"{arm['engine']} | {arm['model']} | {inline(arm['llm_kwargs'] or arm.get('llamacpp') or arm.get('faster_whisper') or arm.get('whispercpp') or {})} | {inline(arm['env'])} | "
                     f"{inline(arm['expect'])} |")
    return lines + _user_commands(art) + [""]


def _refusal(summary: dict[str, Any]) -> list[str]:
    lines = [f"## No medians: the grid is {summary['status']}", ""]
    lines += [f"- {reason}" for reason in summary["reasons"]]
    return lines + [""]


def _figures_table(art: dict[str, Any]) -> list[str]:
    summary, passes = art["summary"], art["passes"]
    lines = [
        f"## Figures (median of {summary['passes']} passes; spread is min–max; ratio is arm/control pass by pass)",
        "",
        "| arm | figure | median | spread (min–max) | vs control | backend that ran |",
        "|---|---|---|---|---|---|",
    ]
    for arm, table in summary["arms"].items():
        backend, label = backend_of_arm(passes, arm), _arm_label(art, arm)
        for name, fig in table.items():
            unit = fig["unit"]
            backend, shown = "", backend  # once per arm, on its first row
            lines.append(
                f"| {label} | {name} ({'↑' if fig['better'] == 'higher' else '↓'}) | {format_value(fig['median'], unit)} | "
                f"{format_value(fig['min'], unit)} – {format_value(fig['max'], unit)} | "
                f"{_ratio_text(fig.get('ratio_vs_control')) if arm != summary['control'] else 'control'} | {shown} |"
            )
    lines += ["", "Sources:", ""]
    sources = sorted({(name, fig["source"]) for table in summary["arms"].values() for name, fig in table.items()})
    lines += [f"- {name}: {source}" for name, source in sources]
    for note in summary.get("notes", []):
        lines.append(f"- note: {note}")
    if _user_arms(art):
        lines += ["", USER_MARK_TEXT + "."]
    return lines + [""]


def _memory_table(art: dict[str, Any]) -> list[str]:
    """Per arm and role: medians over passes of each process's steady PSS and its parts."""
    lines = [
        "## Memory per process (steady state, median over passes; PSS, never RSS)",
        "",
        "| arm | role | title | PSS | Pss_Anon | Pss_File | Pss_Shmem | USS | load peak PSS | peak PSS |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_key: dict[tuple[str, str, str], list[dict]] = {}
    for record in art["passes"]:
        for proc in ((record.get("ledger") or {}).get("processes") or {}).values():
            by_key.setdefault((record["arm"], proc["role"], proc["title"][:40]), []).append(proc)

    def med(procs: list[dict], window: str, field: str) -> str:
        values = [p[window][field] for p in procs if p.get(window) and p[window].get(field) is not None]
        return format_mib(statistics.median(values)) if values else "—"

    arms = [a["name"] for a in art["grid"]["arms"]]
    for (arm, role, title), procs in sorted(
        by_key.items(), key=lambda kv: (arms.index(kv[0][0]), ROLES_ORDER.index(kv[0][1]) if kv[0][1] in ROLES_ORDER else 99)
    ):
        lines.append(
            f"| {arm} | {role} | `{title}` | {med(procs, 'steady', 'pss')} | {med(procs, 'steady', 'pss_anon')} | "
            f"{med(procs, 'steady', 'pss_file')} | {med(procs, 'steady', 'pss_shmem')} | {med(procs, 'steady', 'uss')} | "
            f"{med(procs, 'peak_load', 'pss')} | {med(procs, 'peak', 'pss')} |"
        )
    return lines + [""]


def _median_or_none(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def memory_breakdown_row(arm: str, records: list[dict[str, Any]], tree_pss: float | None) -> str:
    """One arm's steady tree PSS split into weights by class, KV and the rest (medians over passes)."""
    workers = [((r.get("evidence") or {}).get("workers") or [{}])[0] for r in records]
    if any((r.get("result") or {}).get("engine") in ("llamacpp", *IN_PROCESS_SPEECH) for r in records):
        weights = _median_or_none([w.get("model_size_bytes") or w.get("model_file_bytes") for w in workers])
        rest = tree_pss - weights if tree_pss is not None and weights is not None else None
        # The model file's bytes in the "other weights" column; llama.cpp reports no split or KV here.
        cells = ["—", "—", "—", format_mib(weights) + " (file)" if weights else "—", "—"]
        return f"| {arm} | {format_mib(tree_pss) if tree_pss else '—'} | " + " | ".join(cells) + \
            f" | {format_mib(rest) if rest is not None else '—'} |"
    by_class = [w.get("weights_bytes_by_class") or {} for w in workers]
    cls = {k: _median_or_none([b.get(k, 0) for b in by_class]) if any(by_class) else None
           for k in ("linear", "embedding", "head", "other")}
    kv = _median_or_none([w.get("kv_cache_bytes") for w in workers])
    lazy = _median_or_none([w.get("kv_cache_mapped_bytes") for w in workers]) or 0
    weights = sum(v for v in cls.values() if v is not None) if any(by_class) else None
    counted = (weights or 0) + (0 if lazy else (kv or 0))
    rest = tree_pss - counted if tree_pss is not None and weights is not None else None
    kv_text = "—" if kv is None else format_mib(kv) + (" (resident as used)" if lazy else "")
    cells = [format_mib(cls[k]) if cls[k] is not None else "—" for k in ("linear", "embedding", "head", "other")]
    return (f"| {arm} | {format_mib(tree_pss) if tree_pss else '—'} | " + " | ".join(cells) +
            f" | {kv_text} | {format_mib(rest) if rest is not None else '—'} |")


def _memory_breakdown_table(art: dict[str, Any]) -> list[str]:
    lines = ["## Memory breakdown (steady tree PSS, medians over passes)", "",
             "| arm | tree PSS | linear weights | embedding | head | other weights | KV cache | "
             "rest: runtime, heap, compile |",
             "|---|---|---|---|---|---|---|---|"]
    for arm in (a["name"] for a in art["grid"]["arms"]):
        records = [r for r in art["passes"] if r["arm"] == arm and r.get("status") == OK]
        if not records:
            continue
        fig = art["summary"]["arms"].get(arm, {}).get("tree PSS steady")
        lines.append(memory_breakdown_row(arm, records, fig["median"] if fig else None))
    lines += ["", "Weights are each storage once, by the class of the module holding it (a tied head is "
              "counted with the embedding). A KV cache resident as used is left in the rest, which "
              "then holds the part of it the passes wrote; otherwise the whole buffer is resident and "
              "taken out. llama.cpp: its model file's size.", ""]
    return lines


BANDWIDTH_FILE = "bandwidth.json"  # vllm_omni_edge_bench/harness/bandwidth.py's artifact, put next to the grid's


def weight_bytes_per_token(record: dict[str, Any]) -> int | None:
    """Bytes of weights one decode step reads, from the pass's evidence (all weights; KV reads not counted)."""
    workers = (record.get("evidence") or {}).get("workers") or []
    if not workers:
        return None
    worker = workers[0]
    if (record.get("result") or {}).get("engine") == "llamacpp":
        return worker.get("model_size_bytes")
    by_dtype = worker.get("weights_bytes_by_dtype") or {}
    return sum(by_dtype.values()) or None


def _ceiling_table(art: dict[str, Any]) -> list[str]:
    """Decode as a fraction of the box's bandwidth ceiling, if bandwidth.json sits with the artifacts."""
    path = Path(art["dir"]) / BANDWIDTH_FILE
    if not path.is_file():
        return []
    from vllm_omni_edge_bench.harness.bandwidth import best_bandwidth_gbps, decode_ceiling

    bandwidth = json.loads(path.read_text())
    gbps = best_bandwidth_gbps(bandwidth)
    lines = [f"## Decode against the bandwidth ceiling ({gbps:.1f} GB/s, best median copy of {BANDWIDTH_FILE})", "",
             "| arm | figure | decode (median) | weights read per token | ceiling | fraction of ceiling |",
             "|---|---|---|---|---|---|"]
    for arm, table in art["summary"]["arms"].items():
        sizes = [weight_bytes_per_token(r) for r in art["passes"] if r["arm"] == arm and r.get("status") == OK]
        sizes = [s for s in sizes if s]
        for name, fig in table.items():
            if fig["unit"] != "tok/s" or not name.startswith("tg") or "(engine)" in name:
                continue
            if not sizes:
                lines.append(f"| {arm} | {name} | {format_value(fig['median'], 'tok/s')} | no evidence | — | — |")
                continue
            size = statistics.median(sizes)
            ceiling = decode_ceiling(size, gbps)
            lines.append(f"| {arm} | {name} | {format_value(fig['median'], 'tok/s')} | {format_mib(size)} | "
                         f"{ceiling:,.1f} tok/s | {fig['median'] / ceiling:.0%} |")
    lines += ["", "Ceiling = bandwidth / bytes of weights (each read once per token); KV-cache reads and "
              "activations are left out, so the true ceiling is a little lower.", ""]
    return lines


def _llamacpp_arms(art: dict[str, Any]) -> list[str]:
    return [a["name"] for a in art["grid"]["arms"] if a.get("engine") == "llamacpp"]


def _llamacpp_table(art: dict[str, Any]) -> list[str]:
    """Each other arm's decode and prefill over each llama.cpp arm's, paired pass by pass."""
    baselines = _llamacpp_arms(art)
    if not baselines:
        return []
    arms = art["summary"]["arms"]
    lines = ["## Against llama.cpp (arm/llama.cpp pass by pass: median, min–max, passes at or above 1.0)", "",
             "| arm | figure | vs llama.cpp arm | ratio | passes ≥ 1.0 |", "|---|---|---|---|---|"]
    for baseline in baselines:
        for arm, table in arms.items():
            if arm in baselines:
                continue
            for name, fig in table.items():
                theirs = arms[baseline].get(name)
                if fig["unit"] != "tok/s" or "(engine)" in name or theirs is None:
                    continue
                ratios = [ours / base for ours, base in zip(fig["values"], theirs["values"]) if base]
                if len(ratios) != len(fig["values"]):
                    continue  # a zero llama.cpp value has no ratio
                ratio = spread(ratios)
                at_parity = sum(r >= 1.0 for r in ratios)
                lines.append(f"| {_arm_label(art, arm)} | {name} | {baseline} | {_ratio_text(ratio)} | "
                             f"{at_parity} of {len(ratios)} |")
    return lines + [""]


def _agent_table(art: dict[str, Any]) -> list[str]:
    """Per agent task and arm: in how many passes it passed every check (detail is in the pass files)."""
    arms = [a["name"] for a in art["grid"]["arms"]]
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for record in art["passes"]:
        for workload in (record.get("result") or {}).get("workloads", []):
            for task in (workload.get("agent") or {}).get("tasks", []):
                row = rows.setdefault((workload["label"], task["id"]),
                                      {"category": task["category"], "mode": task["mode"], "arms": {}})
                passed, seen = row["arms"].get(record["arm"], (0, 0))
                row["arms"][record["arm"]] = (passed + bool(task["passed"]), seen + 1)
    if not rows:
        return []
    lines = ["## Agent tasks (passes in which the task passed every exact check)", "",
             "| workload | task | category | mode | " + " | ".join(arms) + " |",
             "|---|---|---|---|" + "---|" * len(arms)]
    for (label, task_id), row in rows.items():
        cells = [f"{row['arms'][a][0]}/{row['arms'][a][1]}" if a in row["arms"] else "—" for a in arms]
        lines.append(f"| {label} | {task_id} | {row['category']} | {row['mode']} | " + " | ".join(cells) + " |")
    return lines + [""]


SPEECH_COLUMNS = ("RTF@", "latency p50@", "WER@")


def _speech_table(art: dict[str, Any]) -> list[str]:
    """Speech arms side by side: RTF, latency p50 and WER at each stream count, tree PSS (medians)."""
    arms = art["summary"]["arms"]
    names = [n for table in arms.values() for n in table if any(c in n for c in SPEECH_COLUMNS)]
    columns = list(dict.fromkeys(names))
    if not columns:
        return []
    control = art["summary"]["control"]
    lines = ["## Speech (medians over passes; ratio to the control, pass by pass, in brackets)", "",
             "| arm | " + " | ".join(columns) + " | tree PSS steady |", "|---|" + "---|" * (len(columns) + 1)]
    for arm, table in arms.items():
        cells = []
        for name in [*columns, "tree PSS steady"]:
            fig = table.get(name)
            if fig is None:
                cells.append("—")
                continue
            ratio = fig.get("ratio_vs_control")
            text = format_value(fig["median"], fig["unit"])
            if arm != control and ratio and ratio.get("median") is not None:
                text += f" ({ratio['median']:.2f}×)"
            cells.append(text)
        lines.append(f"| {_arm_label(art, arm)}{' (control)' if arm == control else ''} | " + " | ".join(cells) + " |")
    return lines + ["", "RTF: audio seconds per wall second (× real time), all streams together; WER in percent, "
                    "normalised as vllm_omni_edge_bench/harness/speech.py writes down.", ""]


def _passes_table(art: dict[str, Any]) -> list[str]:
    lines = ["## Passes (in the order they ran)", "", "| # | pass | arm | status | wall | load avg (1 min) | notes |",
             "|---|---|---|---|---|---|---|"]
    for r in art["passes"]:
        wall = f"{r['wall_s']:.0f} s" if "wall_s" in r else "—"
        load = f"{r['load_average_at_start'][0]:.2f}" if r.get("load_average_at_start") else "—"
        notes = "; ".join(r.get("reasons", []) + r.get("warnings", [])).replace("|", "\\|")
        lines.append(f"| {r['seq']} | {r['pass_index']} | {r['arm']} | {r['status']} | {wall} | {load} | {notes} |")
    return lines + [""]


def render_markdown(art: dict[str, Any]) -> str:
    lines = _header(art) + _arms_table(art)
    if art["summary"]["status"] == OK:
        lines += _figures_table(art)
        lines += _speech_table(art)
        lines += _llamacpp_table(art)
        lines += _agent_table(art)
        lines += _memory_table(art)
        lines += _memory_breakdown_table(art)
        lines += _ceiling_table(art)
    else:
        lines += _refusal(art["summary"])
    lines += _passes_table(art)
    return "\n".join(lines)


def render_plots(art: dict[str, Any]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    arms = [a["name"] for a in art["grid"]["arms"]]
    colours = {arm: f"C{i}" for i, arm in enumerate(arms)}

    # Tree PSS over time for every pass that ran: shows load, steady state and crashes.
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for record in art["passes"]:
        ledger = record.get("ledger") or {}
        timeline = ledger.get("timeline") or []
        if not timeline:
            continue
        t = [s["t"] for s in timeline]
        pss = [sum(s["pss"].values()) / (1 << 20) for s in timeline]
        ax.plot(t, pss, color=colours[record["arm"]], alpha=0.7, linestyle="-" if record["status"] == OK else ":",
                label=f"{record['arm']}" if record["pass_index"] == 1 else None)
        if ledger.get("first_token_s") is not None:
            ax.axvline(ledger["first_token_s"], color=colours[record["arm"]], alpha=0.2)
    ax.set_xlabel("seconds since pass start")
    ax.set_ylabel("tree PSS (MiB)")
    ax.set_title("Process-tree PSS per pass (vertical lines: first token; dotted: not ok)")
    ax.legend()
    fig.tight_layout()
    path = art["dir"] / "memory-timeline.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    summary = art["summary"]
    if summary["status"] != OK:
        return written
    names = list(dict.fromkeys(name for table in summary["arms"].values() for name in table))
    cols = min(4, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.2 * rows), squeeze=False)
    for ax in axes.flat[len(names):]:
        ax.set_visible(False)
    for ax, name in zip(axes.flat, names):
        for i, arm in enumerate(arms):
            fig_data = summary["arms"][arm].get(name)
            if not fig_data:
                continue
            scale = 1 / (1 << 20) if fig_data["unit"] == "bytes" else 1
            median = fig_data["median"] * scale
            ax.bar(i, median, color=colours[arm],
                   yerr=[[median - fig_data["min"] * scale], [fig_data["max"] * scale - median]], capsize=4)
            ax.plot([i] * len(fig_data["values"]), [v * scale for v in fig_data["values"]], "k.", alpha=0.6)
        unit = next(summary["arms"][a][name]["unit"] for a in arms if name in summary["arms"][a])
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("MiB" if unit == "bytes" else unit)
        ax.set_xticks(range(len(arms)), arms, rotation=30, fontsize=8)
    fig.suptitle("median, min–max and each pass")
    fig.tight_layout()
    path = art["dir"] / "figures.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


def resummarise(results_dir: Path) -> dict[str, Any]:
    """Rewrite summary.json from the pass records, which hold every raw figure and the ledger."""
    from vllm_omni_edge.atomic import atomic_write_bytes

    art = load_artifacts(results_dir)
    grid = art["grid"]
    summary = summarise(art["passes"], [a["name"] for a in grid["arms"]], grid["control"], grid["passes"])
    atomic_write_bytes(Path(results_dir) / "summary.json", json.dumps(summary, indent=2).encode())
    return summary


def write_report(results_dir: Path) -> Path:
    art = load_artifacts(results_dir)
    path = Path(results_dir) / "report.md"
    plots = render_plots(art)
    text = render_markdown(art) + "\n" + "\n".join(f"![{p.stem}]({p.name})" for p in plots) + "\n"
    path.write_text(text)
    return path
