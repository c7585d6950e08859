"""From pass artifacts to medians and ratios, or to a refusal.

A median over passes means something only if every pass ran as specified. If
any pass crashed, was invalid or did not run, :func:`summarise` returns the
status and the reasons and no medians: a median of the survivors would hide
that the configuration does not reliably work.

Ratios are taken pass by pass (arm pass i / control pass i), then summarised.
Pass i of every arm ran in the same stretch of time, so the pairing cancels
slow drift of the box that a ratio of two medians would keep.
"""

from __future__ import annotations

import statistics
from typing import Any

OK, CRASHED, INVALID, NOT_RUN, INCOMPLETE = "ok", "crashed", "invalid", "not_run", "incomplete"

# Memory figures: (figure name, ledger window, field). Bytes, lower is better.
MEMORY_FIGURES = (
    ("tree PSS steady", "steady", "pss"),
    ("tree PSS peak", "peak", "pss"),
    ("tree PSS load peak", "peak_load", "pss"),
    ("tree PSS_Anon steady", "steady", "pss_anon"),
)
ROLE_MEMORY = ("frontend", "engine_core", "worker")
WORKLOAD_PEAK = "tree PSS workload peak"


def workload_peak_pss(ledger: dict[str, Any]) -> int | None:
    """Highest whole-tree PSS after the first token, up to the end of the workloads.

    The bound a server under load must hold: the load peak is behind it, and anything above
    the steady state here was allocated by serving. Read from the ledger's timeline (harness
    clients are already left out of it), so older artifacts get the figure too.
    """
    start, end = ledger.get("first_token_s"), ledger.get("workloads_done_s")
    if start is None or end is None:
        return None
    totals = [sum(sample["pss"].values()) for sample in ledger.get("timeline") or []
              if start < sample["t"] <= end and sample["pss"]]
    return max(totals) if totals else None


def _memory_figure(value: int, what: str) -> dict[str, Any]:
    return {"value": value, "unit": "bytes", "better": "lower",
            "source": f"memory ledger: {what}, smaps_rollup summed over the process tree"}


def figures_of_pass(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every figure one pass produced: workload figures and memory figures."""
    figures: dict[str, dict[str, Any]] = {}
    for workload in (record.get("result") or {}).get("workloads", []):
        figures.update(workload["figures"])
    ledger = record.get("ledger") or {}
    tree = ledger.get("tree") or {}
    for name, window, field in MEMORY_FIGURES:
        stats = tree.get(window)
        if stats and stats.get(field) is not None:
            figures[name] = _memory_figure(stats[field], f"{window} {field}")
    serving_peak = workload_peak_pss(ledger)
    if serving_peak is not None:
        figures[WORKLOAD_PEAK] = _memory_figure(serving_peak, "peak pss from first token to workloads done")
    processes = (ledger.get("processes") or {}).values()
    for role in ROLE_MEMORY:
        steady = [p["steady"]["pss"] for p in processes if p.get("role") == role and p.get("steady")]
        if steady:
            figures[f"{role} PSS steady"] = _memory_figure(sum(steady), f"steady pss of {role} processes")
        # CPU a role burnt while the workloads ran: a polling process shows here, not in tok/s.
        busy = [p["cpu_s"]["during_workloads"] for p in processes
                if p.get("role") == role and (p.get("cpu_s") or {}).get("during_workloads") is not None]
        if busy:
            figures[f"{role} CPU s in workloads"] = {
                "value": sum(busy), "unit": "s", "better": "lower",
                "source": f"memory ledger: user+system CPU of {role} processes, first token to workloads done"}
    return figures


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _refusal(records: list[dict[str, Any]], arms: list[str], passes: int) -> tuple[str, list[str]]:
    reasons = []
    status = OK
    seen = {(r["pass_index"], r["arm"]) for r in records}
    for record in records:
        where = f"pass {record['pass_index']} arm {record['arm']}"
        if record["status"] == CRASHED:
            status = CRASHED
            reasons += [f"{where} crashed: {reason}" for reason in record["reasons"]]
        elif record["status"] == INVALID:
            status = CRASHED if status == CRASHED else INVALID
            reasons += [f"{where} invalid: {reason}" for reason in record["reasons"]]
    missing = [f"{p}-{a}" for p in range(1, passes + 1) for a in arms if (p, a) not in seen]
    not_run = [f"{r['pass_index']}-{r['arm']}" for r in records if r["status"] == NOT_RUN]
    if missing or not_run:
        status = status if status != OK else INCOMPLETE
        reasons.append(f"{len(missing) + len(not_run)} of {passes * len(arms)} passes did not run: "
                       + ", ".join(not_run + missing))
    return status, reasons


def summarise(records: list[dict[str, Any]], arms: list[str], control: str, passes: int) -> dict[str, Any]:
    """Medians per arm and pass-paired ratios vs control, or the reasons there are none."""
    status, reasons = _refusal(records, arms, passes)
    counts = {s: sum(r["status"] == s for r in records) for s in (OK, CRASHED, INVALID, NOT_RUN)}
    if status != OK:
        return {"status": status, "reasons": reasons, "pass_counts": counts}

    by_arm: dict[str, dict[int, dict[str, dict]]] = {arm: {} for arm in arms}
    for record in records:
        by_arm[record["arm"]][record["pass_index"]] = figures_of_pass(record)

    notes = []
    arm_tables: dict[str, dict[str, Any]] = {}
    for arm in arms:
        # Workload figures in grid order, then memory: the order figures_of_pass gives.
        names = list(dict.fromkeys(name for i in sorted(by_arm[arm]) for name in by_arm[arm][i]))
        table = {}
        for name in names:
            per_pass = {i: figs[name] for i, figs in by_arm[arm].items() if name in figs}
            if len(per_pass) != passes:
                notes.append(f"{arm}: {name} was produced by {len(per_pass)} of {passes} passes; not summarised")
                continue
            first = next(iter(per_pass.values()))
            values = [per_pass[i]["value"] for i in sorted(per_pass)]
            table[name] = {**spread(values), "values": values, "unit": first["unit"],
                           "better": first["better"], "source": first["source"]}
            if arm != control and name in by_arm[control].get(1, {}):
                table[name]["ratio_vs_control"] = _paired_ratio(by_arm[arm], by_arm[control], name, passes)
        arm_tables[arm] = table
    return {"status": OK, "reasons": [], "notes": notes, "pass_counts": counts,
            "control": control, "passes": passes, "arms": arm_tables}


def _paired_ratio(arm_passes: dict[int, dict], control_passes: dict[int, dict], name: str, passes: int):
    ratios = []
    for i in range(1, passes + 1):
        control = control_passes.get(i, {}).get(name)
        if control is None or not control["value"]:
            return None  # a missing or zero control value has no ratio
        ratios.append(arm_passes[i][name]["value"] / control["value"])
    return {**spread(ratios), "values": ratios}
