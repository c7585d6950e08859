"""Op-level sweep for the rows16 prefill threshold: W4A8 tiles vs the bf16 GEMM path, by rows.

    python -m vllm_omni_edge_bench.harness.int4_prefill_bench [--rows 1,8,16,32,64,512] [--passes 5]
        [--block-mib 0.5,2,8] [--threads N] [--clock wall|thread] [--json OUT]

``--json`` writes the medians with the box and commit; a results directory holding it as
``int4_prefill_bench.json`` is read by the results index.

For each row count M, the four linears of one Qwen2.5-1.5B decoder layer (qkv 1536x2048,
o 1536x1536, gate_up 1536x17920, down 8960x1536; group 32, synthetic weights) are timed on
``w4a8_vnni_rows16_mm`` with the op's prefill row count set to 0 (W4A8 tiles) and to 1 (the
bf16 path on blocks dequantized per call: oneDNN's GEMM, arm ``bf16``, and, where AMX BF16
tiles are usable, the op's own AMX tiles on blocks dequantized into their k-pair layout, arm
``amx``), and ``torch.mm`` on a dense bf16 copy (the ceiling), arms interleaved within a pass;
median over passes of the layer's summed time. The threshold ``PREFILL_MIN_ROWS`` should be
the smallest M from which the bf16 path (on the GEMM the CPU gets) wins. At 512 rows the bf16
path is also timed per block size (``--block-mib``), on each GEMM. Run it on the CPU
class whose threshold you set (the bf16 path is on by default only where AMX is), with
``ONEDNN_VERBOSE=1`` to see which oneDNN kernel ran (avx512_core_amx on AMX).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

LAYER = (("qkv", 1536, 2048), ("o", 1536, 1536), ("gate_up", 1536, 17920), ("down", 8960, 1536))
GROUP = 32
GEMMS = {"bf16": 0, "amx": 1}  # the bf16 path's arms and set_bf16_prefill's gemm for each


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,16,24,32,48,64,128,512")
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--block-mib", default="0.5,2,8")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall",
                        help="thread: this thread's CPU time (with --threads 1; on a busy box)")
    parser.add_argument("--json", help="also write the medians here")
    args = parser.parse_args(argv)

    from vllm_omni_edge.quantization import int4
    from vllm_omni_edge.quantization.kernels import native
    from vllm_omni_edge.levers import int4_group_codes
    from vllm_omni_edge.quantization.kernels.w4a8_avx512 import (
        PREFILL_BLOCK_BYTES,
        amx_bf16_usable,
        interleave_rows16,
        rows16_group_codes,
    )

    loaded, why = native.load_library()
    if not loaded:
        sys.exit(f"the rows16 op is not loaded: {why}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "thread" and torch.get_num_threads() != 1:
        sys.exit("--clock thread counts this thread only: use it with --threads 1")
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    ops = torch.ops.edge_cpu_int4
    gen = torch.Generator().manual_seed(0)
    layers = []
    for name, K, N in LAYER:
        q, s, z = int4.quantize(torch.randn(N, K, generator=gen) * 0.05, GROUP)
        # The resident form the product keeps (8-bit group codes unless the lever says bf16).
        if int4_group_codes():
            packed, *codes = rows16_group_codes(q, s, z)
            args_of = (packed, codes[0], codes[1], GROUP, codes[2])
        else:
            args_of = (*interleave_rows16(q, s, z), GROUP)
        layers.append((name, K, args_of, int4.dequantize(q, s, z, dtype=torch.bfloat16)))

    def layer_ms(M: int, arm: str, block_bytes: int = PREFILL_BLOCK_BYTES) -> float:
        total = 0.0
        for _, K, packed, dense in layers:
            x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
            ops.set_bf16_prefill(0 if arm == "w4a8" else 1, block_bytes, GEMMS.get(arm, 0))
            t0 = clock()
            if arm == "dense":
                torch.mm(x, dense.t())
            else:
                ops.w4a8_vnni_rows16_mm(x, *packed)
            total += clock() - t0
        return total * 1e3

    results: dict[str, dict[str, float]] = {}
    arms = ("w4a8", "bf16", "amx", "dense") if amx_bf16_usable() else ("w4a8", "bf16", "dense")
    fast = "amx" if "amx" in arms else "bf16"  # the GEMM the lever gives this CPU
    print(f"threads {torch.get_num_threads()}, {args.clock} clock; ms per layer (4 linears), median of {args.passes}")
    print(f"{'rows':>5} " + " ".join(f"{a:>9}" for a in arms) + f"  {fast}/w4a8")
    for M in (int(r) for r in args.rows.split(",")):
        for arm in arms:
            layer_ms(M, arm)  # warm: oneDNN primitives, the scratch
        times = {arm: [] for arm in arms}
        for _ in range(args.passes):
            for arm in arms:
                times[arm].append(layer_ms(M, arm))
        med = {arm: statistics.median(v) for arm, v in times.items()}
        results[str(M)] = med
        print(f"{M:>5} " + " ".join(f"{med[a]:>9.2f}" for a in arms) + f"  {med[fast] / med['w4a8']:.2f}",
              flush=True)
    blocks: dict[str, dict[str, float]] = {}
    for arm in [a for a in arms if a in GEMMS]:
        blocks[arm] = {}
        for mib in (float(b) for b in args.block_mib.split(",")):
            nbytes = int(mib * (1 << 20))
            layer_ms(512, arm, nbytes)
            blocks[arm][str(mib)] = statistics.median(layer_ms(512, arm, nbytes) for _ in range(args.passes))
            print(f"512 rows, {arm} path, {mib} MiB blocks: {blocks[arm][str(mib)]:.2f} ms", flush=True)
    ops.set_bf16_prefill(0, PREFILL_BLOCK_BYTES)
    crossover = next((int(M) for M, med in results.items() if med[fast] < med["w4a8"]), None)
    print(f"smallest swept row count where the bf16 path ({fast}) wins: {crossover}")
    if args.json:
        from vllm_omni_edge_bench.harness.provenance import cpu_description, git_state, now_iso

        with open(args.json, "w") as fh:
            json.dump({"threads": torch.get_num_threads(), "clock": args.clock, "passes": args.passes,
                       "layer_ms": results, "block_ms_512": blocks, "crossover_rows": crossover,
                       "crossover_gemm": fast,
                       "cpu": cpu_description(), "git": git_state(), "recorded_at": now_iso()}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
