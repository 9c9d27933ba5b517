"""A PyTorch forward of a Hugging Face Llama checkpoint (the converted
SmolLM2-135M-Instruct) whose decode steps attend as the offload policy says.

Prefill is dense, by transformers' own ``LlamaForCausalLM`` (fp32, SDPA); its
KV cache seeds every decode stream. A decode step runs the same modules layer
by layer (``input_layernorm``, q/k/v projections, RoPE, attention,
``o_proj``, MLP, final norm, tied ``lm_head``) with the attention of each
stream in float64: a sparse layer (at or above the policy's ``dense_layers``)
is :func:`sglang_elastic.offload.policy.attend_reference` itself (its own
query scores all positions; it attends to the sink, the window and the top-k
rows of the summed softmax, with the denominator the policy names); a dense
layer, and every layer of the dense run (:data:`DENSE`), is
:func:`dense_attention`, the same arithmetic without the selection.

One sample (:func:`run_sample`) shares one prefill among all its streams and
batches them through the projections and MLP: the dense greedy run, one
teacher-forced run per policy (fed dense's tokens: the next-token
KL(dense || policy) over the full vocabulary on the same prefix at every
step), and, from a policy's first greedy disagreement on, its own free greedy
run (forked from the teacher-forced cache: up to that step both are the same
run), which decides whether the policy solves the sample.

Ideas: InfiniGen (Lee et al., OSDI'24, arXiv 2406.19707) for the sparse decode
with dense early layers; the exact top-k selection of
``shared/design/offload-anchors.md`` §5.3.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence

import torch

from ..policy import OffloadPolicy, attend_reference, select_reference, token_scores
from .tasks import Sample, answer_text

#: Every layer dense: the dense baseline.
DENSE = OffloadPolicy(dense_layers=1 << 30)


class ReferenceError(ValueError):
    """A bad model directory or request; the message is one line."""


@dataclasses.dataclass
class Stream:
    """One decode run: its KV cache and policy.

    ``k``, ``v``: ``[layers, capacity, kv_heads, head_dim]`` float64 (post-RoPE
    K; float64 so the reference attention reads them without a copy); ``length``: filled positions; ``attended``: per decode step, the
    attended positions of a sparse layer over ``L`` (the same in every sparse
    layer: the counts depend on ``L`` only).
    """

    policy: OffloadPolicy
    k: torch.Tensor
    v: torch.Tensor
    length: int
    attended: List[float] = dataclasses.field(default_factory=list)

    def fork(self) -> "Stream":
        """A copy with its own caches (a run that goes on from this step on its own tokens)."""
        return Stream(self.policy, self.k.clone(), self.v.clone(), self.length, list(self.attended))


@dataclasses.dataclass
class PolicyOutcome:
    """A policy's result on one sample.

    ``tokens``: its own greedy tokens; ``solved``: whether their text holds the
    answers (``None`` for natural text); ``kl``: per decode step
    KL(dense || policy) in nats on dense's prefix; ``budget_frac``: mean
    attended fraction of the context in its sparse layers.
    """

    tokens: List[int]
    solved: Optional[bool]
    kl: List[float]
    budget_frac: float


@dataclasses.dataclass
class SampleOutcome:
    """Dense's tokens and whether they solve the sample, and each policy's outcome (by label)."""

    sample: Sample
    dense_tokens: List[int]
    dense_solved: Optional[bool]
    policies: Dict[str, PolicyOutcome]


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One request's dense decode attention in float64, GQA without copying K/V
    per query head (what :func:`attend_reference` computes for a dense layer).

    Args:
        q: ``[q_heads, D]``; k, v: ``[L, kv_heads, D]`` (any float dtype).

    Returns:
        ``[q_heads, D]`` float64; scale ``D ** -0.5``.
    """
    Hq, D = q.shape
    Hkv = k.shape[1]
    qg = q.double().view(Hkv, Hq // Hkv, D)
    s = torch.einsum("hgd,lhd->hgl", qg, k.double()) * D ** -0.5
    return torch.einsum("hgl,lhd->hgd", torch.softmax(s, -1), v.double()).reshape(Hq, D)


def guessed_selection(q: torch.Tensor, k: torch.Tensor, policy: OffloadPolicy) -> torch.Tensor:
    """The positions ``policy`` attends to for query ``q`` (``[q_heads, D]``) over
    keys ``k`` (``[L, kv_heads, D]``), without the attention: the selection of
    :func:`~sglang_elastic.offload.policy.attend_reference` (scale ``D ** -0.5``)."""
    Hq, D = q.shape
    Hkv = k.shape[1]
    s = torch.einsum("hgd,lhd->hgl", q.double().view(Hkv, Hq // Hkv, D), k.double()).reshape(Hq, -1) * D ** -0.5
    return select_reference(token_scores(s, torch.logsumexp(s, dim=1)), policy)


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(p) || softmax(q)) in nats, over the last dim, in float64.

    Args:
        p_logits, q_logits: ``[..., vocab]`` logits (any float dtype).

    Returns:
        ``[...]`` float64, >= 0.
    """
    lp = torch.log_softmax(p_logits.double(), -1)
    lq = torch.log_softmax(q_logits.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0)


class Reference:
    """The converted checkpoint in float32 on CPU (see the module docstring).

    Args:
        model_dir: a Hugging Face Llama checkpoint (``config.json``,
            safetensors, tokenizer), loaded offline.
        threads: torch threads for the prefill (large GEMMs).
        decode_threads: torch threads for decode steps: their ops are tiny
            (a [streams, 576] GEMV, one request's attention), where more
            threads only add OpenMP overhead (one thread was 6x faster than
            two on the 2-core CI box while other jobs shared it).

    Raises:
        ReferenceError: not a loadable Llama checkpoint.
    """

    def __init__(self, model_dir: str, threads: int = 2, decode_threads: int = 1):
        from transformers import AutoTokenizer, LlamaForCausalLM

        self.threads, self.decode_threads = threads, decode_threads
        try:
            self.model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ReferenceError(f"{model_dir}: not a Llama checkpoint transformers can load offline ({str(e).splitlines()[0]})") from None
        cfg = self.model.config
        self.layers = cfg.num_hidden_layers
        self.kv_heads = cfg.num_key_value_heads
        self.q_heads = cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.max_positions = cfg.max_position_embeddings
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos])

    @torch.no_grad()
    def prefill(self, input_ids: Sequence[int], capacity: int):
        """Dense prefill by transformers.

        Args:
            input_ids: ``n`` prompt token ids.
            capacity: KV positions to allocate (``n`` + decode steps).

        Returns:
            ``(k, v, logits)``: ``[layers, capacity, kv_heads, head_dim]``
            float64 caches with positions ``< n`` filled, and the last
            position's ``[vocab]`` float32 logits.
        """
        n = len(input_ids)
        if capacity > self.max_positions:
            raise ReferenceError(f"{capacity} positions exceed the model's {self.max_positions}")
        torch.set_num_threads(self.threads)
        out = self.model(torch.tensor([list(input_ids)]), use_cache=True, logits_to_keep=1)
        k = torch.zeros(self.layers, capacity, self.kv_heads, self.head_dim, dtype=torch.float64)
        v = torch.zeros_like(k)
        for i, layer in enumerate(out.past_key_values.layers):
            k[i, :n] = layer.keys[0].transpose(0, 1)
            v[i, :n] = layer.values[0].transpose(0, 1)
        return k, v, out.logits[0, -1].float()

    @torch.no_grad()
    def decode(self, streams: Sequence[Stream], tokens: Sequence[int], trace: Optional[list] = None) -> torch.Tensor:
        """One decode step of every stream (all at the same length ``L - 1``).

        Args:
            streams: the runs; each gets ``tokens[i]`` at position ``length``.
            tokens: one token id per stream.
            trace: with one stream, a list that gets, per sparse layer, ``(layer, selected, guessed)``:
                the top-k positions the layer selected (sink and window left out: they are fixed
                rows) and those InfiniGen's guess from the layer before picks
                (``RoPE(W_q(layer) . h)`` with ``h`` the previous layer's normed attention input,
                what :func:`sglang_elastic.offload.prefetch.guessed_query` computes, scored against
                this layer's K by the same rule), both ``[k]`` int64 (:mod:`.reuse`).

        Returns:
            ``[streams, vocab]`` float32 logits; every stream's ``length`` is one more.
        """
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        pos = streams[0].length
        if any(s.length != pos for s in streams):
            raise ReferenceError("decode: streams at different lengths")
        S, L = len(streams), pos + 1
        torch.set_num_threads(self.decode_threads)
        m = self.model.model
        x = m.embed_tokens(torch.tensor(list(tokens)))  # [S, hidden]
        cos, sin = m.rotary_emb(x[None], torch.tensor([[pos]]))
        if trace is not None and S != 1:
            raise ReferenceError("decode: a trace follows one stream")
        h_prev = None
        for i, layer in enumerate(m.layers):
            att = layer.self_attn
            h = layer.input_layernorm(x)
            q = att.q_proj(h).view(S, self.q_heads, 1, self.head_dim)
            k = att.k_proj(h).view(S, self.kv_heads, 1, self.head_dim)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            v = att.v_proj(h).view(S, self.kv_heads, self.head_dim)
            o = torch.empty(S, self.q_heads, self.head_dim, dtype=torch.float64)
            for j, s in enumerate(streams):
                s.k[i, pos] = k[j, :, 0]
                s.v[i, pos] = v[j]
                if s.policy.is_dense_layer(i):
                    o[j] = dense_attention(q[j, :, 0], s.k[i, :L], s.v[i, :L])
                else:
                    o[j], sel = attend_reference(q[j, :, 0], s.k[i, :L], s.v[i, :L], s.policy, i, return_selected=True)
                    if i == s.policy.dense_layers:  # the first sparse layer (counts are the same in all)
                        s.attended.append(sel.shape[-1] / L)  # per KV head when each has its own set: the same count
                    if trace is not None and h_prev is not None and sel.dim() == 1:
                        fixed = sum(s.policy.counts(L)[:2])
                        qs = att.q_proj(h_prev).view(S, self.q_heads, 1, self.head_dim)
                        qs, _ = apply_rotary_pos_emb(qs, k, cos, sin)
                        guess = guessed_selection(qs[0, :, 0], s.k[i, :L], s.policy)
                        trace.append((i, sel[fixed:].clone(), guess[fixed:].clone()))
            h_prev = h
            x = x + att.o_proj(o.view(S, -1).float())
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        for s in streams:
            s.length = L
        return self.model.lm_head(m.norm(x)).float()

    def text(self, tokens: Sequence[int]) -> str:
        """Decoded text of generated ``tokens`` up to the first EOS (excluded)."""
        return answer_text(self.tokenizer, self.eos_ids, tokens)


def run_sample(ref: Reference, sample: Sample, policies: Dict[str, OffloadPolicy]) -> SampleOutcome:
    """Dense and every policy on one sample (see the module docstring).

    Task samples: dense greedy for up to ``sample.max_new_tokens`` tokens or
    EOS; each policy teacher-forced on dense's tokens (KL at every decode
    step) and free-running from its first disagreement. Natural text
    (``sample.forced``): every run is fed the text's own tokens, KL only.

    Args:
        ref: the model.
        sample: prompt and answers (:mod:`.tasks`).
        policies: label -> policy.

    Returns:
        :class:`SampleOutcome`.
    """
    forced = list(sample.forced)
    steps = len(forced) if forced else sample.max_new_tokens
    n = len(sample.input_ids)
    k, v, logits0 = ref.prefill(sample.input_ids, n + steps)
    dense = Stream(DENSE, k, v, n)
    tf = {name: Stream(p, k.clone(), v.clone(), n) for name, p in policies.items()}
    free: Dict[str, Stream] = {}  # a policy's own run, from its first disagreement with dense on
    first = forced[0] if forced else int(logits0.argmax())
    dense_tokens, own = [first], {name: [first] for name in policies}
    kl: Dict[str, List[float]] = {name: [] for name in policies}

    def finished(tokens: List[int]) -> bool:
        return len(tokens) >= steps or (not forced and tokens[-1] in ref.eos_ids)

    while not finished(dense_tokens) or any(not finished(own[name]) for name in free):
        running = [name for name in free if not finished(own[name])]
        lockstep = not finished(dense_tokens)
        batch = ([dense] + list(tf.values()) if lockstep else []) + [free[name] for name in running]
        feed = ([dense_tokens[-1]] * (1 + len(tf)) if lockstep else []) + [own[name][-1] for name in running]
        logits = ref.decode(batch, feed)
        rows = dict(zip(running, logits[len(batch) - len(running):]))
        if lockstep:
            nxt = forced[len(dense_tokens)] if forced else int(logits[0].argmax())
            for row, name in enumerate(tf, 1):
                kl[name].append(float(kl_divergence(logits[0], logits[row])))
                if name not in free:
                    guess = nxt if forced else int(logits[row].argmax())
                    if guess != nxt:  # disagrees: its own run goes on from this cache
                        free[name] = tf[name].fork()
                    own[name].append(guess)
            dense_tokens.append(nxt)
        for name, row in rows.items():
            own[name].append(int(row.argmax()))
    dense_solved = None if forced else sample.solved(ref.text(dense_tokens))
    outcomes = {}
    for name in policies:
        att = free[name].attended if name in free else tf[name].attended
        solved = None if forced else sample.solved(ref.text(own[name]))
        outcomes[name] = PolicyOutcome(own[name], solved, kl[name], sum(att) / len(att) if att else 0.0)
    return SampleOutcome(sample, dense_tokens, dense_solved, outcomes)


__all__ = ["DENSE", "PolicyOutcome", "Reference", "ReferenceError", "SampleOutcome", "Stream", "dense_attention", "guessed_selection", "kl_divergence",
           "run_sample"]
