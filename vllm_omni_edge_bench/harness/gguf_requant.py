"""What re-storing a GGUF as cpu_int4 costs: each variant against the GGUF's own dequantization.

For each GGUF file:

1. the reference: our reader's bf16 conversion (``convert_gguf_to_hf``), which is
   exactly the weights the file stores (its dequantization, rounded once to bf16);
2. the candidates: cpu_int4 checkpoints built with the builder settings of each variant
   (:data:`VARIANTS`). The first variant, and its repeat ``again`` (two identical runs:
   the noise of the whole pipeline), are built from the file by the product path
   (``build_cpu_int4_checkpoint(FILE.gguf, OUT)``, what ``vllm-omni-edge quantize
   FILE.gguf OUT`` runs); the others from the conversion already made, its first step;
3. ``keep-*`` variants, which the builder cannot write: the first variant's build with
   some tensors put back at the reference's bf16, e.g. those the GGUF stored at more bits
   than its main layer type (Q6_K ``attn_v``, ``ffn_down``, ``output`` in a Q4_K_M). They
   say whether keeping those bits would pay before any format is made for it.

Every candidate is turned back into a bf16 checkpoint holding exactly the weights it
stores (:func:`dequantize_cpu_int4`), and the reference and every candidate are scored
by transformers in float32 on the same token windows of the fidelity tool's text, the
whole vocabulary on both sides: the KL is exact, and what it measures is the weights'
storage, nothing else. The difference between a variant and the first is given per
position (mean and its standard error over positions), so a choice is said to help only
when the gain is beyond twice that error and beyond the identical-run difference. The
floor is llama.cpp on the GGUF against the same reference scoring (our dequantization vs
theirs, as ``gguf_check`` measures it).

``--vllm`` also scores each build served by vLLM against the bf16 conversion served by
vLLM (prompt logprobs, top k: a lower bound), plus a second engine on the bf16
conversion (the served pair's noise).

    python -m vllm_omni_edge_bench.harness.gguf_requant FILE.gguf [...] --label NAME [--vllm]

writes ``results/<date>-gguf-requant-NAME/`` (``report.md``, ``requant.json``,
``provenance.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from vllm_omni_edge_bench.harness import fidelity, provenance

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TOKENS = 512
DEFAULT_WINDOW = 256
DEFAULT_STRIDE = 128

# GGUF base tensor name -> Hugging Face module name (the llama-style decoders the builder takes).
_BLOCK_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output": "lm_head"}


class RequantError(ValueError):
    """Bad input to the re-quantization measurement."""


@dataclass(frozen=True)
class Variant:
    """One candidate: a build (``build`` = builder keyword arguments) or the first variant's build with ``keep``."""

    name: str
    build: dict[str, Any] = field(default_factory=dict)
    # "promoted": the tensors the GGUF stored above its main linear type; or explicit module names.
    keep: str | tuple[str, ...] | None = None
    describe: str = ""
    # Whether the build keeps the file's 4-bit codes (the builder's GGUF grids), as the product does.
    grids: bool = True


