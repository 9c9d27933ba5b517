"""The main job: SGLang 0.5.17's own server, patched, on an embedded model shape.

``sglang-elastic serve [--embedded-model NAME] [--dry-run] [SGLANG FLAGS...]``
runs ``python -m sglang.launch_server`` with the Llama-3.1-8B shape shipped in
this package (``sglang_elastic/models/``, random weights through
``--load-format dummy``, no tokenizer: send ``input_ids``). Every flag it does
not know goes to SGLang unchanged. A default is added only when the user did
not give that flag; giving ``--model-path`` (a real model) drops the embedded
shape with its ``--load-format dummy`` and ``--skip-tokenizer-init``.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import List, Optional, Sequence

TEST_COMMAND = "bash ci/test.sh"

#: For the embedded shapes: random weights, no tokenizer.
EMBEDDED_MODEL_FLAGS = (("--load-format", "dummy"), ("--skip-tokenizer-init", None))

#: Backends, each added only if the user gave none: FlashInfer is the decode
#: baseline this project measures against, and the offline GPU bundle
#: (../shared/gpu-host) has neither FA3 (SGLang's H200 default) nor
#: xgrammar's library (hence no grammar backend, PyTorch sampling).
BACKEND_FLAGS = (("--attention-backend", "flashinfer"), ("--sampling-backend", "pytorch"), ("--grammar-backend", "none"))


def model_names() -> List[str]:
    root = Path(str(resources.files("sglang_elastic.models")))
    return sorted(p.parent.name for p in root.glob("*/config.json"))


def model_path(name: str) -> Path:
    """Directory of an embedded model config (``config.json`` only).

    Raises:
        ValueError: for an unknown name (the message lists the known ones).
    """
    root = Path(str(resources.files("sglang_elastic.models")))
    path = root / name
    if not (path / "config.json").is_file():
        raise ValueError(f"unknown model {name!r}; embedded: {', '.join(model_names())}")
    return path


def has_nvidia_gpu() -> bool:
    """True when an NVIDIA GPU is visible (nvidia-smi lists one, or torch sees CUDA)."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            r = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
            if r.returncode == 0 and "GPU" in r.stdout:
                return True
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _given(extra: Sequence[str], flag: str) -> bool:
    """``flag`` is in ``extra``, spelled out or as the abbreviation SGLang's argparse parser accepts (a prefix
    of it: ``--enable-kv-off``), with or without ``=value``. An ambiguous prefix is argparse's to refuse."""
    for a in extra:
        k = a.split("=", 1)[0]
        if k == flag or (k.startswith("--") and len(k) > 2 and flag.startswith(k)):
            return True
    return False


def build_command(model: str, extra: Sequence[str], python: Optional[str] = None) -> List[str]:
    """The ``launch_server`` command line: defaults the user did not give, then
    the user's flags as given. A flag set in SGLang's ``--config`` YAML file
    counts as given (the file's ``model-path`` is not replaced by the embedded
    shape, its ``enable-kv-offload: true`` gets no ``--attention-backend``); a
    file that cannot be read is :func:`check_flags`'s to report."""
    cmd = [python or sys.executable, "-m", "sglang.launch_server"]
    given = _with_file(extra)
    defaults = list(BACKEND_FLAGS)
    if _given(given, "--enable-kv-offload"):  # the plugin selects its own backend (kvoffload; prefill on FlashInfer inside it)
        defaults = [(f, v) for f, v in defaults if f != "--attention-backend"]
    if not (_given(given, "--model-path") or _given(given, "--model")):
        cmd += ["--model-path", str(model_path(model))]
        defaults = list(EMBEDDED_MODEL_FLAGS) + defaults
    for flag, value in defaults:
        if not _given(given, flag):
            cmd += [flag] if value is None else [flag, value]
    return cmd + list(extra)


def _with_file(extra: Sequence[str]) -> List[str]:
    """``extra`` with the options of its ``--config`` YAML file merged in (:func:`_merge_config`): what the user gave,
    wherever; ``extra`` as it is when the file cannot be read (:func:`check_flags` says why, in one line)."""
    if "--config" not in extra:
        return list(extra)
    try:
        return _merge_config(extra, _parser())
    except Exception:  # no file, not YAML, an option the merger refuses
        return list(extra)


@functools.lru_cache(maxsize=1)
def _parser():
    """SGLang 0.5.17's ``launch_server`` parser with this project's flags, as at a server start (the plugin's
    backends among ``--attention-backend``'s choices); built once per process (``serve`` reads the flags up to three
    times: the YAML merge for its defaults and the embedded-model check, then :func:`check_flags`).

    Raises:
        ImportError: SGLang cannot be imported.
    """
    import argparse
    import contextlib
    import io
    import warnings

    from sglang_elastic import config

    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")  # SGLang's import warns about Triton on a machine without a GPU
        from sglang.srt.server_args import ServerArgs

        from sglang_elastic import attention, offload

        attention.register()
        offload.register()
    parser = argparse.ArgumentParser(prog="launch_server", add_help=False)
    ServerArgs.add_cli_args(parser)
    if not any(a.dest == "enable_kv_offload" for a in parser._actions):  # the plugin is not loaded in this process
        config.add_cli_args(parser)
    return parser


