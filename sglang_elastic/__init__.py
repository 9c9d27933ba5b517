"""sglang-elastic: an elastic (CUDA VMM) KV pool and a decode attention engine
for SGLang 0.5.17, shipped as a small patch series plus an SGLang plugin.

Entry points:
- ``sglang-elastic patch {apply,revert,status,build-wheel,check}``
  (:mod:`sglang_elastic.patchset`);
- ``sglang-elastic serve`` (:mod:`sglang_elastic.serve`), the main job;
- the ``sglang.srt.plugins`` entry point :func:`sglang_elastic.plugin.load`.
"""

__version__ = "0.1.0"

#: The only SGLang release the patch series targets.
SGLANG_VERSION = "0.5.17"
