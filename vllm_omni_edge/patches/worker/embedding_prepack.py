"""Do not prepack the input embedding for matmuls it never does.

What: wraps ``UnquantizedEmbeddingMethod.process_weights_after_loading`` so that a
``VocabParallelEmbedding`` that is not an output head (``embed_tokens``) skips
``dispatch_cpu_unquantized_gemm``; output heads (tied or not) keep it, as they
do matmuls.
Why: on CPU, vLLM prepacks every unquantized embedding for oneDNN with
``remove_weight=False``, so ``embed_tokens``, which only does ``F.embedding``
lookups, holds its weight plus a prepacked copy nobody reads (read in
``vocab_parallel_embedding.py`` and ``layers/utils.py``; the copy is a fresh oneDNN
allocation). On CPUs where oneDNN cannot build a bf16 matmul (AVX2-only, as on
the AMD EPYC in CI), vLLM falls back to ``F.linear`` and there is no copy to save.
Flag: ``VLLM_OMNI_EDGE_EMBED_PREPACK=1`` restores vLLM's behaviour (the A/B arm).
Verified by: tests/test_levers.py (embed_tokens gets no ``cpu_linear``; a head
does). The memory saved must be measured with the ledger on an AVX-512/AMX box.
Remove when: vLLM skips the prepack for lookup-only embeddings.
"""

from __future__ import annotations

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.model_executor.layers.vocab_parallel_embedding"

RECORD = PatchRecord(
    name="embedding_prepack",
    kind=Kind.LEVER,
    target=f"{TARGET_MODULE}.UnquantizedEmbeddingMethod.process_weights_after_loading",
    process=Process.WORKER,
    why="embed_tokens keeps a oneDNN-prepacked copy of its weight that lookups never read.",
    verified_by="tests/test_levers.py (no prepack on embed_tokens, kept on heads).",
    remove_when="vLLM prepacks only embeddings that are used as matmul weights.",
    upstream="none found",
)


def apply() -> str:
    from vllm_omni_edge.levers import embed_prepack_enabled

    if embed_prepack_enabled():
        return "VLLM_OMNI_EDGE_EMBED_PREPACK=1: vLLM prepacks every embedding"
    now = when_imported(TARGET_MODULE, _wrap)
    return "embed_tokens is not prepacked" + ("" if now else " (on import)")


def _wrap(module) -> None:
    def make(original):
        def process_weights_after_loading(self, layer):
            if isinstance(layer, module.ParallelLMHead):
                return original(self, layer)
            # Lookup only; apply() is never called on an input embedding.
            return None

        return process_weights_after_loading

    wrap_method_once(module.UnquantizedEmbeddingMethod, "process_weights_after_loading", make)
