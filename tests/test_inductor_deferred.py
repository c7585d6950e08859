"""Inductor's compiler modules load when something compiles, not when vLLM imports
(inductor_fallback_deferred, import_compile_lazy)."""

from __future__ import annotations

import pytest

from tests.e2e.probe import run_script_probe
from vllm_omni_edge.levers import INDUCTOR_DEFERRED_ENV

HEAVY = ("torch._inductor.lowering", "torch._inductor.graph", "torch._inductor.compile_fx",
         "torch._inductor.select_algorithm")

# A fresh interpreter (the venv's .pth installs the hooks): what `from vllm import LLM` loaded,
# vLLM's import-time compiled helpers, then inductor's lowering and graph imported afterwards.
PROBE = (
    "import json, sys\n"
    f"HEAVY = {HEAVY!r}\n"
    "from vllm import LLM\n"
    "import vllm.model_executor.layers.vocab_parallel_embedding as vpe\n"
    "import vllm.utils.deep_gemm as dg\n"
    "loaded = [m for m in HEAVY if m in sys.modules]\n"
    "lazy = [bool(getattr(f, '__edge_compile_lazy__', False)) for f in (vpe.get_masked_input_and_mask,\n"
    "        dg.per_block_cast_to_fp8)]\n"
    "import torch._inductor.lowering as lowering, torch._inductor.graph as graph\n"
    "print('PROBE-RESULT ' + json.dumps({'loaded': loaded, 'lazy': lazy,\n"
    "      'wrapped': bool(getattr(lowering.FALLBACK_ALLOW_LIST, '_vllm_patched', False)),\n"
    "      'graph_same': graph.FALLBACK_ALLOW_LIST is lowering.FALLBACK_ALLOW_LIST}))\n"
)


def test_vllm_imports_without_the_compiler_and_wraps_the_list_when_it_loads():
    on = run_script_probe(PROBE)
    assert on["loaded"] == [], on
    assert on["lazy"] == [True, True], on
    assert on["wrapped"] and on["graph_same"], on


def test_the_flag_off_imports_the_compiler_with_vllm():
    off = run_script_probe(PROBE, **{INDUCTOR_DEFERRED_ENV: "0"})
    assert set(off["loaded"]) == set(HEAVY), off
    assert off["lazy"] == [False, False]
    assert off["wrapped"] and off["graph_same"], off


LAZY_PROBE = (
    "import json, sys, torch\n"
    "sys.path.insert(0, sys.argv[1])\n"
    "import edge_compile_probe as m\n"
    "before = 'torch._inductor.compile_fx' in sys.modules\n"
    "x = torch.arange(4.0)\n"
    "first, again = m.plus_one(x).tolist(), m.twice(x).tolist()\n"
    "print('PROBE-RESULT ' + json.dumps({\n"
    "    'before': before, 'first': first, 'again': again,\n"
    "    'lazy': [getattr(f, '__edge_compile_lazy__', False) for f in (m.plus_one, m.twice, m.Holder.method)],\n"
    "    'module_is_torchs': type(m.compiled_module).__name__, 'runtime_is_torchs': m.at_run_time(),\n"
    "    'compiled_on_call': m.calls}))\n"
)

LIBRARY_MODULE = '''
import torch
calls = []

@torch.compile(backend="eager")
def plus_one(x):
    calls.append("plus_one")
    return x + 1

def _twice(x):
    calls.append("twice")
    return x * 2

twice = torch.compile(_twice, backend="eager", dynamic=True)

class Holder:
    @torch.compile(backend="eager")
    def method(x):
        return x

compiled_module = torch.compile(torch.nn.Linear(2, 2), backend="eager")

def at_run_time():
    return getattr(torch.compile(_twice, backend="eager"), "__edge_compile_lazy__", False)
'''


def test_a_library_body_decorates_lazily_and_the_first_call_compiles(tmp_path):
    (tmp_path / "edge_compile_probe.py").write_text(LIBRARY_MODULE)
    result = run_script_probe(LAZY_PROBE, str(tmp_path))
    assert not result["before"]  # decorating loaded no compiler
    assert result["lazy"] == [True, True, True]
    assert result["first"] == [1.0, 2.0, 3.0, 4.0] and result["again"] == [0.0, 2.0, 4.0, 6.0]
    # Dynamo traced each function once on its first call (the Python body ran while tracing).
    assert result["compiled_on_call"] == ["plus_one", "twice"], result
    assert result["module_is_torchs"] == "OptimizedModule"  # a module: torch.compile's own
    assert result["runtime_is_torchs"] is False  # a call from a function at run time: torch's own


def test_the_flag_off_decorates_as_torch_does(tmp_path):
    (tmp_path / "edge_compile_probe.py").write_text(LIBRARY_MODULE)
    result = run_script_probe(LAZY_PROBE, str(tmp_path), **{INDUCTOR_DEFERRED_ENV: "0"})
    assert result["lazy"] == [False, False, False]
    assert result["first"] == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("value", ["maybe"])
def test_a_bad_flag_value_is_named_not_raised(value):
    result = run_script_probe("import json, sys\nfrom vllm import LLM\n"
                              "print('PROBE-RESULT ' + json.dumps('torch._inductor.lowering' in sys.modules))",
                              **{INDUCTOR_DEFERRED_ENV: value})
    assert result is True  # the hooks stood aside; vLLM imported as it does
