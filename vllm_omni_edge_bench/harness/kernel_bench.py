"""Per-kernel, per-phase timings of the cpu_int4 paths: the measurements routing is built on.

    python -m vllm_omni_edge_bench.harness.kernel_bench --model default --passes 5 [--out DIR]

For every linear shape of the model (K x N of q/k/v, o, gate/up, down and the head)
and each phase (decode: M=1 row; prefill: M=512 rows), every path this CPU can run
is timed, the paths interleaved within a pass (A B C A B C ...), in one process with
the thread count vLLM gives its worker. Paths: the cpu_int4 kernels (``int4pack``,
``dequant``, ``amx_w4a8`` where it exists) and ``dense``: ``F.linear`` on a dense copy
in the activation dtype, which is what the second layout
(``VLLM_OMNI_EDGE_INT4_LAYOUTS=two``) runs for prefill.

A figure is the time of one forward's worth of linear calls, made as a forward makes
them: every layer has its own weights (same values, separate memory), called in model
order, so weights stream from memory as in decode rather than sitting in L2 after the
first call (the method before 2026-12-01 timed one layer per shape and multiplied by
the layer count: hot-cache times, which ranked ``avx2_w4a8`` ahead of ``int4pack`` on
both boxes while it decoded slower end to end). Fastest of ``--repeats`` forwards per
pass; median over passes with min and max. Kernel-level, not end to end: the grids
show the end-to-end effect of the path the router picks.
The artifact carries provenance like a grid's; copied into ``routing_sources/``, it feeds
``edge-harness routing-table``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from vllm_omni_edge_bench.harness import provenance
from vllm_omni_edge_bench.harness.runner import RESULTS_ROOT
from vllm_omni_edge.atomic import atomic_write_bytes

PHASES = {"decode": 1, "prefill": 512}
DENSE = "dense"


def model_linear_shapes(config: dict[str, Any]) -> list[tuple[str, int, int, int]]:
    """(name, K, N, count per forward) for a llama/qwen2 config, as vLLM merges them."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    layers = config["num_hidden_layers"]
    return [
        ("qkv_proj", hidden, (heads + 2 * kv_heads) * head_dim, layers),
        ("o_proj", heads * head_dim, hidden, layers),
        ("gate_up_proj", hidden, 2 * inter, layers),
        ("down_proj", inter, hidden, layers),
        ("lm_head", hidden, config["vocab_size"], 1),
    ]


def _paths(group_size: int, K: int, N: int, dtype: torch.dtype) -> dict[str, Any]:
    from vllm_omni_edge.quantization.kernels import PREFERENCE, CpuFeatures

    features = CpuFeatures.detect()
    usable = {}
    for kernel_cls in PREFERENCE:
        float_zero = _zero_point(kernel_cls) == "float"
        ok, why = kernel_cls.can_implement(features, group_size, K, N, dtype, float_zero=float_zero)
        usable[kernel_cls.name] = (kernel_cls if ok else None, why)
    usable[DENSE] = (DENSE, "F.linear on a dense copy in the activation dtype")
    return usable


def _triple(K: int, N: int, group_size: int, zero_point: str, seed: int):
    from vllm_omni_edge.quantization import int4

    gen = torch.Generator().manual_seed(seed)
    return int4.quantize(torch.randn(N, K, generator=gen) * 0.02, group_size, zero_point=zero_point)


def _layer(kernel_cls, triple, K: int, group_size: int, dtype: torch.dtype):
    """One layer of this path with its own copy of the weights."""
    from vllm_omni_edge.quantization import int4

    layer = torch.nn.Module()
    if kernel_cls == DENSE:
        layer.dense = int4.dequantize(*triple, dtype=dtype)
        return lambda x: F.linear(x, layer.dense)
    for name, t in zip(("qweight", "scales", "zeros"), triple):
        layer.register_parameter(name, torch.nn.Parameter(t.clone(), requires_grad=False))
    layer.int4_in_features, layer.int4_group_size, layer.int4_act_dtype = K, group_size, dtype
    kernel = kernel_cls()
    kernel.process_weights(layer)
    return lambda x: kernel.apply(layer, x, None)


def _zero_point(kernel_cls) -> str:
    # W4A8 on AMX needs integer zero points; the others run the default float offsets.
    return "int" if getattr(kernel_cls, "name", "") == "amx_w4a8" else "float"


def _time_forward(calls, repeats: int) -> float:
    """Fastest of ``repeats`` forwards; ``calls`` is [(fn, x)] in model order."""
    for fn, x in calls:  # warm: first-call allocations and any lazy init
        fn(x)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for fn, x in calls:
            fn(x)
        best = min(best, time.perf_counter() - start)
    return best


def _model_order(shapes, layers: dict[str, list]) -> list:
    """[(shape name, layer fn)] as a forward calls them: each decoder layer's shapes, then the head."""
    per_layer = [name for name, _K, _N, count in shapes if count > 1]
    once = [name for name, _K, _N, count in shapes if count == 1]
    depth = max(count for _name, _K, _N, count in shapes)
    order = [(name, layers[name][i]) for i in range(depth) for name in per_layer if i < len(layers[name])]
    return order + [(name, layers[name][0]) for name in once]


