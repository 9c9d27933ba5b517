"""Data package: the patch series against SGLang 0.5.17 (``series``, ``NNNN-*.patch``,
``manifest.json``). Read it with :mod:`sglang_elastic.patchset`."""
