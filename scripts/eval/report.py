"""Regenerate docs/eval.md's tables and docs/results/eval/*.png from the committed JSON.

    python scripts/eval/report.py [--results-dir docs/results/eval] [--doc docs/eval.md]
    python scripts/eval/report.py --standin [--out FILE]   # the dry runs' *.standin.json, into their own file

With --standin it leaves docs/eval.md alone and writes the tables and plots
of the CPU dry runs (run.py --standin) to FILE (default
RESULTS_DIR/standin.md, git-ignored, as are their *.standin.png).
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sglang_elastic.eval import report  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results-dir", type=Path, default=ROOT / "docs/results/eval")
    ap.add_argument("--doc", type=Path, default=ROOT / "docs/eval.md")
    ap.add_argument("--standin", action="store_true", help="render the dry runs' *.standin.json into --out instead of docs/eval.md")
    ap.add_argument("--out", type=Path, default=None, help="with --standin: the Markdown file (default RESULTS_DIR/standin.md)")
    a = ap.parse_args()
    if a.standin:
        out = a.out or a.results_dir / "standin.md"
        done = report.render_standin(out, a.results_dir, ROOT)
        print(f"{out}: {', '.join(done) or 'no *.standin.json in ' + str(a.results_dir) + ' (run.py --standin writes them)'}")
        return 0
    done = report.render_doc(a.doc, a.results_dir, ROOT)
    print(f"{a.doc}: {', '.join(done)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
