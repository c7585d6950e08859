"""CPU deploy YAMLs for vLLM-Omni pipelines, and the resolver that makes them loadable.

Each YAML here overlays vLLM-Omni's own deploy file (``base_config``) with a
``platforms: cpu:`` section. vLLM-Omni resolves ``base_config`` relative to the overlay's
directory, which cannot name a file inside another installed package portably, so the
YAMLs write it as ``"vllm_omni:deploy/<name>.yaml"`` and :func:`cpu_deploy_config` writes
a copy with the absolute path of the installed file. A variant names a sibling YAML
(``base_config: "qwen2_5_omni.yaml"``); its copy points at the sibling's own copy.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import yaml

from vllm_omni_edge.atomic import atomic_write_bytes

OVERLAY_DIR = Path(__file__).resolve().parent
_PACKAGE_PREFIX = "vllm_omni:"


def available() -> list[str]:
    return sorted(p.stem for p in OVERLAY_DIR.glob("*.yaml"))


def _resolve_base(base: str, out_dir: str | Path | None) -> str:
    if (OVERLAY_DIR / base).is_file():  # a sibling overlay: its own loadable copy
        return str(cpu_deploy_config(Path(base).stem, out_dir).resolve())
    if not base.startswith(_PACKAGE_PREFIX):
        return base
    import vllm_omni

    path = Path(vllm_omni.__file__).resolve().parent / base[len(_PACKAGE_PREFIX) :]
    if not path.is_file():
        raise FileNotFoundError(f"base_config {base!r}: {path} is not in the installed vLLM-Omni")
    return str(path)


def cpu_deploy_config(name: str, out_dir: str | Path | None = None) -> Path:
    """Path of a loadable copy of ``deploy/<name>.yaml`` (pass it as ``deploy_config``)."""
    overlay = OVERLAY_DIR / f"{name}.yaml"
    if not overlay.is_file():
        raise ValueError(f"no CPU deploy config named {name!r}; available: {', '.join(available())}")
    data = yaml.safe_load(overlay.read_text())
    if "base_config" in data:
        data["base_config"] = _resolve_base(data["base_config"], out_dir)
    text = yaml.safe_dump(data, sort_keys=False).encode()
    if out_dir is None:
        from vllm_omni_edge.cache_paths import cache_root

        out_dir = cache_root() / "deploy"
    # Content-addressed, so concurrent callers never see each other's half-written copy.
    out = Path(out_dir) / f"{name}-cpu-{hashlib.sha256(text).hexdigest()[:12]}.yaml"
    if not out.exists():
        atomic_write_bytes(out, text)
    return out
