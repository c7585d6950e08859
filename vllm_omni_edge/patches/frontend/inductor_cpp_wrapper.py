"""Run the compiled CPU model through inductor's C++ wrapper (opt-in lever).

What: with ``VLLM_OMNI_EDGE_CPP_WRAPPER=1``: (1) wraps ``CpuPlatform.check_and_update_config``
(front end, while the config is built): when the model is compiled with inductor, sets
``inductor_compile_config["cpp_wrapper"] = True`` unless the user set that key. (2) Just
before ``vllm.utils.torch_utils`` is first imported, sets ``VLLM_USE_LAYERNAME=0`` unless
the user set it, so attention ops take the layer name as a ``str``: inductor's C++
wrapper cannot pass vLLM's opaque ``LayerName`` objects to a Python custom op
("arg type PyObject is not yet supported by custom_op_wrapper", torch 2.13). Part (2)
must run before ``import vllm``; ``scripts/setup.sh`` installs it at interpreter start
(the ``.pth`` file, see ``patches/early.py``). If ``vllm`` was imported first with
``LayerName`` on, part (1) leaves the Python wrapper in place and logs why.
Why: vLLM-CPU compiles the whole model into one inductor graph whose ``call`` is
generated Python: per decode step of SmolLM2-135M it runs ~30 statements per layer
(kernel calls, ``reinterpret_tensor``, ``empty_strided_cpu``, ``del``) on the thread that
also runs the kernels. perf on this 2-core box, one-process layout: that thread spent 37 %
in the int4 matmul and ~55 % in the Python interpreter, pybind and malloc; py-spy put
44 % of it in the wrapper's own ``call``. The C++ wrapper removes that part (the attention
ops stay Python custom ops); greedy tokens are identical. But it did not decode faster:
0.89x (0.80-1.04) of the Python wrapper on SmolLM2 (``2026-12-01-cpp-wrapper-default``, 5
interleaved passes), no gain on Qwen2.5-Coder-1.5B (``2026-12-01-cpp-wrapper-qwen``),
0.88/1.30/1.07x pass by pass with the trimmed attention calls on SmolLM2
(``2026-12-01-attention-calls-default``), and its first compile is longer. So it is off by default; the layer names stay vLLM's choice.
The layer name only names the layer; as a ``str`` it is a graph constant, which costs
nothing here because vLLM-CPU traces the whole model once.
Flag: ``VLLM_OMNI_EDGE_CPP_WRAPPER=1`` turns it on (default 0: the Python wrapper).
Verified by: tests/test_inductor_cpp_wrapper.py (config rules, env default, idempotent);
tests/e2e/test_compiled_cpp_wrapper.py (the C++ wrapper gives the Python wrapper's
greedy tokens; the worker evidence says which wrapper ran); decode in
``grids/cpp-wrapper-default.yaml`` and ``grids/cpp-wrapper-qwen.yaml``.
Remove when: vLLM-CPU offers inductor's ``cpp_wrapper`` itself and torch's C++ wrapper
passes opaque objects to Python custom ops; or drop it if no box shows a gain.
"""

from __future__ import annotations

import functools
import os
import sys
import threading

from vllm_omni_edge.patches.base import PatchRecord, Process
from vllm_omni_edge.patches.import_hook import before_imported, when_imported

RECORD = PatchRecord(
    name="inductor_cpp_wrapper",
    target="vllm.platforms.cpu.CpuPlatform.check_and_update_config "
    "(inductor_compile_config['cpp_wrapper']); env VLLM_USE_LAYERNAME before vllm.utils.torch_utils",
    process=Process.FRONTEND,
    why="vLLM-CPU's compiled model runs inductor's generated Python wrapper (44 % of a SmolLM2 "
    "decode step in py-spy); the C++ wrapper removes it. Opt-in: no decode gain measured yet.",
    verified_by="tests/test_inductor_cpp_wrapper.py; tests/e2e/test_compiled_cpp_wrapper.py (the Python "
    "wrapper's greedy tokens, evidence); grids/cpp-wrapper-default.yaml, grids/cpp-wrapper-qwen.yaml.",
    remove_when="vLLM-CPU offers inductor's cpp_wrapper itself and torch's C++ wrapper passes "
    "opaque objects (vLLM's LayerName) to Python custom ops; or no box shows a gain.",
)