VARIANTS = {
    "int4": Variant("int4", {"embedding": "int4", "head": "int4", "promoted_bits": 4},
                    describe="--embedding int4 --head int4 --promoted-bits 4: every matrix 4-bit (a tied head "
                             "shares the embedding)"),
    "six-bit": Variant("six-bit", {"embedding": "int4", "head": "int4", "promoted_bits": 6},
                       describe="--embedding int4 --head int4 --promoted-bits 6: the matrices the GGUF stored "
                                "at more bits with 6-bit codes"),
    "again": Variant("again", describe="the first variant built and scored a second time (identical-run noise)"),
    "default": Variant("default", {}, describe="the builder's defaults for a GGUF"),
    "requantized": Variant("requantized", {"embedding": "int4", "head": "int4", "promoted_bits": 4}, grids=False,
                           describe="--embedding int4 --head int4 --promoted-bits 4, the file's 4-bit weights "
                                    "re-quantized from the bf16 conversion instead of kept on their own grid"),
    "embedding-int8": Variant("embedding-int8", {"embedding": "int8", "head": "int4"},
                              describe="--embedding int8 --head int4 (a tied head gets its own 4-bit copy)"),
    "embedding-bf16": Variant("embedding-bf16", {"embedding": "bf16", "head": "int4"},
                              describe="--embedding bf16 --head int4 (a tied head gets its own 4-bit copy)"),
    "head-bf16": Variant("head-bf16", {"embedding": "bf16", "head": "bf16"},
                         describe="--embedding bf16 --head bf16 (head and embedding unquantized; a tied "
                                  "one stored once)"),
    "keep-promoted": Variant("keep-promoted", keep="promoted",
                             describe="the first variant, with every tensor the GGUF stored at more bits kept "
                                      "bf16 (not buildable)"),
    "keep-promoted-linear": Variant("keep-promoted-linear", keep="promoted-linear",
                                    describe="the first variant, with the promoted layer weights (not "
                                             "embedding/head) kept bf16 (not buildable)"),
    "keep-head": Variant("keep-head", keep="head",
                         describe="the first variant, with the output head (the embedding, if tied) kept bf16 "
                                  "(not buildable)"),
}
DEFAULT_VARIANTS = ("int4", "again", "six-bit", "embedding-int8", "embedding-bf16", "head-bf16", "keep-promoted",
                    "keep-promoted-linear", "keep-head")


# ---------------------------------------------------------------------------
# What the GGUF stores


def hf_module_name(gguf_name: str) -> str | None:
    """``blk.3.attn_v.weight`` -> ``model.layers.3.self_attn.v_proj``; None for norms, biases and the rest."""
    parts = gguf_name.split(".")
    if parts[-1] != "weight":
        return None
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_TENSORS:
        return f"model.layers.{int(parts[1])}.{_BLOCK_TENSORS[parts[2]]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[parts[0]]
    return None


def bits_per_weight(type_name: str) -> float:
    """Stored bits per weight of a GGML tensor type (block bytes * 8 / block weights)."""
    from vllm_omni_edge.models.gguf_to_hf import UnsupportedCheckpointError
    from vllm_omni_edge.models.gguf_to_hf import bits_per_weight as product_bits

    try:
        return product_bits(type_name)
    except UnsupportedCheckpointError as exc:
        raise RequantError(str(exc)) from exc


def gguf_tensor_types(gguf_path: Path) -> dict[str, str]:
    """Hugging Face module name -> GGML type name, for the matrices the builder stores 4-bit."""
    from gguf import GGMLQuantizationType, GGUFReader

    reader = GGUFReader(str(gguf_path))
    types = {}
    for tensor in reader.tensors:
        name = hf_module_name(tensor.name)
        if name is not None:
            types[name] = GGMLQuantizationType(tensor.tensor_type).name
    if not types:
        raise RequantError(f"{gguf_path} has no tensors named like a llama-style decoder's matrices")
    return types


def main_linear_type(types: dict[str, str]) -> str:
    """The type most layer weights are stored in (ties: the fewer bits)."""
    from vllm_omni_edge.models import gguf_to_hf

    layers = {name: t for name, t in types.items() if name.startswith("model.layers.")}
    try:
        return gguf_to_hf.main_linear_type(layers)
    except gguf_to_hf.UnsupportedCheckpointError as exc:  # no layers, or a type gguf does not know
        raise RequantError(str(exc)) from exc


def promoted_tensors(types: dict[str, str]) -> list[str]:
    """Modules the GGUF stored at more bits per weight than its main layer type."""
    main_bits = bits_per_weight(main_linear_type(types))
    return sorted(name for name, t in types.items() if bits_per_weight(t) > main_bits)


