"""CPU cost of the decode policy per step: the cost model alone, and the
backend's memoised ``choose`` over 2,000 steps of a batch growing one token
per request per step (what a decode loop sees).

    python scripts/bench_policy.py [--out docs/results/policy_cpu.json]

Hq=32, Hkv=8, d=128, the shipped H200 calibration, lengths uniform in
1K-60K (seed 0). Microseconds per call, ``timeit`` means; host-dependent (the
anchors doc's budget is 20 us per step).
"""

import argparse
import platform
import sys
import timeit
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from sglang_elastic import results  # noqa: E402
from sglang_elastic.attention import backend as B  # noqa: E402
from sglang_elastic.attention.policy import DecodePolicy, load_calibration  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    policy = DecodePolicy(load_calibration(), 32, 8, 128)
    rng = np.random.default_rng(0)
    rows = []
    for bs in (1, 8, 32, 64, 128, 256):
        base = torch.tensor(rng.integers(1000, 60000, bs), dtype=torch.int64)
        x = base.numpy() if bs >= 64 else base.tolist()
        model_us = timeit.timeit(lambda: policy.choose(x), number=500) / 500 * 1e6
        be = B.PersistentKVAttnBackend.__new__(B.PersistentKVAttnBackend)  # choose() needs only the policy and its memo
        be.policy, be._choices = policy, {}
        batches = iter([types.SimpleNamespace(batch_size=bs, seq_lens_cpu=base + s) for s in range(2000)])
        step_us = timeit.timeit(lambda: be.choose(next(batches)), number=2000) / 2000 * 1e6
        rows.append({"batch": bs, "cost_model_us": round(model_us, 2), "choose_per_step_us": round(step_us, 2), "model_runs": len(be._choices)})
        print(f"B{bs:<4d} cost model {model_us:6.1f} us   choose per step {step_us:5.1f} us   ({len(be._choices)} model runs in 2000 steps)")
    if a.out:
        results.write(a.out, {**results.header(), "gpu": "none (CPU only)", "cpu": results.cpu_name(),
                              "python": platform.python_version(), "rows": rows})


if __name__ == "__main__":
    main()
