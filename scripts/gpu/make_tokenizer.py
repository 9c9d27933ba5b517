"""Write a stand-in tokenizer with the model's vocabulary size.

``sglang.bench_serving`` needs a tokenizer even when it sends ``input_ids``
(``--dataset-name random-ids --tokenize-prompt``): it samples ids below
``tokenizer.vocab_size``. No real tokenizer can be downloaded here, so this
writes a word-level one (token ``t<i>`` is id ``i``) with the vocabulary size of
the model config; the server itself runs with ``--skip-tokenizer-init``.

    python scripts/gpu/make_tokenizer.py MODEL_CONFIG_DIR OUT_DIR
"""

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


def main(model_dir: str, out_dir: str) -> None:
    vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    vocab = {"<unk>": 0, **{f"t{i}": i for i in range(1, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    fast.save_pretrained(out_dir)
    assert fast.vocab_size == vocab_size, (fast.vocab_size, vocab_size)
    print(f"wrote {out_dir}: vocab_size={vocab_size}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
