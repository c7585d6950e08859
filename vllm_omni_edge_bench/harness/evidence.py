"""What the vLLM processes say they did, and whether that is what the arm asked for.

The plugin writes into ``$VLLM_OMNI_EDGE_EVIDENCE_DIR``:

- ``process-<pid>.json`` from every vLLM process: ``{"pid", "ppid", "role", "patches"}``;
- ``worker-<pid>.json`` from each model worker: KV bytes, RoPE rows, weight dtypes,
  whether the model was compiled, ...

A setting is only "measured" if the worker's evidence shows it took effect: a
flag that some code path discarded would otherwise be reported as a result.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_omni_edge_bench.harness.sizes import looks_like_size, parse_size

# "~X" accepts X within this relative distance: the KV cache is allocated in whole
# blocks, so a 192 MiB budget yields slightly less than 192 MiB.
APPROX_REL = 0.01
_OPERATOR = re.compile(r"^\s*(<=|>=|==|<|>|~)\s*(.+?)\s*$")
_MISSING = object()


@dataclass(frozen=True)
class Expectation:
    key: str
    op: str  # "==", "<=", ">=", "<", ">", "~"
    target: Any
    written: Any  # as in the grid, for messages

    def violation(self, actual: Any) -> str | None:
        """None if ``actual`` satisfies the expectation, else the reason."""
        shown = f"{self.key}: expected {self.written!r}, evidence says {actual!r}"
        if self.op == "==":
            if isinstance(self.target, bool) or isinstance(actual, bool):
                # False == 0 in Python; a flag is not a count.
                return None if actual is self.target else shown
            return None if actual == self.target else shown
        if isinstance(actual, bool) or not isinstance(actual, (int, float)):
            return shown + " (not a number)"
        if self.op == "~":
            ok = math.isclose(actual, self.target, rel_tol=APPROX_REL)
        else:
            ok = {
                "<=": actual <= self.target,
                ">=": actual >= self.target,
                "<": actual < self.target,
                ">": actual > self.target,
            }[self.op]
        return None if ok else shown


def _number(text: str) -> int | float:
    if looks_like_size(text):
        return parse_size(text)
    try:
        return int(text)
    except ValueError:
        return float(text)


def parse_expectation(key: str, written: Any) -> Expectation:
    """Parse one ``expect`` entry; raise ValueError naming the key if it is malformed."""
    if not key or any(not part for part in key.split(".")):
        raise ValueError(f"expect key {key!r} is not a dotted path like 'rope.0.rows'")
    if isinstance(written, str):
        match = _OPERATOR.match(written)
        if match:
            op, operand = match.groups()
            try:
                return Expectation(key, op, _number(operand), written)
            except ValueError:
                if op == "==":
                    return Expectation(key, op, operand, written)
                raise ValueError(f"expect {key}: {written!r} compares with something that is not a number") from None
        if looks_like_size(written):
            return Expectation(key, "==", parse_size(written), written)
        return Expectation(key, "==", written, written)
    if written is None or isinstance(written, (bool, int, float)):
        return Expectation(key, "==", written, written)
    raise ValueError(f"expect {key}: use a scalar or a comparison string, not {type(written).__name__}")


def lookup(document: Any, dotted: str) -> Any:
    """Follow ``a.b.0.c`` through dicts and lists; return _MISSING if absent."""
    node = document
    for part in dotted.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node


def collect_evidence(evidence_dir: Path) -> dict:
    """Read every evidence file; unreadable ones are listed, not skipped silently."""
    collected: dict[str, Any] = {"dir": str(evidence_dir), "processes": [], "workers": [], "unreadable": []}
    if not evidence_dir.is_dir():
        return collected
    for path in sorted(evidence_dir.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            collected["unreadable"].append(f"{path.name}: {error}")
            continue
        if path.name.startswith("process-"):
            collected["processes"].append(record)
        elif path.name.startswith("worker-"):
            collected["workers"].append(record)
        else:
            collected["unreadable"].append(f"{path.name}: not process-<pid>.json or worker-<pid>.json")
    return collected


def evidence_problems(evidence: dict, expect: dict[str, Any], tree_pids: set[int] | None = None) -> list[str]:
    """Reasons the pass cannot count as a measurement of its arm; empty if it can."""
    problems = []
    if tree_pids is not None:
        for worker in evidence["workers"]:
            if worker.get("pid") not in tree_pids:
                problems.append(f"worker evidence from pid {worker.get('pid')}, which is not in this pass's process tree")
    if not expect:
        return problems
    problems += [f"unreadable evidence: {line}" for line in evidence["unreadable"]]
    if not evidence["workers"]:
        keys = ", ".join(sorted(expect))
        problems.append(f"no worker evidence in {evidence['dir']}, but the arm expects {keys}")
        return problems
    expectations = [parse_expectation(key, value) for key, value in expect.items()]
    for worker in evidence["workers"]:
        for expectation in expectations:
            actual = lookup(worker, expectation.key)
            if actual is _MISSING:
                problems.append(f"worker {worker.get('pid')}: evidence has no {expectation.key}")
                continue
            reason = expectation.violation(actual)
            if reason:
                problems.append(f"worker {worker.get('pid')}: {reason}")
    return problems


def roles_by_pid(evidence: dict) -> dict[int, str]:
    roles = {p["pid"]: p.get("role", "?") for p in evidence["processes"] if isinstance(p.get("pid"), int)}
    for worker in evidence["workers"]:
        if isinstance(worker.get("pid"), int):
            roles.setdefault(worker["pid"], "worker")
    return roles
