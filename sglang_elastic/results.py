"""GPU result files: every JSON under ``docs/results/`` starts with the same
header (``date``, ``gpu``, ``commit``, ``command``) so a number can be traced
to the code and the command that produced it."""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
from typing import Any, Dict, Optional


def gpu_name() -> str:
    """``nvidia-smi``'s name, memory and driver of every GPU, or "unknown"."""
    try:
        out = subprocess.check_output(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"], text=True)
        return "; ".join(line.strip() for line in out.strip().splitlines())
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_name() -> str:
    """The CPU model (``/proc/cpuinfo``'s first "model name"), for CPU benchmarks' headers."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def commit() -> str:
    """``SGLANG_ELASTIC_COMMIT`` (the device host has no .git), else ``git rev-parse HEAD``."""
    env = os.environ.get("SGLANG_ELASTIC_COMMIT")
    if env:
        return env
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def scheduler_state(info: Dict[str, Any]) -> Dict[str, Any]:
    """The first scheduler's entry of a ``/server_info`` answer's ``internal_states`` ({} when there is none):
    where SGLang 0.5.17 puts ``memory_usage`` and where our hooks add ``sglang_elastic``,
    ``sglang_elastic_offload``, ``persistentkv`` and ``gc``."""
    states = info.get("internal_states") or [{}]
    return states[0] if isinstance(states[0], dict) else {}


def header(command: Optional[str] = None) -> Dict[str, Any]:
    """``{date, gpu, commit, command}``; command defaults to this script's argv."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu_name(),
        "commit": commit(),
        "command": command or "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
    }


def write(path: str, result: Dict[str, Any]) -> None:
    """Write ``result`` as JSON, one item per line (indent 1, no space after
    ``:``, lists of plain values on one line: :func:`dumps`; the tracked results
    must leave room for the GPU bundle in one device transfer), atomically (a temp file beside it, then ``os.replace``):
    a reader or a killed writer never sees half a file."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(dumps(result))
        f.write("\n")
    os.replace(tmp, path)


_FLAT_LIST = re.compile(r"\[\n[^\[\]{}]*?\n *\]")


def dumps(result: Any) -> str:
    """JSON of ``result`` as :func:`write` lays it out: one item per line (indent 1, no
    space after ``:``), except that a list of numbers, strings, booleans or nulls stays on
    one line (a table row, a list of lengths). JSON strings hold no raw newline, so the
    newlines removed are only whitespace between items."""
    text = json.dumps(result, indent=1, separators=(",", ":"))
    return _FLAT_LIST.sub(lambda m: re.sub(r"\n *", "", m.group(0)), text)


def read_json(path: str) -> Any:
    """A result or part as a run writes it (``.json``) or as the repo keeps it compressed
    (``.json.xz``; ``.json.gz`` for the older parts), chosen by the name's ending.

    Raises:
        OSError: the file cannot be opened or read.
        ValueError: not JSON, or a damaged or truncated ``.xz`` / ``.gz`` stream (the message names the file).
    """
    import gzip
    import lzma

    opener = lzma.open if path.endswith(".xz") else gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            return json.load(f)
    except (lzma.LZMAError, gzip.BadGzipFile, EOFError) as e:
        raise ValueError(f"{path}: damaged compressed stream ({type(e).__name__}: {e})") from None
