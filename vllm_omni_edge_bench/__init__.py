"""The measurement side of vllm-omni-edge, installed with the ``bench`` extra.

``harness`` runs grids (passes, evidence, reports); ``baselines`` holds what we are
measured against (llama.cpp through llama-cpp-python). The product, ``vllm_omni_edge``,
imports nothing from here; this package may import the product.
"""
