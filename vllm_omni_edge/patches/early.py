"""What must be in force before ``import vllm`` runs, installed at interpreter start.

``scripts/setup.sh`` writes a ``.pth`` file that calls :func:`install_interpreter_hooks`
in every interpreter of the venv; our console scripts call it too. Each hook only adds
a finder to ``sys.meta_path`` (no heavy import) and acts when its module is imported:

- ``torchvision_native_ops``: schemas torchvision's fake registrations need.
"""

from __future__ import annotations


def install_interpreter_hooks() -> None:
    from vllm_omni_edge.patches.common import torchvision_native_ops

    torchvision_native_ops.install()