def _merge_config(argv: Sequence[str], parser) -> List[str]:
    """``argv`` with SGLang's ``--config`` YAML file merged in as ``prepare_server_args`` merges it (CLI > file >
    defaults: the file's options first).

    Raises:
        ValueError: no file, not YAML, not a mapping, or an option SGLang's merger refuses; YAML's own errors.
    """
    from sglang.srt.server_args_config_parser import ConfigArgumentMerger

    return ConfigArgumentMerger(parser).merge_config_with_args(list(argv))


def check_flags(argv: Sequence[str]) -> Optional[str]:
    """What the server's start would refuse in ``argv`` (``launch_server``'s
    arguments), without starting it: SGLang 0.5.17's own argument parser with
    our flags, then this project's checks (``config.check_server_args``, as
    the plugin runs them). Returns the one-line reason, or None. SGLang's
    device-dependent checks (``ServerArgs.__post_init__``) are not run."""
    import contextlib
    import io

    from sglang_elastic import config

    try:
        parser = _parser()
    except ImportError as e:  # pragma: no cover - SGLang is a dependency
        return f"cannot import SGLang to check the flags ({e})"
    argv = list(argv)
    if "--config" in argv:
        try:
            argv = _merge_config(argv, parser)
        except Exception as e:  # ValueError (no file, not YAML, not a mapping, an unsupported option) or YAML's own error
            return f"--config: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = parser.parse_args(argv)
    except SystemExit:
        return (err.getvalue().strip().splitlines() or ["SGLang's parser refused the flags"])[-1]
    try:
        config.check_server_args(config.from_namespace(ns), ns)
    except config.ConfigError as e:
        return str(e)
    return _model_error(ns)


def _model_error(ns) -> Optional[str]:
    """What the start would refuse of ``--model-path`` and ``--tp``: a local path (absolute, ``./``, ``~``) that does
    not exist (anything else may be a Hugging Face id, which SGLang downloads), or heads that do not split over the
    TP ranks (:func:`sglang_elastic.eval.advisor.tp_split_error`, for the dense models the advisor reads, with
    ``--json-model-override-args`` applied; others are left to SGLang). None when neither."""
    from sglang_elastic import config
    from sglang_elastic.eval import advisor

    path, tp = ns.model_path, ns.tp_size
    if not path:
        return None
    local = os.path.expanduser(path)
    if path.startswith(("/", "./", "../", "~")) and not os.path.exists(local):
        return f"--model-path {path}: no such file or directory (a Hugging Face id, org/name, is downloaded by SGLang)"
    cfg = config.model_config(ns) if tp > 1 and os.path.isdir(local) else None
    if cfg is not None:
        from sglang_elastic.eval import sizing

        try:
            m = sizing.model_facts(local, cfg, f"--model-path {path}", quantized_ok=True)
        except advisor.AdviseError:  # a model the advisor does not read (MoE, sliding window, ...): SGLang checks it
            return None
        return advisor.tp_split_error(m, tp)
    return None


def serve(model: str, extra: Sequence[str], dry_run: bool = False, require_patched: bool = True) -> int:
    """Replace this process with the patched server (``os.execv``).

    Exits with 2 and a one-line message, starting nothing, for an unknown
    embedded model, flags :func:`check_flags` refuses, when there is no NVIDIA
    GPU, or when the series is not applied to the installed SGLang (checked in
    that order). ``dry_run``: print the command once the flags pass.
    """
    given = _with_file(extra)
    if not (_given(given, "--model-path") or _given(given, "--model")) and model not in model_names():
        print(f"sglang-elastic serve: --embedded-model {model}: no such embedded model; use one of {', '.join(model_names())}, "
              "or --model-path DIR for a real model", file=sys.stderr)
        return 2
    cmd = build_command(model, extra)
    err = check_flags(cmd[3:])  # on every path: a bad flag is one line here, not SGLang's usage text after the GPU checks
    if err:
        print(f"sglang-elastic serve: {err}", file=sys.stderr)
        return 2
    if dry_run:
        print(" ".join(cmd))
        return 0
    if not has_nvidia_gpu():
        print(
            "sglang-elastic serve: no NVIDIA GPU on this machine, so no server is started. "
            f"To check the project here, run the CPU test suite from a clone of this repository: {TEST_COMMAND}",
            file=sys.stderr,
        )
        return 2
    if require_patched:
        from sglang_elastic import patchset

        try:
            state = patchset.overall(patchset.status(patchset.locate()))
        except patchset.PatchError as e:
            print(f"sglang-elastic serve: {e}", file=sys.stderr)
            return 2
        if state is not patchset.State.APPLIED:
            fix = ("run 'sglang-elastic patch apply' first" if state is patchset.State.PRISTINE else
                   "restore it with 'sglang-elastic patch restore --from-wheel', then 'sglang-elastic patch apply'")
            print(f"sglang-elastic serve: the installed SGLang is {state.value}; {fix} (or pass --allow-unpatched)", file=sys.stderr)
            return 2
    # exec: the server takes this process's place, so signals (Ctrl-C, kill)
    # reach SGLang's launcher, which tears down its scheduler processes.
    os.execv(cmd[0], cmd)
    return 0  # not reached
