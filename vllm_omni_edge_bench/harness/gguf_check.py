"""Our GGUF -> Hugging Face conversion, checked against llama.cpp on the same file.

For each GGUF: convert it (``vllm_omni_edge.models.gguf_to_hf``), cut token-id
windows from the fixed text with the converted tokenizer, and score the same ids
with

- llama.cpp (``vllm_omni_edge_bench.baselines.llamacpp``) on the GGUF itself: the reference, every
  position's logits, dense, float64 log-softmax;
- vLLM ``LLM()`` on the converted bf16 checkpoint (prompt logprobs, top k), the
  candidate that matters. vLLM runs in one child process for all files, one
  engine after the other (an engine start costs far more than the scoring);
- optionally transformers on the converted checkpoint (a cheap second reference,
  never instead of llama.cpp).

Figures per file and candidate: :func:`fidelity.compare` (mean/p99/max KL of
llama.cpp's distribution to the candidate's, same top-1). The tokenizer is
checked too: llama.cpp's ids for a sample text against the converted tokenizer's.

    python -m vllm_omni_edge_bench.harness.gguf_check FILE.gguf [...] [--tokens 256] [--transformers] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from vllm_omni_edge_bench.harness import fidelity
from vllm_omni_edge_bench.harness.fidelity import PositionLogprobs, Window

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_CHECK_TEXT = ("The quick brown fox jumps over the lazy dog. 1234567 tokens, don't stop!\n"
                        "  Indented line\twith tab: café, naïve, and   spaces.")
_FIELDS = ("target_ids", "target", "top1", "logprobs", "ids", "rest")


@dataclass
class CheckPlan:
    """One GGUF file, its converted checkpoint and the windows all engines score."""

    gguf: Path
    hf_dir: Path
    windows: list[Window]
    vocab: int
    top_k: int  # prompt logprobs asked of vLLM
    seconds: dict[str, float] = field(default_factory=dict)


def save_positions(path: Path, lp: PositionLogprobs) -> None:
    arrays = {k: getattr(lp, k) for k in _FIELDS if getattr(lp, k) is not None}
    np.savez(path, **arrays)


def load_positions(path: Path) -> PositionLogprobs:
    with np.load(path) as data:
        return PositionLogprobs(**{k: data[k] for k in _FIELDS if k in data.files})


def windows_for(hf_dir: Path, *, tokens: int, window: int, stride: int) -> list[Window]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    return fidelity.score_windows(tok, fidelity.load_text(), window, stride, max_tokens=tokens)


def prepare(gguf: Path, work: Path, *, tokens: int = 256, window: int = 128, stride: int = 64,
            top_k: int | None = None, hf_dir: Path | None = None) -> CheckPlan:
    """Convert ``gguf`` (unless ``hf_dir`` already holds its conversion) and cut the windows."""
    from vllm_omni_edge.models.gguf_to_hf import convert_gguf_to_hf

    t0 = time.perf_counter()
    if hf_dir is None:
        hf_dir = work / f"{gguf.stem}-bf16"
        convert_gguf_to_hf(gguf, hf_dir)
    convert_s = time.perf_counter() - t0
    vocab = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    plan = CheckPlan(gguf=gguf, hf_dir=hf_dir, windows=windows_for(hf_dir, tokens=tokens, window=window,
                                                                     stride=stride),
                     vocab=vocab, top_k=min(top_k or 64, vocab))
    plan.seconds["convert"] = convert_s
    return plan


def llamacpp_reference(plan: CheckPlan) -> PositionLogprobs:
    from vllm_omni_edge_bench.baselines.llamacpp import LlamaCppEngine, LlamaCppOptions

    n_ctx = max(len(w.ids) for w in plan.windows)
    # f32 KV cache: the reference's own rounding kept out of the comparison.
    engine = LlamaCppEngine(plan.gguf, LlamaCppOptions(n_ctx=max(n_ctx, 64), n_batch=512, n_ubatch=512,
                                                       n_threads=2, type_k="f32", type_v="f32"), echo_log=False)
    try:
        return fidelity.LlamaCppLogitSource(engine).logprobs(plan.windows, top_k=None)
    finally:
        engine.close()


def llamacpp_tokens(gguf: Path, text: str) -> list[int]:
    from vllm_omni_edge_bench.baselines.llamacpp import vocab_tokens

    return vocab_tokens(gguf, text)


def tokenizer_check(plan: CheckPlan, text: str = TOKENIZER_CHECK_TEXT) -> dict[str, Any]:
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(str(plan.hf_dir), local_files_only=True).encode(
        text, add_special_tokens=False)
    theirs = llamacpp_tokens(plan.gguf, text)
    first = next((i for i, (a, b) in enumerate(zip(ours + [-1], theirs + [-1])) if a != b), None)
    return {"same_ids": ours == theirs, "first_difference": first, "tokens": len(theirs)}


def transformers_candidate(plan: CheckPlan, dtype: str = "float32") -> PositionLogprobs:
    import torch

    torch.set_num_threads(2)
    return fidelity.HFLogitSource(plan.hf_dir, dtype=dtype).logprobs(plan.windows, top_k=None)


# ---------------------------------------------------------------------------
# vLLM, in a child process


def _vllm_child(job_path: str) -> None:
    """Score each job's windows with one LLM() after another; write each result's npz."""
    import gc

    from vllm import LLM

    job = json.loads(Path(job_path).read_text())
    for item in job["items"]:
        t0 = time.perf_counter()
        llm = LLM(model=item["model"], max_model_len=item["max_model_len"], enforce_eager=True,
                  max_logprobs=item["top_k"], dtype="bfloat16", seed=0, max_num_seqs=4)
        started = time.perf_counter() - t0
        windows = [Window(ids=tuple(w[0]), score_from=w[1], start=w[2]) for w in item["windows"]]
        t1 = time.perf_counter()
        lp = fidelity.VllmPromptLogprobSource(llm).logprobs(windows, top_k=item["top_k"])
        save_positions(Path(item["out"]), lp)
        Path(item["out"] + ".json").write_text(json.dumps({"start_s": started,
                                                           "score_s": time.perf_counter() - t1}))
        del llm
        gc.collect()


def vllm_candidates(plans: Sequence[CheckPlan], work: Path, *, timeout: float = 900) -> list[PositionLogprobs]:
    """Every plan scored by vLLM in one child process (engines one after the other)."""
    items = []
    for i, plan in enumerate(plans):
        items.append({"model": str(plan.hf_dir), "top_k": plan.top_k, "out": str(work / f"vllm-{i}.npz"),
                      "max_model_len": max(len(w.ids) for w in plan.windows) + 8,
                      "windows": [[list(w.ids), w.score_from, w.start] for w in plan.windows]})
    job = work / "vllm-job.json"
    job.write_text(json.dumps({"items": items}))
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # A second engine in one process sees the embedding_prepack patch take effect, and a tied
    # head (vLLM's lm_head *is* embed_tokens then) is left without its matmul: vLLM's own
    # behaviour for embeddings, which changes memory, not numbers.
    env["VLLM_OMNI_EDGE_EMBED_PREPACK"] = "1"
    env["PYTHONPATH"] = f"{REPO}:{env.get('PYTHONPATH', '')}"
    code = "import sys; from vllm_omni_edge_bench.harness.gguf_check import _vllm_child; _vllm_child(sys.argv[1])"
    proc = subprocess.run([sys.executable, "-c", code, str(job)], env=env, cwd=str(REPO), capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM child failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    out = []
    for plan, item in zip(plans, items):
        timing = json.loads(Path(item["out"] + ".json").read_text())
        plan.seconds["vllm_start"] = timing["start_s"]
        plan.seconds["vllm_score"] = timing["score_s"]
        out.append(load_positions(Path(item["out"])))
    return out


# ---------------------------------------------------------------------------
# The whole check


def _figures(reference: PositionLogprobs, candidate: PositionLogprobs) -> dict[str, Any]:
    c = fidelity.compare(reference, candidate)
    keys = ("kld_mean", "kld_p99", "kld_max", "same_top1", "ppl_ratio", "tokens", "kld_form", "resolved_mass_mean")
    return {k: c[k] for k in keys}


def check(ggufs: Sequence[Path], work: Path, *, tokens: int = 256, window: int = 128, stride: int = 64,
          use_vllm: bool = True, use_transformers: bool = False, top_k: int | None = None,
          hf_dirs: Sequence[Path | None] | None = None) -> list[dict[str, Any]]:
    plans = [prepare(Path(g), work, tokens=tokens, window=window, stride=stride, top_k=top_k,
                     hf_dir=None if hf_dirs is None else hf_dirs[i]) for i, g in enumerate(ggufs)]
    results = []
    refs = []
    for plan in plans:
        t0 = time.perf_counter()
        refs.append(llamacpp_reference(plan))
        plan.seconds["llamacpp"] = time.perf_counter() - t0
    vllm = vllm_candidates(plans, work) if use_vllm else [None] * len(plans)
    for plan, ref, cand in zip(plans, refs, vllm):
        from gguf import GGUFReader
        from gguf import GGMLQuantizationType as T

        reader = GGUFReader(str(plan.gguf))
        types = sorted({T(t.tensor_type).name for t in reader.tensors})
        row: dict[str, Any] = {
            "gguf": plan.gguf.name, "architecture": reader.fields["general.architecture"].contents(),
            "tensor_types": types, "windows": len(plan.windows), "window": window,
            "tokenizer": tokenizer_check(plan),
        }
        if cand is not None:
            row["vllm"] = _figures(ref, cand)
        if use_transformers:
            t0 = time.perf_counter()
            row["transformers"] = _figures(ref, transformers_candidate(plan))
            plan.seconds["transformers"] = time.perf_counter() - t0
        row["seconds"] = {k: round(v, 2) for k, v in plan.seconds.items()}
        results.append(row)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", nargs="+", type=Path)
    parser.add_argument("--tokens", type=int, default=256, help="tokens of the fixed text scored (default 256)")
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--stride", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=None, help="vLLM prompt logprobs (default min(vocab, 64))")
    parser.add_argument("--transformers", action="store_true", help="also score with transformers")
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gguf-check-") as tmp:
        results = check(args.gguf, Path(tmp), tokens=args.tokens, window=args.window, stride=args.stride,
                        use_vllm=not args.no_vllm, use_transformers=args.transformers, top_k=args.top_k)
    text = json.dumps(results, indent=2)
    if args.json:
        args.json.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