def kept_modules(variant: Variant, types: dict[str, str], tied: bool) -> list[str]:
    if variant.keep is None:
        return []
    if isinstance(variant.keep, tuple):
        return sorted(variant.keep)
    promoted = promoted_tensors(types)
    head = ["model.embed_tokens"] if tied else ["lm_head"]
    if variant.keep == "promoted":
        # A tied head is the embedding matrix: keeping one keeps both.
        kept = set(promoted)
        if tied and ("lm_head" in kept or "model.embed_tokens" in kept):
            kept |= {"model.embed_tokens"}
        return sorted(kept - ({"lm_head"} if tied else set()))
    if variant.keep == "promoted-linear":
        return [n for n in promoted if n.startswith("model.layers.")]
    if variant.keep == "head":
        return head
    raise RequantError(f"variant {variant.name}: keep must be 'promoted', 'promoted-linear', 'head' or names")


# ---------------------------------------------------------------------------
# A cpu_int4 checkpoint back to the weights it stores


def dequantize_cpu_int4(int4_dir: Path, out_dir: Path, *, keep_from: Path | None = None,
                        keep: Sequence[str] = ()) -> dict[str, int]:
    """Write a bf16 Hugging Face checkpoint holding exactly the weights ``int4_dir`` stores.

    Modules in ``keep`` take their weight from the bf16 checkpoint ``keep_from``
    instead. Returns the stored bytes of the weights: ``{"stored": N}`` for the
    cpu_int4 file, ``{"with_kept": N}`` counting each kept module at bf16 instead
    of its 4-bit bytes.
    """
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from vllm_omni_edge.quantization.int4 import dequantize, dequantize_rows_int8

    int4_dir, out_dir = Path(int4_dir), Path(out_dir)
    config = json.loads((int4_dir / "config.json").read_text())
    qc = config.pop("quantization_config", None)
    if not qc or qc.get("quant_method") != "cpu_int4":
        raise RequantError(f"{int4_dir} is not a cpu_int4 checkpoint (no cpu_int4 quantization_config)")
    if keep and keep_from is None:
        raise RequantError("keep needs keep_from, the bf16 checkpoint to take those weights from")
    weights = int4_dir / "model.safetensors"
    state: dict[str, torch.Tensor] = {}
    sizes: dict[str, int] = {}
    with safe_open(str(weights), framework="pt") as f:
        names = list(f.keys())
        for name in names:
            sizes[name] = _nbytes(f.get_slice(name))
        prefixes = sorted({n.rsplit(".", 1)[0] for n in names if n.endswith(".qweight")})
        for prefix in prefixes:
            if f"{prefix}.zeros" in names:
                high = f.get_tensor(f"{prefix}.qweight_high") if f"{prefix}.qweight_high" in names else None
                w = dequantize(f.get_tensor(f"{prefix}.qweight"), f.get_tensor(f"{prefix}.scales"),
                               f.get_tensor(f"{prefix}.zeros"), qweight_high=high)
            else:  # int8 rows
                w = dequantize_rows_int8(f.get_tensor(f"{prefix}.qweight"), f.get_tensor(f"{prefix}.scales"))
            state[f"{prefix}.weight"] = w.to(torch.bfloat16)
        quantized = {f"{p}.{s}" for p in prefixes for s in ("qweight", "qweight_high", "scales", "zeros")}
        for name in names:
            if name not in quantized:
                state[name] = f.get_tensor(name)
    stored = sum(sizes.values())
    with_kept = stored
    missing = [m for m in keep if f"{m}.weight" not in state]
    if missing:
        raise RequantError(f"modules to keep that {int4_dir} does not store: {missing}")
    if keep:
        with safe_open(str(Path(keep_from) / "model.safetensors"), framework="pt") as ref:
            ref_names = set(ref.keys())
            for module in keep:
                name = f"{module}.weight"
                source = name if name in ref_names else None
                if source is None and module == "lm_head" and "model.embed_tokens.weight" in ref_names:
                    source = "model.embed_tokens.weight"  # a tied reference
                if source is None:
                    raise RequantError(f"{keep_from} has no {name}")
                w = ref.get_tensor(source)
                if tuple(w.shape) != tuple(state[name].shape):
                    raise RequantError(f"{name}: {tuple(w.shape)} in {keep_from}, {tuple(state[name].shape)} stored")
                state[name] = w.to(torch.bfloat16)
                four_bit = sum(sizes.get(f"{module}.{s}", 0) for s in ("qweight", "qweight_high", "scales", "zeros"))
                with_kept += w.numel() * 2 - four_bit
    config["torch_dtype"] = "bfloat16"
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    for path in int4_dir.iterdir():
        if path.is_file() and path.name not in ("config.json", "model.safetensors", "cpu_int4_manifest.json"):
            shutil.copy2(path, out_dir / path.name)
    return {"stored": stored, "with_kept": with_kept}


