"""Fresh Python processes without a fresh SGLang import each.

Tests that must run code in a process of its own (SGLang's parser with the
plugin loaded, the plugin loader itself) used to start ``python -c`` each:
15-25 s apiece on 2 cores, nearly all of it importing SGLang and torch. A
:class:`Forker` is one server process that imports the modules named once,
then forks a child per call; the child sets ``sys.argv`` and the
environment, runs the code as ``__main__`` with stdout and stderr in files
of its own, and exits as ``python -c`` would (SystemExit's status or
message, a traceback and 1 for an uncaught exception). What the child sees
is what a fresh interpreter sees after those imports: nothing the code does
(loading plugins, registering hooks, parsing arguments) has happened in the
server, which never runs test code itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from typing import Dict, Optional, Sequence

SERVER = r'''
import importlib, json, os, sys, traceback
for name in sys.argv[1].split(","):
    if name:
        importlib.import_module(name)
print("ready", flush=True)
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        try:
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            for fd, path in ((1, req["out"]), (2, req["err"])):
                f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(f, fd)
                os.close(f)
            sys.stdout = os.fdopen(1, "w", buffering=1)
            sys.stderr = os.fdopen(2, "w", buffering=1)
            os.environ.clear()
            os.environ.update(req["env"])
            if req["cwd"]:
                os.chdir(req["cwd"])
            sys.argv = ["-c"] + req["argv"]
            rc = 0
            try:
                exec(compile(req["code"], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
            except SystemExit as e:
                if e.code is None:
                    rc = 0
                elif isinstance(e.code, int):
                    rc = e.code
                else:
                    print(e.code, file=sys.stderr)
                    rc = 1
            except BaseException:
                traceback.print_exc()
                rc = 1
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(locals().get("rc", 1))
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)
'''


class Forker:
    """``run(code, argv, env)`` in a forked child of a process that has
    imported ``preload`` (module names) once."""

    def __init__(self, preload: Sequence[str], timeout: float = 600):
        self._lock = threading.Lock()
        self._tmp = tempfile.TemporaryDirectory(prefix="forkrun-")
        self._n = 0
        self._log = open(os.path.join(self._tmp.name, "server.err"), "w+")
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, ",".join(preload)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)
        ready = self.proc.stdout.readline()
        if ready.strip() != "ready":
            self._log.seek(0)
            why = self._log.read()[-2000:]
            self.close()
            raise RuntimeError(f"the fork server did not start: {why}")

    def run(self, code: str, argv: Sequence[str] = (), env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None) -> subprocess.CompletedProcess:
        """As ``subprocess.run([sys.executable, "-c", code, *argv], env=env, cwd=cwd, capture_output=True, text=True)``
        (``env``: the whole environment, default this process's)."""
        with self._lock:
            self._n += 1
            out, err = (os.path.join(self._tmp.name, f"{self._n}.{s}") for s in ("out", "err"))
            req = {"code": code, "argv": list(argv), "env": dict(os.environ if env is None else env), "cwd": cwd, "out": out, "err": err}
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("the fork server exited")
            rc = json.loads(line)["rc"]
            with open(out) as fo, open(err) as fe:
                return subprocess.CompletedProcess(["-c", *argv], rc, fo.read(), fe.read())

    def close(self) -> None:
        if self.proc.poll() is None:  # our own server, by its handle: no need to wait for torch's interpreter shutdown
            self.proc.kill()
            self.proc.wait(timeout=60)
        self._log.close()
        self._tmp.cleanup()
