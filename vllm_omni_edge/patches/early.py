"""What must be in force before ``import vllm`` runs, installed at interpreter start.

``scripts/setup.sh`` writes a ``.pth`` file that calls :func:`install_interpreter_hooks`
in every interpreter of the venv; our console scripts call it too. Each hook only adds
a finder to ``sys.meta_path`` (no heavy import) and acts when its module is imported:

- ``torchvision_native_ops``: schemas torchvision's fake registrations need;
- ``lazy_imports``: media, solver and client packages deferred to first use, triton hidden
  on a CPU-only torch (``VLLM_OMNI_EDGE_LAZY_IMPORTS=0`` turns it off);
- ``transformers_import_memo``: transformers' import-time scans remembered across starts
  (``VLLM_OMNI_EDGE_IMPORT_MEMO=0`` turns it off);
- ``import_gc``: automatic collection held back while ``vllm`` and ``vllm.entrypoints.llm``
  import (``VLLM_OMNI_EDGE_IMPORT_GC=0`` turns it off);
- ``inductor_fallback_deferred`` and ``import_compile_lazy``: inductor's compiler modules
  imported when a model compiles, not when ``vllm`` imports (``VLLM_OMNI_EDGE_INDUCTOR_DEFERRED=0``
  turns them off);
- ``omni_plugin_by_model``: ``LLM()`` loads vLLM-Omni's general plugin only for its own
  architectures (vLLM loads the plugins before ours could install it).
"""

from __future__ import annotations


def install_interpreter_hooks() -> None:
    from vllm_omni_edge.patches.common import (
        import_compile_lazy,
        import_gc,
        inductor_fallback_deferred,
        lazy_imports,
        torchvision_native_ops,
        transformers_import_memo,
    )
    from vllm_omni_edge.patches.frontend import omni_plugin_by_model

    import_gc.install()
    inductor_fallback_deferred.install()
    import_compile_lazy.install()
    lazy_imports.install()
    transformers_import_memo.install()
    torchvision_native_ops.install()
    omni_plugin_by_model.apply()