_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "U8": 1, "I8": 1, "F64": 8, "I32": 4, "I64": 8}


def _nbytes(tensor_slice) -> int:
    return math.prod(tensor_slice.get_shape()) * _DTYPE_BYTES[tensor_slice.get_dtype()]


# ---------------------------------------------------------------------------
# Figures


def paired_difference(reference, base, other) -> dict[str, float]:
    """Per-position KL(ref || other) - KL(ref || base): mean and its standard error over positions."""
    a = fidelity.kl_per_position(reference, base)["kl"]
    b = fidelity.kl_per_position(reference, other)["kl"]
    d = b - a
    n = d.shape[0]
    se = float(np.std(d, ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    return {"mean": float(np.mean(d)), "se": se, "positions": int(n)}


def figures(reference, candidate) -> dict[str, Any]:
    c = fidelity.compare(reference, candidate)
    keys = ("kld_mean", "kld_p99", "kld_median", "kld_max", "same_top1", "ppl_ratio", "tokens", "kld_form",
            "resolved_mass_mean")
    return {k: c[k] for k in keys}


def verdict(diff: dict[str, float], noise: float) -> str:
    """Whether a KL difference (other - first) is beyond twice its standard error and the identical-run noise."""
    margin = max(2 * diff["se"], abs(noise))
    if diff["mean"] < -margin:
        return "helps"
    if diff["mean"] > margin:
        return "hurts"
    return "within noise"


# ---------------------------------------------------------------------------
# One file


def _as_gguf(settings: dict[str, Any], gguf: Path) -> dict[str, Any]:
    """Builder settings for a build from the conversion that match a build from the GGUF file."""
    from vllm_omni_edge.quantization.builder import default_formats, gguf_ties_head

    embedding, head = default_formats(gguf_ties_head(gguf), settings.get("embedding"), settings.get("head"))
    return {**settings, "embedding": embedding, "head": head}


def _tied(config_dir: Path) -> bool:
    return bool(json.loads((config_dir / "config.json").read_text()).get("tie_word_embeddings", False))


def measure_file(gguf: Path, work: Path, variants: Sequence[Variant], *, tokens: int = DEFAULT_TOKENS,
                 window: int = DEFAULT_WINDOW, stride: int = DEFAULT_STRIDE, llamacpp: bool = True,
                 use_vllm: bool = False, progress: bool = False) -> dict[str, Any]:
    import torch

    from vllm_omni_edge.models.gguf_to_hf import convert_gguf_to_hf
    from vllm_omni_edge.quantization.builder import build_cpu_int4_checkpoint
    from vllm_omni_edge_bench.harness import gguf_check

    check_variants(variants)
    first = variants[0]
    torch.set_num_threads(2)
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    grid_file = work / "gguf-grids.safetensors"
    ref_dir = convert_gguf_to_hf(gguf, work / "reference-bf16", grids_out=grid_file)
    if not grid_file.exists():
        grid_file = None  # no 4-bit weight in the file
    seconds["convert"] = time.perf_counter() - t0
    types = gguf_tensor_types(gguf)
    tied = _tied(ref_dir)
    windows = gguf_check.windows_for(ref_dir, tokens=tokens, window=window, stride=stride)
    t0 = time.perf_counter()
    reference = fidelity.HFLogitSource(ref_dir, "float32").logprobs(windows, top_k=None)
    seconds["score_reference"] = time.perf_counter() - t0
    ref_bytes = (ref_dir / "model.safetensors").stat().st_size

    rows: dict[str, dict[str, Any]] = {}
    scored: dict[str, Any] = {}
    built: dict[str, Path] = {}
    for variant in variants:
        t0 = time.perf_counter()
        if variant.keep is not None:
            int4_dir = built[first.name]
        else:
            out = work / f"{variant.name}-cpu_int4"
            settings = first.build if variant.name == "again" else variant.build
            # The first variant and its repeat run the product path from the file; the other builds
            # start from the conversion already made (the same first step), which saves a conversion each.
            if variant is first or variant.name == "again":
                build_cpu_int4_checkpoint(gguf, out, progress=progress, **settings)
            else:
                build_cpu_int4_checkpoint(ref_dir, out, progress=progress, **_as_gguf(settings, gguf),
                                          grids=grid_file if variant.grids else None)
            built[variant.name] = int4_dir = out
        keep = kept_modules(variant, types, tied)
        dq = work / f"{variant.name}-dequantized"
        sizes = dequantize_cpu_int4(int4_dir, dq, keep_from=ref_dir if keep else None, keep=keep)
        cand = fidelity.HFLogitSource(dq, "float32").logprobs(windows, top_k=None)
        shutil.rmtree(dq)
        scored[variant.name] = cand
        rows[variant.name] = {
            "describe": variant.describe,
            "builder": variant.build,
            "kept_bf16": keep,
            "kept_types": sorted({types.get(m, "?") for m in keep}),
            "weights_bytes": sizes["with_kept"],
            "buildable": variant.keep is None,
            **figures(reference, cand),
            "seconds": round(time.perf_counter() - t0, 2),
        }
    base = first.name
    noise = 0.0
    if "again" in scored:
        noise = paired_difference(reference, scored[base], scored["again"])["mean"]
    for name, row in rows.items():
        if name != base:
            row["vs_first"] = paired_difference(reference, scored[base], scored[name])
            row["vs_first"]["verdict"] = verdict(row["vs_first"], noise)

    result: dict[str, Any] = {
        "gguf": gguf.name, "gguf_bytes": gguf.stat().st_size,
        "gguf_sha256": _sha256(gguf),
        "architecture": json.loads((ref_dir / "config.json").read_text()).get("model_type"),
        "tied": tied, "tensor_types": _type_counts(types), "main_type": main_linear_type(types),
        "promoted": promoted_tensors(types), "reference_bytes": ref_bytes,
        "positions": reference.tokens, "windows": len(windows), "window": window, "stride": stride,
        "variants": rows, "identical_run_noise": noise,
    }
    if llamacpp:
        t0 = time.perf_counter()
        plan = gguf_check.CheckPlan(gguf=gguf, hf_dir=ref_dir, windows=windows, vocab=0, top_k=0)
        # Reference: llama.cpp on the file; candidate: our conversion, as scored above.
        result["floor_llamacpp_vs_conversion"] = figures(gguf_check.llamacpp_reference(plan), reference)
        seconds["llamacpp"] = time.perf_counter() - t0
    if use_vllm:
        t0 = time.perf_counter()
        served_builds = {n: d for n, d in built.items() if n != "again"}
        result["served"] = served_figures(ref_dir, served_builds, windows, work)
        seconds["vllm"] = time.perf_counter() - t0
    result["seconds"] = {k: round(v, 2) for k, v in seconds.items()}
    return result


def served_figures(ref_dir: Path, builds: dict[str, Path], windows, work: Path, top_k: int = 64) -> dict[str, Any]:
    """vLLM on the bf16 conversion (twice) and on each cpu_int4 build, top-k prompt logprobs."""
    from vllm_omni_edge_bench.harness import gguf_check

    dirs = [ref_dir, ref_dir, *builds.values()]
    plans = [gguf_check.CheckPlan(gguf=Path("-"), hf_dir=d, windows=windows, vocab=0, top_k=top_k) for d in dirs]
    bf16, bf16_again, *served = gguf_check.vllm_candidates(plans, work)
    return {"top_k": top_k, "bf16_vs_bf16_again": figures(bf16, bf16_again),
            "builds": {name: figures(bf16, lp) for name, lp in zip(builds, served)}}


def _type_counts(types: dict[str, str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for t in types.values():
        counts[t] = counts.get(t, 0) + 1
    return dict(sorted(counts.items()))


def _sha256(path: Path) -> str:
    from vllm_omni_edge.models.gguf_serving import file_sha256

    return file_sha256(path, show_progress=False)


# ---------------------------------------------------------------------------
# Report


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def render_report(label: str, results: Sequence[dict[str, Any]], box: str, command: str) -> str:
    lines = [f"# GGUF re-quantization: {label}", "",
             f"Box: {box}. Command: `{command}`.", "",
             "Reference: our reader's bf16 conversion of the file (the GGUF's own dequantization). "
             "Each candidate is the cpu_int4 build from the file turned back into the weights it stores; "
             "both scored by transformers in float32, whole vocabulary (exact KL, nats). "
             "Δ KL: candidate minus the first variant, per position, ± its standard error; "
             "a verdict needs |Δ| above twice that and above the identical-run noise.", ""]
    for r in results:
        lines += [f"## {r['gguf']} ({r['architecture']}{', tied' if r['tied'] else ''})", "",
                  f"SHA-256 `{r['gguf_sha256'][:16]}…`, {_mib(r['gguf_bytes'])} MiB; matrices by type "
                  f"{r['tensor_types']}, main {r['main_type']}; stored at more bits: "
                  f"{len(r['promoted'])} ({_summarize(r['promoted'])}). "
                  f"{r['positions']} positions ({r['windows']} windows of {r['window']}, stride {r['stride']}); "
                  f"bf16 reference weights {_mib(r['reference_bytes'])} MiB.", "",
                  "| variant | KL mean | KL p99 | same top-1 | PPL ratio | weights MiB | Δ KL vs first | verdict |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, v in r["variants"].items():
            d = v.get("vs_first")
            delta = f"{d['mean']:+.2e} ± {d['se']:.1e}" if d else "-"
            lines.append(f"| {name} | {v['kld_mean']:.2e} | {v['kld_p99']:.2e} | {v['same_top1']:.3f} | "
                         f"{v['ppl_ratio']:.4f} | {_mib(v['weights_bytes'])} | {delta} | "
                         f"{d['verdict'] if d else '-'} |")
        lines.append("")
        for name, v in r["variants"].items():
            lines.append(f"- {name}: {v['describe']}" + (f"; kept bf16: {_summarize(v['kept_bf16'])}"
                                                       if v["kept_bf16"] else ""))
        floor = r.get("floor_llamacpp_vs_conversion")
        if floor:
            lines += ["", f"Floor, llama.cpp on the file (reference) vs our bf16 conversion (transformers "
                          f"float32): KL mean {floor['kld_mean']:.2e}, p99 {floor['kld_p99']:.2e}, same top-1 "
                          f"{floor['same_top1']:.3f} ({floor['kld_form']})."]
        served = r.get("served")
        if served:
            b = served["bf16_vs_bf16_again"]
            lines += ["", f"Served: vLLM on each build vs vLLM on the bf16 conversion (top {served['top_k']} prompt "
                          f"logprobs: a lower bound of the KL); a second bf16 engine: KL mean {b['kld_mean']:.2e}, "
                          f"same top-1 {b['same_top1']:.3f}.", "",
                      "| build (served) | KL mean (lower bound) | same top-1 | resolved mass |", "|---|---|---|---|"]
            for name, a in served["builds"].items():
                lines.append(f"| {name} | {a['kld_mean']:.2e} | {a['same_top1']:.3f} | "
                             f"{a['resolved_mass_mean']:.3f} |")
        lines.append("")
    return "\n".join(lines)


def _summarize(names: Sequence[str]) -> str:
    if not names:
        return "none"
    kinds: dict[str, int] = {}
    for n in names:
        kind = n.rsplit(".", 1)[-1] if n.startswith("model.layers.") else n
        kinds[kind] = kinds.get(kind, 0) + 1
    return ", ".join(f"{k} ×{c}" if c > 1 else k for k, c in sorted(kinds.items()))


def default_out_dir(label: str) -> Path:
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    return REPO / "results" / f"{date}-gguf-requant-{label}"


def parse_variants(text: str) -> list[Variant]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise RequantError(f"unknown variant(s) {unknown} (known: {', '.join(VARIANTS)})")
    variants = [VARIANTS[n] for n in names]
    check_variants(variants)
    return variants


def check_variants(variants: Sequence[Variant]) -> None:
    if not variants:
        raise RequantError("no variants to measure")
    first = variants[0]
    if first.keep is not None or first.name == "again":
        raise RequantError(f"the first variant must be a build (differences are taken from it), not {first.name!r}")
    if len({v.name for v in variants}) != len(variants):
        raise RequantError("a variant is listed twice")


def write_results(out: Path, label: str, results: Sequence[dict[str, Any]], box: str, command: str,
                  prov: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "requant.json").write_text(json.dumps({"label": label, "box": box, "command": command,
                                                  "results": list(results)}, indent=2) + "\n")
    (out / "provenance.json").write_text(json.dumps(prov, indent=2, default=str) + "\n")
    (out / "report.md").write_text(render_report(label, results, box, command))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", nargs="+", type=Path)
    parser.add_argument("--label", required=True, help="results directory suffix (e.g. the model)")
    parser.add_argument("--out", type=Path, help="results directory [results/<date>-gguf-requant-LABEL]")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated; the first is a build the others are compared with "
                             f"(known: {', '.join(VARIANTS)}) [%(default)s]")
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS)
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    parser.add_argument("--stride", type=int, default=DEFAULT_STRIDE)
    parser.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp floor")
    parser.add_argument("--vllm", action="store_true",
                        help="also score each build served by vLLM against the bf16 conversion served by vLLM")
    parser.add_argument("--work", type=Path, help="scratch directory [a temporary one]")
    parser.add_argument("--box", default=None, help="box description for the report [from /proc/cpuinfo]")
    args = parser.parse_args(argv)
    try:
        variants = parse_variants(args.variants)
        for g in args.gguf:
            if not g.is_file():
                raise RequantError(f"GGUF file not found: {g}")
    except RequantError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = args.out or default_out_dir(args.label)
    prov = provenance.collect(json.dumps(vars(args), default=str), argv)
    box = args.box or (prov["cpu"].get("model_name") or "unknown CPU")
    command = "python -m vllm_omni_edge_bench.harness.gguf_requant " + " ".join(
        sys.argv[1:] if argv is None else argv)
    results: list[dict[str, Any]] = []
    for g in args.gguf:
        with tempfile.TemporaryDirectory(prefix="gguf-requant-", dir=args.work) as tmp:
            results.append(measure_file(g, Path(tmp), variants, tokens=args.tokens, window=args.window,
                                        stride=args.stride, llamacpp=not args.no_llamacpp,
                                        use_vllm=args.vllm))
        # Written after every file, so a long run's finished files are kept.
        prov["finished"] = provenance.now_iso() if len(results) == len(args.gguf) else None
        write_results(out, args.label, results, box, command, prov)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