TORCH_UTILS = "vllm.utils.torch_utils"
LAYERNAME_ENV = "VLLM_USE_LAYERNAME"
# Our own mark: kv_budget wraps the same method and checks the generic __edge_wrapped__.
_MARK = "__edge_cpp_wrapper__"
_lock = threading.Lock()
_installed = False


def layer_names_are_strings() -> bool:
    """Whether vLLM's attention ops take ``str`` layer names in this process."""
    module = sys.modules.get(TORCH_UTILS)
    if module is None:
        return os.environ.get(LAYERNAME_ENV, "1").strip() == "0"
    return not getattr(module, "_USE_LAYERNAME", True)


def _default_layer_names_to_strings(_module) -> None:
    from importlib.metadata import PackageNotFoundError, version

    from vllm_omni_edge.levers import cpp_wrapper_enabled

    # This hook runs outside apply_patch_module (inside `import vllm`, which its version
    # check would re-enter), so it checks the distribution's version itself.
    try:
        written_for = version("vllm-cpu") in RECORD.vllm_versions
    except PackageNotFoundError:
        written_for = False
    if written_for and cpp_wrapper_enabled():
        os.environ.setdefault(LAYERNAME_ENV, "0")


def install() -> str:
    """Part (2): cheap, imports nothing; called at interpreter start and by ``apply``."""
    global _installed
    with _lock:
        if _installed:
            return "hook already installed"
        if TORCH_UTILS in sys.modules:
            return "vllm already imported; layer names stay as vLLM chose"
        before_imported(TORCH_UTILS, _default_layer_names_to_strings)
        _installed = True
    return "hook installed"


def wants_cpp_wrapper(compilation_config) -> tuple[bool, str]:
    """Whether to turn the C++ wrapper on for this config, and why (or why not)."""
    from vllm_omni_edge.levers import cpp_wrapper_enabled

    if not cpp_wrapper_enabled():
        return False, "Python wrapper kept (flag)"
    if compilation_config.backend != "inductor":
        return False, f"not compiled with inductor (backend {compilation_config.backend!r})"
    if "cpp_wrapper" in compilation_config.inductor_compile_config:
        if compilation_config.inductor_compile_config["cpp_wrapper"]:
            # Also an engine core's view: the front end's config arrives with it set.
            return False, "inductor's C++ wrapper (cpp_wrapper already set in the config)"
        return False, "Python wrapper: cpp_wrapper=False set by the user"
    if not layer_names_are_strings():
        return False, (f"vLLM's attention ops take opaque LayerName objects, which the C++ wrapper "
                       f"cannot pass: set {LAYERNAME_ENV}=0 before importing vllm (scripts/setup.sh's "
                       ".pth does it)")
    return True, "inductor's C++ wrapper"


def _wrap(module) -> None:
    platform = module.CpuPlatform
    original = platform.check_and_update_config.__func__
    if getattr(original, _MARK, False):  # functools.wraps carries marks down a chain of wrappers
        return

    @functools.wraps(original)
    def check_and_update_config(cls, vllm_config):
        original(cls, vllm_config)
        compilation = vllm_config.compilation_config
        if vllm_config.model_config is None or int(compilation.mode) == 0:
            return
        use, reason = wants_cpp_wrapper(compilation)
        if use:
            compilation.inductor_compile_config["cpp_wrapper"] = True
        from vllm_omni_edge.log import get_logger

        get_logger("inductor_cpp_wrapper").info("compiled model wrapper: %s", reason)

    setattr(check_and_update_config, _MARK, True)
    platform.check_and_update_config = classmethod(check_and_update_config)


def apply() -> str:
    hook = install()
    now = when_imported("vllm.platforms.cpu", _wrap)
    return f"layer-name default: {hook}; CpuPlatform config wrapped" + ("" if now else " (on import)")