def run(config: dict[str, Any], passes: int, group_size: int, threads: int, repeats: int,
        dtype: torch.dtype = torch.bfloat16, only_paths: list[str] | None = None,
        phases: list[str] | None = None) -> dict[str, Any]:
    torch.set_num_threads(threads)
    shapes = model_linear_shapes(config)
    phases = {p: PHASES[p] for p in (phases or PHASES)}
    timings: dict[str, dict[str, list[float]]] = {}
    refused: dict[str, str] = {}
    layers: dict[str, dict[str, list]] = {}  # path -> shape name -> one fn per layer
    for name, K, N, count in shapes:
        triples = {}
        for path, (impl, why) in _paths(group_size, K, N, dtype).items():
            if only_paths and path not in only_paths:
                continue
            if impl is None:
                refused[path] = why
                continue
            zero_point = _zero_point(impl)
            if zero_point not in triples:
                triples[zero_point] = _triple(K, N, group_size, zero_point, seed=K * 7 + N)
            layers.setdefault(path, {})[name] = [
                _layer(impl, triples[zero_point], K, group_size, dtype) for _ in range(count)]
    # A path that cannot run one shape cannot run the model.
    paths = sorted(path for path, by_shape in layers.items() if len(by_shape) == len(shapes))
    inputs = {(name, phase): torch.randn(m, K).to(dtype) for name, K, _, _ in shapes for phase, m in phases.items()}
    for pass_index in range(passes):
        for phase in phases:
            # Interleaved: every path once per phase before the next pass.
            for path in paths:
                calls = [(fn, inputs[(name, phase)]) for name, fn in _model_order(shapes, layers[path])]
                timings.setdefault(phase, {}).setdefault(path, []).append(_time_forward(calls, repeats) * 1000)
    summary = {
        phase: {
            path: {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v), "passes_ms": v}
            for path, v in by_path.items()
        }
        for phase, by_path in timings.items()
    }
    return {"shapes": shapes, "group_size": group_size, "threads": threads, "repeats": repeats,
            "method": "forward over distinct layers, model order, fastest of repeats",
            "dtype": str(dtype).removeprefix("torch."), "phases": phases, "refused": refused,
            "summary": summary}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="checkpoint dir or embedded model name (its config.json)")
    parser.add_argument("--passes", type=int, default=5, help="interleaved passes (>= 3)")
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None,
                        help="threads (default: the usable cores minus vLLM's reserved ones, as its worker gets)")
    parser.add_argument("--repeats", type=int, default=3, help="timed forwards per pass; the fastest counts")
    parser.add_argument("--out", type=Path, default=None, help="results directory [results/<date>-kernel-paths-<model>]")
    parser.add_argument("--paths", default=None,
                        help="comma-separated paths to time (default: every path this CPU can run); "
                        "an artifact with a subset does not feed the routing table")
    parser.add_argument("--phases", default=None, help=f"comma-separated subset of {', '.join(PHASES)}")
    args = parser.parse_args(argv)
    if args.passes < 3:
        parser.error("--passes must be at least 3 (medians need 3)")
    only_paths = args.paths.split(",") if args.paths else None
    phases = args.phases.split(",") if args.phases else None
    if phases and not set(phases) <= set(PHASES):
        parser.error(f"--phases: choose from {', '.join(PHASES)}")
    from vllm_omni_edge_bench.harness.grid import resolve_model
    from vllm_omni_edge.cpu_features import usable_cores
    from vllm_omni_edge.routing.cpu_classes import cpu_class
    from vllm_omni_edge.patches.frontend.reserved_cores import default_reserved_cores

    model_dir = Path(resolve_model(args.model))
    config = json.loads((model_dir / "config.json").read_text())
    threads = args.threads or max(1, usable_cores() - (default_reserved_cores(usable_cores()) or 1))
    record = {"provenance": provenance.collect(grid_text="", argv=sys.argv), "model": args.model,
              "model_dir": str(model_dir), "cpu_class": cpu_class()}
    record["result"] = run(config, args.passes, args.group_size, threads, args.repeats,
                           only_paths=only_paths, phases=phases)
    record["complete"] = only_paths is None and phases is None
    record["provenance"]["finished"] = provenance.now_iso()
    out = args.out or RESULTS_ROOT / f"{time.strftime('%Y-%m-%d')}-kernel-paths-{model_dir.name}"
    atomic_write_bytes(out / "kernel_paths.json", json.dumps(record, indent=2).encode())
    for phase, by_path in record["result"]["summary"].items():
        for path, s in sorted(by_path.items(), key=lambda kv: kv[1]["median_ms"]):
            print(f"{phase:8} {path:10} {s['median_ms']:9.2f} ms  ({s['min_ms']:.2f}-{s['max_ms']:.2f})")
    print(out / "kernel_paths.json")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
