"""Regenerate docs/eval.md's tables and docs/results/eval/*.png from the committed JSON.

    python scripts/eval/report.py [--results-dir docs/results/eval] [--doc docs/eval.md]
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sglang_elastic.eval import report  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results-dir", type=Path, default=ROOT / "docs/results/eval")
    ap.add_argument("--doc", type=Path, default=ROOT / "docs/eval.md")
    a = ap.parse_args()
    done = report.render_doc(a.doc, a.results_dir, ROOT)
    print(f"{a.doc}: {', '.join(done)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
