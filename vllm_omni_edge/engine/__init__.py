"""Engine layouts of our own: vLLM's engine core in the API-server process, and the cores its model runs on.

Not patches: the patches that choose these layouts (``patches/frontend/single_process.py``,
``llm_in_process.py``) import from here.
"""
