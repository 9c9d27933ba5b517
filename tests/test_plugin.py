"""The plugin and the patched endpoint, through SGLang's own loader."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from sglang_elastic import __version__, patchset

from conftest import installed_sglang_root


def run_py(code: str, runner=None, **env) -> str:
    """``python -c code`` (in ``runner``, a fork of a process that imported SGLang already, if given); its last line."""
    if runner is not None:
        r = runner.run(code, env={**os.environ, **env})
    else:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


def test_sglang_plugin_loader_discovers_and_runs_the_plugin(sglang_python):
    out = run_py(
        "import json\n"
        "from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group, load_plugins\n"
        "import sglang_elastic.plugin as p\n"
        "found = load_plugins_by_group(GENERAL_PLUGINS_GROUP)\n"
        "before = p.is_loaded()\n"
        "load_plugins()\n"
        "print(json.dumps({'names': sorted(found), 'dist': found['sglang_elastic'][1], 'before': before, 'after': p.is_loaded()}))\n",
        sglang_python,
    )
    got = json.loads(out)
    assert "sglang_elastic" in got["names"]
    assert got["dist"] == "sglang-elastic"
    assert (got["before"], got["after"]) == (False, True)


def test_a_bad_config_in_the_environment_stops_the_load_with_one_line(sglang_python):
    """Review #32: a bad ``SGLANG_ELASTIC_CONFIG`` (the launcher's channel to its server processes) raised inside
    SGLang's plugin loader, which logs a traceback and starts without the plugin; it now stops with one line."""
    code = "from sglang.srt.plugins import load_plugins\nload_plugins()\nprint('started')\n"
    r = sglang_python.run(code, env={**os.environ, "SGLANG_ELASTIC_CONFIG": "garbage"})
    assert r.returncode != 0 and "started" not in r.stdout
    assert r.stderr.strip().splitlines()[-1] == ("sglang-elastic: SGLANG_ELASTIC_CONFIG is not a valid sglang-elastic config: Expecting "
                                                "value: line 1 column 1 (char 0) (the launcher sets it for its server processes: unset it)")
    assert "Traceback" not in r.stderr


def test_sglang_plugins_whitelist_can_exclude_the_plugin(sglang_python):
    code = "from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group\nprint(sorted(load_plugins_by_group(GENERAL_PLUGINS_GROUP)))\n"
    assert "sglang_elastic" not in run_py(code, sglang_python, SGLANG_PLUGINS="someone_else")
    assert "sglang_elastic" in run_py(code, sglang_python, SGLANG_PLUGINS="sglang_elastic")  # the same process kind, the whitelist naming it


def test_kernels_live_under_sglang_elastic_not_top_level(tmp_path):
    # From a neutral directory (not the repo root, which is on sys.path under
    # ``python -m``), ``kernels`` must not resolve to our kernels/ directory.
    code = (
        "import importlib.util, json, os, sglang_elastic.kernels as k\n"
        "s = importlib.util.find_spec('kernels')\n"
        "print(json.dumps([os.path.dirname(k.__file__), s and s.origin]))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    ours, top = json.loads(r.stdout)
    assert Path(ours).name == "kernels"
    assert top is None or Path(top).parent != Path(ours)


def test_patched_http_server_reports_sglang_elastic(tmp_path):
    # A full copy of the installed SGLang, patched, imported in a subprocess.
    site = tmp_path / "site"
    root = installed_sglang_root()
    # with its bytecode: only the patched file compiles again (its source changed), not all of SGLang
    shutil.copytree(root / "sglang", site / "sglang")
    (di,) = root.glob("sglang-*.dist-info")
    shutil.copytree(di, site / di.name)
    patchset.apply(patchset.locate(site))
    out = run_py(
        "import json, sglang.srt.entrypoints.http_server as h\n"
        "assert h.__file__.startswith(%r), h.__file__\n"
        "print(json.dumps(h._sglang_elastic_server_info(None)))\n" % str(site),
        PYTHONPATH=str(site),
    )
    info = json.loads(out)
    assert info["patched"] is True
    assert info["version"] == __version__ and info["sglang_version"] == "0.5.17"
    assert info["series"] == {"0001-server-info.patch": "applied"}
    assert "error" not in info
