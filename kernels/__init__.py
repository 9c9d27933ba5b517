"""Kernel sources of sglang-elastic, importable as ``sglang_elastic.kernels``.

This directory is mapped under ``sglang_elastic`` by ``pyproject.toml`` and is
never a top-level ``kernels`` package: SGLang depends on an unrelated PyPI
package of that name. The decode attention kernels (split-KV and compact
work-queue, Triton) land here with their issue.
"""
