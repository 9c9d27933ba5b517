"""``sglang-elastic`` command line.

    sglang-elastic patch status      [--sglang-dir DIR]
    sglang-elastic patch apply       [--sglang-dir DIR]
    sglang-elastic patch revert      [--sglang-dir DIR]
    sglang-elastic patch restore     --from-wheel [WHEEL] [--sglang-dir DIR]
    sglang-elastic patch build-wheel --out DIR [--wheel PATH | --python-version X.Y]
    sglang-elastic patch check       --sglang-src DIR [--report FILE]   (exit 1: a hunk conflicts)
    sglang-elastic patch manifest    --wheel PATH        (maintainers: rewrite patches/manifest.json)
    sglang-elastic serve             [--embedded-model NAME] [--dry-run] [--allow-unpatched] [SGLANG FLAGS...]
    sglang-elastic advise            --model-config PATH --gpu-mem-gb G --tp N [--chunked-prefill-size C] [--kv-offload --host-mem-gb H] [--json]

Refusals print one line on stderr and exit 2, having changed nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import List, Optional

from sglang_elastic import __version__, patchset


def _add_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sglang-dir", type=Path, default=None, help="the sglang package directory or the site-packages holding it (default: the installed sglang)")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="sglang-elastic", allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--version", action="version", version=f"sglang-elastic {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)

    patch = sub.add_parser("patch", help="apply, revert, inspect the SGLang 0.5.17 patch series")
    psub = patch.add_subparsers(dest="op", required=True)
    for op, hlp in (("status", "per patch: pristine / applied / partially applied / foreign changes"), ("apply", "apply the whole series, or nothing"), ("revert", "restore the wheel's files byte for byte")):
        _add_dir(psub.add_parser(op, help=hlp))
    rs = psub.add_parser("restore", help="overwrite the series' files with the 0.5.17 wheel's, whatever they hold (where revert refuses: a file edited by hand)",
                         description="Overwrite every file the patch series touches with the SGLang 0.5.17 wheel's bytes (checked against the wheel's RECORD "
                                     "and patches/manifest.json), whatever they hold now, and print each file overwritten and what it held.")
    _add_dir(rs)
    rs.add_argument("--from-wheel", nargs="?", const="", required=True, metavar="WHEEL",
                    help="the sglang-0.5.17 wheel; given alone, downloaded from PyPI with pip")
    bw = psub.add_parser("build-wheel", help="write a patched sglang-0.5.17+elastic<N> wheel")
    bw.add_argument("--out", type=Path, required=True)
    bw.add_argument("--wheel", type=Path, default=None, help="the sglang-0.5.17 wheel (default: download it from PyPI with pip)")
    bw.add_argument("--python-version", default=None, help="download the wheel for this CPython (e.g. 3.12) instead of the running one")
    ck = psub.add_parser("check", help="dry-run the series against another SGLang tree")
    ck.add_argument("--sglang-src", type=Path, required=True, help="an SGLang source tree, unpacked wheel or site-packages")
    ck.add_argument("--report", type=Path, default=None, help="also write the Markdown report here")
    mf = psub.add_parser("manifest", help="maintainers: recompute patches/manifest.json from the 0.5.17 wheel")
    mf.add_argument("--wheel", type=Path, required=True)
    mf.add_argument("--out", type=Path, default=None)

    sv = sub.add_parser(
        "serve", allow_abbrev=False, help="start the patched SGLang server on an embedded model shape (extra flags go to SGLang)",
        description="Start python -m sglang.launch_server on the patched SGLang. Every flag not listed here is passed to SGLang unchanged and overrides our defaults (see the README).",
    )
    sv.add_argument("--embedded-model", default="llama-3.1-8b", help="embedded model config: llama-3.1-8b (default), qwen2.5-7b, qwen2.5-32b, llama-3.1-70b (needs --tp >= 2 on an H200)")
    sv.add_argument("--dry-run", action="store_true", help="print the launch_server command and exit")
    sv.add_argument("--allow-unpatched", action="store_true", help="serve even if the series is not applied")
    ad = sub.add_parser(
        "advise", allow_abbrev=False, help="predict SGLang's prefill reserve, the lendable bytes and the extra KV tokens; recommend post-capture sizing / elastic / smaller chunk / neither",
        description="Sizing as SGLang 0.5.17's own ServerArgs computes it (mem_fraction_static, chunked_prefill_size) on a GPU of the given memory, restated without importing SGLang or torch (a CPU test checks it against SGLang), plus measured factors (sglang_elastic/eval/calibration.json). No GPU needed; answers in well under a second.",
    )
    ad.add_argument("--model-config", required=True, help="a model directory, its config.json (HF layout, any file name), or an embedded name: llama-3.1-8b, qwen2.5-7b, qwen2.5-32b, llama-3.1-70b")
    ad.add_argument("--gpu-mem-gb", type=float, required=True, help="memory of one GPU in GiB as nvidia-smi reports it / 1024 (H200: 140.4 = 143,771 MiB)")
    ad.add_argument("--tp", type=int, required=True, help="tensor-parallel degree: 1, 2, 4, 8")
    ad.add_argument("--chunked-prefill-size", type=int, default=None, help="default: SGLang's choice for this GPU size")
    ad.add_argument("--margin-mb", type=float, default=1024, help="MiB kept free when lending (--elastic-kv-margin-mb, default 1024)")
    ad.add_argument("--max-running-requests", type=int, default=None,
                    help="the server's --max-running-requests (default: unset, as SGLang's default); at most the decode CUDA graphs' batch lets SGLang's post-capture sizing keep no eager-decode reserve")
    ad.add_argument("--calibration", type=Path, default=None, help="calibration JSON (default: the packaged one)")
    ad.add_argument("--kv-offload", action="store_true", help="also predict --enable-kv-offload's pool (its own sizing, the shipped defaults)")
    ad.add_argument("--host-mem-gb", type=float, default=None, help="with --kv-offload: host RAM free per GPU, GiB (the host pool's bound)")
    ad.add_argument("--request-tokens", type=int, default=None, help="with --kv-offload: tokens per request (prompt + output) for the requests-at-once line (default 32768, or the model's context length if shorter)")
    ad.add_argument("--json", action="store_true", help="print the prediction as JSON")
    return ap


def _advise(args: argparse.Namespace) -> int:
    from sglang_elastic.eval import advisor

    if args.kv_offload and args.host_mem_gb is None:
        raise advisor.AdviseError("--kv-offload needs --host-mem-gb (host RAM free per GPU, GiB): the host pool holds V")
    for flag, given in (("--host-mem-gb", args.host_mem_gb), ("--request-tokens", args.request_tokens)):
        if not args.kv_offload and given is not None:
            raise advisor.AdviseError(f"{flag} is read with --kv-offload only: add --kv-offload")
    cal = advisor.load_calibration(args.calibration)
    p = advisor.predict(args.model_config, args.gpu_mem_gb, args.tp, args.chunked_prefill_size, margin_mib=args.margin_mb, calibration=cal,
                        max_running_requests=args.max_running_requests)
    if args.kv_offload:
        p["kv_offload"] = advisor.predict_offload(p, args.host_mem_gb, args.request_tokens, args.max_running_requests)
    text = advisor.format_text(p) + ("\n" + advisor.format_offload_text(p["kv_offload"]) if args.kv_offload else "")
    print(json.dumps(p, indent=2) if args.json else text)
    return 0


def _patch(args: argparse.Namespace) -> int:
    if args.op == "status":
        inst = patchset.locate(args.sglang_dir)
        st = patchset.status(inst)
        print(f"SGLang {inst.version} at {inst.package_dir}: {patchset.overall(st).value}")
        for s in st:
            print(f"  {s.name}: {s.state.value}" + (f" ({s.detail})" if s.detail else ""))
        return 0
    if args.op == "apply":
        inst = patchset.locate(args.sglang_dir)
        files = patchset.apply(inst)
        print(f"applied {len(patchset.load_series())} patch(es) to SGLang {inst.version} at {inst.package_dir} ({len(files)} file(s))")
        return 0
    if args.op == "revert":
        inst = patchset.locate(args.sglang_dir)
        files = patchset.revert(inst)
        print(f"reverted {len(files)} file(s) of SGLang {inst.version} at {inst.package_dir} to the wheel" if files else "already pristine: nothing to revert")
        return 0
    if args.op == "restore":
        inst = patchset.locate(args.sglang_dir)
        patchset.status(inst)  # the version first: 0.5.17's files must not land in another release
        with tempfile.TemporaryDirectory() as tmp:
            whl = Path(args.from_wheel) if args.from_wheel else patchset.download_wheel(Path(tmp))
            written = patchset.restore_from_wheel(inst, whl)
        if not written:
            print(f"every file the series touches in SGLang {inst.version} at {inst.package_dir} is already as in {whl.name}: nothing overwritten")
        else:
            print(f"restored {len(written)} file(s) of SGLang {inst.version} at {inst.package_dir} from {whl.name}:")
            for path, was in written:
                print(f"  overwrote {path} (it was: {was})")
        return 0
    if args.op == "build-wheel":
        src = args.wheel
        with tempfile.TemporaryDirectory() as tmp:
            if src is None:
                src = patchset.download_wheel(Path(tmp), args.python_version)
            out = patchset.build_wheel(src, args.out)
        print(out)
        return 0
    if args.op == "check":
        inst = patchset.locate(args.sglang_src, need_version=False)
        rows = patchset.check(inst)
        report = patchset.check_report(inst, rows)
        if args.report:
            args.report.write_text(report)
        print(report, end="")
        bad = [r for r in rows if r.state is patchset.HunkState.CONFLICT]
        partly = [p for p, v in patchset.verdicts(rows).items() if v == patchset.PARTLY_APPLIED]
        if partly and not bad:
            print(f"sglang-elastic: {', '.join(partly)} partly applied in that tree (some hunks in, others not): "
                  "restore the files from the wheel, then apply the series", file=sys.stderr)
            return 1
        if bad:
            print(f"sglang-elastic: {len(bad)} of {len(rows)} hunk(s) conflict with SGLang {inst.version} "
                  f"({', '.join(sorted({r.patch for r in bad}))}): the series does not apply there; rebase those patches", file=sys.stderr)
            return 1
        return 0
    if args.op == "manifest":
        series = patchset.load_series()
        if not args.wheel.name.startswith(f"sglang-{patchset.SGLANG_VERSION}-"):
            raise patchset.PatchError(f"{args.wheel.name} is not the sglang {patchset.SGLANG_VERSION} wheel")
        with zipfile.ZipFile(args.wheel) as z:
            pristine = {p: z.read(p) for p in patchset.touched_files(series)}
        text = json.dumps(patchset.build_manifest(series, pristine), indent=2) + "\n"
        out = args.out or (patchset._patch_dir() / "manifest.json")
        Path(out).write_text(text)
        print(out)
        return 0
    raise AssertionError(args.op)


def main(argv: Optional[List[str]] = None) -> int:
    ap = _parser()
    args, extra = ap.parse_known_args(argv)
    if extra and args.cmd != "serve":
        ap.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if args.cmd == "patch":
            return _patch(args)
        if args.cmd == "advise":
            return _advise(args)
        from sglang_elastic import serve

        return serve.serve(args.embedded_model, extra, dry_run=args.dry_run, require_patched=not args.allow_unpatched)
    except BrokenPipeError:  # the reader took what it wanted (`patch status | head -1`): the work is done, not an error
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the interpreter's last flush must not fail again
        return 0
    except (patchset.PatchError, ValueError, OSError, zipfile.BadZipFile, KeyError) as e:
        from sglang_elastic.eval.advisor import AdviseError  # light: no SGLang import

        if isinstance(e, OSError) and e.filename and e.strerror:  # a file we were asked to read or write
            msg = f"{e.filename}: {e.strerror}"
        elif isinstance(e, (patchset.PatchError, AdviseError)):  # their messages stand alone; others keep their type
            msg = str(e)
        else:
            msg = f"{type(e).__name__}: {e}"
        print(f"sglang-elastic: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
