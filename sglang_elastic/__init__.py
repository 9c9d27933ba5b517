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


def _map_source_kernels() -> None:
    """Give ``kernels/`` its installed name in a source checkout.

    The wheel maps ``kernels/`` to ``sglang_elastic.kernels`` (pyproject's
    ``package-dir``). A process started from the repository root (``python -m
    sglang.launch_server`` puts the cwd first on ``sys.path``) imports this
    package from the source tree instead, where ``kernels/`` sits beside it:
    register it under the same name so both layouts run the same code.
    """
    import importlib.util
    import os
    import sys

    name = __name__ + ".kernels"
    here = os.path.dirname(os.path.abspath(__file__))
    init = os.path.join(os.path.dirname(here), "kernels", "__init__.py")
    if name in sys.modules or os.path.isdir(os.path.join(here, "kernels")) or not os.path.isfile(init):
        return
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[os.path.dirname(init)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    setattr(sys.modules[__name__], "kernels", module)  # as the import system does for a submodule


_map_source_kernels()
