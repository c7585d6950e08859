"""This box's memory-bandwidth ceiling, STREAM-style, and what it means for decode.

    python -m vllm_omni_edge_bench.harness.bandwidth --out bandwidth.json [--threads 1 2] [--runs 5]

Copy (``b = a``, 2 x 4 bytes moved per element) and triad (``a = b + s*c``,
3 x 4 bytes) on float32 arrays at least 8x the last-level cache, with PyTorch's
parallel kernels at 1 and 2 threads; each figure is the median of ``runs``
timed repetitions, with min and max. Bytes are counted as STREAM does (write
allocation's extra read is not counted), so the figure is a floor of what the
memory system moved.

Decode is memory-bound: each generated token reads every weight once. The
ceiling for an engine is ``bandwidth / bytes read per token``;
:func:`decode_ceiling` computes it and :func:`fraction_of_ceiling` says how
close a measured decode came. Put the JSON next to a grid's artifacts as
``bandwidth.json`` and ``edge-harness report`` adds the section.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

FLOAT32_BYTES = 4
MIB = 1 << 20
MIN_ARRAY_BYTES = 64 * MIB
LLC_MULTIPLE = 8
KERNELS = {"copy": 2, "triad": 3}  # arrays touched per element


def last_level_cache_bytes(sys_cpu: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int | None:
    """Largest cache of cpu0 from sysfs (``32768K`` -> bytes); None if unknown."""
    sizes = []
    for index in sys_cpu.glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        if text and text[-1] in units and text[:-1].isdigit():
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes) if sizes else None


def array_bytes_for(llc_bytes: int | None) -> int:
    """Bytes per array: at least LLC_MULTIPLE x the LLC and MIN_ARRAY_BYTES, so caches cannot serve it."""
    return max(MIN_ARRAY_BYTES, LLC_MULTIPLE * (llc_bytes or 0))


def bytes_moved(kernel: str, elements: int) -> int:
    return KERNELS[kernel] * elements * FLOAT32_BYTES


def summarise_runs(bytes_per_run: int, seconds: Sequence[float]) -> dict[str, float]:
    """GB/s (1e9 bytes) of each run; median with min and max."""
    if not seconds or min(seconds) <= 0:
        raise ValueError("need at least one positive timing")
    rates = [bytes_per_run / s / 1e9 for s in seconds]
    return {"median_gbps": statistics.median(rates), "min_gbps": min(rates), "max_gbps": max(rates),
            "runs": len(rates), "seconds": list(seconds)}


def measure(threads: Sequence[int] = (1, 2), runs: int = 5, array_bytes: int | None = None,
            clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    import torch

    if runs < 3:
        raise ValueError(f"runs must be at least 3 for a median with spread, got {runs}")
    llc = last_level_cache_bytes()
    size = array_bytes or array_bytes_for(llc)
    n = size // FLOAT32_BYTES
    a = torch.ones(n, dtype=torch.float32)
    b = torch.full((n,), 2.0, dtype=torch.float32)
    c = torch.zeros(n, dtype=torch.float32)
    kernels = {"copy": lambda: b.copy_(a), "triad": lambda: torch.add(b, c, alpha=3.0, out=a)}
    before = torch.get_num_threads()
    results: dict[str, Any] = {}
    try:
        for t in threads:
            torch.set_num_threads(t)
            per_kernel = {}
            for name, fn in kernels.items():
                fn()  # touch every page once before timing
                seconds = []
                for _ in range(runs):
                    start = clock()
                    fn()
                    seconds.append(clock() - start)
                per_kernel[name] = summarise_runs(bytes_moved(name, n), seconds)
            results[str(t)] = per_kernel
    finally:
        torch.set_num_threads(before)
    return {"array_bytes": n * FLOAT32_BYTES, "llc_bytes": llc, "runs": runs, "threads": results,
            "method": "torch float32, copy b=a (8 B/element), triad a=b+3c (12 B/element); STREAM byte counting"}


def best_bandwidth_gbps(artifact: dict[str, Any], threads: int | None = None, kernel: str = "copy") -> float:
    """Median GB/s of ``kernel`` at ``threads`` (default: the best thread count measured)."""
    table = artifact["threads"]
    if threads is not None:
        return table[str(threads)][kernel]["median_gbps"]
    return max(entry[kernel]["median_gbps"] for entry in table.values())


def decode_ceiling(weight_bytes_per_token: float, bandwidth_gbps: float) -> float:
    """Tokens/s if every token read ``weight_bytes_per_token`` at ``bandwidth_gbps`` and did nothing else."""
    if weight_bytes_per_token <= 0 or bandwidth_gbps <= 0:
        raise ValueError("bytes per token and bandwidth must be positive")
    return bandwidth_gbps * 1e9 / weight_bytes_per_token


def fraction_of_ceiling(decode_tok_s: float, weight_bytes_per_token: float, bandwidth_gbps: float) -> float:
    return decode_tok_s / decode_ceiling(weight_bytes_per_token, bandwidth_gbps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="JSON artifact to write")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--array-mib", type=int, default=None, help="bytes per array [8x LLC, at least 64 MiB]")
    args = parser.parse_args(argv)
    from vllm_omni_edge_bench.harness import provenance
    from vllm_omni_edge.atomic import atomic_write_bytes

    started = provenance.now_iso()
    result = measure(args.threads, args.runs, args.array_mib * MIB if args.array_mib else None)
    artifact = {
        **result,
        "provenance": {"started": started, "finished": provenance.now_iso(), "git": provenance.git_state(),
                       "cpu": provenance.cpu_description(), "memory": provenance.memory_description(),
                       "env": provenance.relevant_env(), "command": [sys.executable, "-m", __spec__.name, *(argv or sys.argv[1:])]},
    }
    atomic_write_bytes(args.out, json.dumps(artifact, indent=2, default=str).encode())
    for t, kernels in result["threads"].items():
        line = ", ".join(f"{k} {v['median_gbps']:.1f} GB/s ({v['min_gbps']:.1f}-{v['max_gbps']:.1f})"
                         for k, v in kernels.items())
        print(f"{t} thread(s): {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
