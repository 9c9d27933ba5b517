"""Issue 24, "no loss" on a GPU: a pinned-allocation failure stops the server at start-up with one line.

Starts SGLang's own launcher with ``--enable-kv-offload`` and ``SGLANG_ELASTIC_TEST_PIN_FAULT=1`` (the host V pool is
allocated, then its pinning fails as a driver refusal would: ``sglang_elastic/offload/host_pool.py``), waits for the
server to exit, and records how: the exit code and time, the ``sglang-elastic: could not pin`` line(s) in its log, the
GPU memory in use before and after (nothing left held), and any SGLang process left behind. A server that comes up
healthy (the fault not reached) is a failed check; one that exits without the line too. A run that reached neither the
pool nor a healthy server (it measured nothing) writes no result.

    python scripts/gpu/check_pin_fault.py --out $OUT/pin_fault_<gpu>.json [--timeout-s 300]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

#: The pool build's one line (``HostVPool.init_kv_buffer``).
PIN_LINE = re.compile(r"sglang-elastic: could not pin [^\n]*")


def parse_log(text: str) -> Dict[str, Any]:
    """What a server log says of the pin failure: ``lines`` (each distinct ``sglang-elastic: could not pin`` line, the
    log's prefixes dropped), ``injected`` (the fault named in it), ``complete_on_one_line`` (every such line ends as the
    message does, with its advice: nothing of it wrapped onto a next line), ``traceback`` (a Python traceback anywhere:
    SGLang's scheduler logs one around the line)."""
    lines: List[str] = []
    for m in PIN_LINE.finditer(text):
        if m.group(0).rstrip() not in lines:
            lines.append(m.group(0).rstrip())
    return {"lines": lines, "injected": any("SGLANG_ELASTIC_TEST_PIN_FAULT=1: injected" in l for l in lines),
            "complete_on_one_line": bool(lines) and all(l.endswith("raise the locked-memory limit (ulimit -l)") for l in lines),
            "traceback": "Traceback (most recent call last)" in text}


def gpu_mem_used_mib() -> Optional[int]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=30).stdout
        return int(out.strip().splitlines()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def leftover_processes() -> int:
    out = subprocess.run(["pgrep", "-f", "sglang.launch_server|sglang::scheduler"], capture_output=True, text=True).stdout
    return len([p for p in out.split() if p.strip() and int(p) != os.getpid()])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout-s", type=float, default=300)
    ap.add_argument("--port", type=int, default=30900)
    ap.add_argument("--log", default="/tmp/check_pin_fault_server.log")
    a = ap.parse_args()
    from sglang_elastic import results

    model = ROOT / "sglang_elastic" / "models" / "llama-3.1-8b"
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--load-format", "dummy", "--skip-tokenizer-init",
           "--host", "127.0.0.1", "--port", str(a.port), "--enable-kv-offload", "--max-running-requests", "16", "--context-length", "8192"]
    env = dict(os.environ, SGLANG_ELASTIC_TEST_PIN_FAULT="1")
    before = gpu_mem_used_mib()
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=open(a.log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    healthy = False
    while proc.poll() is None and time.time() - t0 < a.timeout_s:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{a.port}/health", timeout=2)
            healthy = True
            break
        except OSError:
            time.sleep(1)
    seconds = time.time() - t0
    if proc.poll() is None:  # up (the fault not reached) or hung: stop it
        os.killpg(proc.pid, 15)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        exited = False
    else:
        exited = True
    time.sleep(5)  # the driver's release of the dead processes' memory
    after = gpu_mem_used_mib()
    log = Path(a.log).read_text(errors="replace")
    seen = parse_log(log)
    if not seen["lines"] and not healthy:
        print(f"check_pin_fault: neither the pin failure nor a healthy server in {seconds:.0f} s: nothing measured, no result written; "
              f"log tail:\n{log[-3000:]}", file=sys.stderr)
        return 1
    out = {**results.header(), "server_command": "SGLANG_ELASTIC_TEST_PIN_FAULT=1 " + " ".join(cmd),
           "exited_by_itself": exited, "returncode": proc.returncode, "seconds_to_exit": round(seconds, 1) if exited else None,
           "healthy": healthy, **seen,
           "gpu_mem_used_mib_before": before, "gpu_mem_used_mib_after": after, "leftover_processes": leftover_processes(),
           "log_tail": log[-2500:]}
    out["ok"] = bool(exited and not healthy and seen["injected"] and seen["complete_on_one_line"] and proc.returncode != 0 and out["leftover_processes"] == 0
                     and before is not None and after is not None and after <= before + 256)
    results.write(a.out, out)
    print(f"check_pin_fault: ok={out['ok']} exited={exited} rc={proc.returncode} in {seconds:.0f} s; {seen['lines'][:1]}; "
          f"GPU {before} -> {after} MiB; leftover {out['leftover_processes']}")
    return 0 if out["ok"] else 2


if __name__ == "__main__":
    sys.exit(main())
