"""edge-harness: every number this project publishes comes from here.

Data flows one way, grid → passes → artifacts → report:

- ``grid.py``        the YAML grid (arms, workloads, passes), strictly validated
- ``schedule.py``    interleaved pass order
- ``runner.py``      one fresh process tree per (pass, arm), under the memory ledger
  - ``pass_vllm.py``   what runs inside a pass (``prompts.py``, ``pass_events.py``)
  - ``ledger.py``      PSS of the whole process tree, from smaps_rollup
  - ``evidence.py``    what the workers report, checked against the arm's ``expect``
- ``provenance.py``  code, packages, CPU, memory, env, command, times
- ``stats.py``       medians and pass-paired ratios, or a refusal
- ``report.py``      report.md and PNGs from the artifacts alone
- ``cli.py``         ``edge-harness run GRID`` / ``edge-harness report DIR``

See docs/edge/harness.md and docs/edge/methodology.md.
"""
