"""SGLang 0.5.17's own memory sizing, as the advisor needs it, without
importing SGLang or torch (``sglang-elastic advise`` answers in well under a
second instead of SGLang's 15-20 s import on 2 cores).

Every function here restates, for the advisor's models (dense Llama, Qwen2
and Mistral decoders, MHA, no speculative decoding, no PD disaggregation, no
DP attention, PP 1) with the serve defaults the advisor assumes (FlashInfer,
dummy weights, no tokenizer), the code SGLang runs for it; the docstrings
name it. SGLang stays the source of truth: ``tests/test_sizing.py`` builds the
same numbers with the real SGLang 0.5.17 (``ServerArgs``, ``ModelConfig``,
``KVCacheConfigurator.resolve_max_num_reqs``,
``get_req_to_token_extra_context_len``) over a grid of models, GPU sizes, TP
degrees, chunks and request caps, and asserts equality, and runs the whole
advisor both ways.

Model facts come from ``config.json`` read as transformers 5's config
classes read it (``LlamaConfig``, ``Qwen2Config``, ``MistralConfig``: their
defaults for missing keys, ``rope_scaling``'s standardisation).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple


class AdviseError(ValueError):
    """A refusal of ``sglang-elastic advise``; its message is one line."""


#: model_type -> its one architecture the advisor covers.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
DENSE_MODEL_TYPES = tuple(ARCHITECTURES)

#: transformers 5.12's config-class defaults for the keys the sizing reads
#: (configuration_llama.py, configuration_qwen2.py, configuration_mistral.py).
#: ``num_key_value_heads`` None: as many as the attention heads.
_DEFAULTS: Dict[str, Dict[str, Any]] = {
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=None, max_position_embeddings=2048, tie_word_embeddings=False, attention_bias=False),
    "qwen2": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=32, max_position_embeddings=32768, tie_word_embeddings=False, attention_bias=False),
    "mistral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, max_position_embeddings=4096 * 32, tie_word_embeddings=False, attention_bias=False),
}
_INT_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
#: sglang/srt/utils/hf_transformers/common.py CONTEXT_LENGTH_KEYS, in its order of preference.
CONTEXT_LENGTH_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length", "max_position_embeddings")
#: Keys of a config whose weights are quantized (HF ``quantization_config``; compressed-tensors' ``compression_config``).
_QUANTIZATION_KEYS = ("quantization_config", "compression_config")
#: Keys that make SGLang size another kind of KV pool or count other heads (model_config.py:
#: get_total_num_kv_heads' attributes before num_key_value_heads, is_hybrid_swa_model's opt-in).
_OUTSIDE = ("multi_query", "n_head_kv", "num_kv_heads", "is_hybrid_swa", "num_local_experts", "num_experts", "kv_lora_rank")


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What SGLang's ``ModelConfig`` (and the advisor's weight count) reads of a model."""

    path: str  # the --model-path SGLang would get (its "llama-2" check reads it)
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int  # ModelConfig.get_total_num_kv_heads()
    head_dim: int
    v_head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool
    context_len: int  # ModelConfig.context_len
    defaulted: Tuple[str, ...] = ()  # the sizing keys config.json lacks, taken from transformers' config-class defaults


def read_config(model: str, embedded: Mapping[str, Path]) -> Tuple[str, Dict[str, Any]]:
    """``(model path, config dict)`` for ``--model-config``: a directory
    holding ``config.json``, a JSON file (``config.json`` or any name), or an
    embedded name (a key of ``embedded``: name -> its directory).

    Raises:
        AdviseError: nothing there, unreadable, not JSON, not a JSON object;
            each says what to pass instead.
    """
    p = Path(model)
    if p.is_dir():
        f = p / "config.json"
        if not f.is_file():
            raise AdviseError(f"--model-config {model}: a directory without config.json; pass the model's directory, its config.json, or an embedded name")
        path = p
    elif p.is_file():
        f = p
        path = p.parent if p.name == "config.json" else p
    elif p.suffix == ".json" or "/" in model or model.startswith("."):
        raise AdviseError(f"--model-config {model}: no such file or directory; pass the model's directory, its config.json, or an embedded name")
    elif model in embedded:
        path = Path(embedded[model])
        f = path / "config.json"
    else:
        raise AdviseError(f"--model-config {model}: no such file or directory, nor an embedded model; pass the model's directory or its config.json, "
                          f"or one of {', '.join(sorted(embedded))}")
    where, it = f"--model-config {model}: ", ("" if f == p else f"{f} is ")
    try:
        text = f.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise AdviseError(f"{where}cannot read {f} ({getattr(e, 'strerror', None) or e})") from None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise AdviseError(f"{where}{it}not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); fix it or pass the model's own config.json") from None
    if not isinstance(cfg, dict):
        raise AdviseError(f"{where}{it}a JSON {type(cfg).__name__}, not a model config (an object with model_type, hidden_size, ...)")
    return str(path), cfg


def _context_length(cfg: Dict[str, Any], max_pos_default: int) -> int:
    """``get_context_length`` (sglang/srt/utils/hf_transformers/common.py) on
    the config transformers 5 builds: ``rope_scaling`` (or
    ``rope_parameters``) standardised by ``RotaryEmbeddingConfigMixin`` (a
    "type" key read as "rope_type"; llama3, yarn and longrope get
    ``original_max_position_embeddings``, which makes SGLang ignore the
    factor)."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    factor = 1
    if isinstance(rope, dict) and rope:
        layer_types = cfg.get("layer_types")
        if cfg.get("model_type") == "qwen2" and layer_types is None:  # Qwen2Config.__post_init__ always sets them
            layer_types = ["full_attention"]
        nested = layer_types is not None and set(rope).issubset(set(layer_types))
        if not nested:
            kind = rope.get("rope_type", rope.get("type", "default"))
            if "original_max_position_embeddings" not in rope and kind not in ("llama3", "yarn", "longrope"):
                factor = rope.get("factor", 1)
    for key in CONTEXT_LENGTH_KEYS:
        val = cfg.get(key, max_pos_default if key == "max_position_embeddings" else None)
        if val is not None:
            return int(factor * val)
    return 2048


def model_facts(path: str, cfg: Dict[str, Any], where: str, *, quantized_ok: bool = False) -> ModelFacts:
    """SGLang's ``ModelConfig`` values for a dense decoder of
    :data:`DENSE_MODEL_TYPES` (model_config.py ``_derive_model_shapes``,
    ``_derive_context_length``, ``get_total_num_kv_heads``).

    ``quantized_ok``: read a quantized model's shapes too (its heads split over TP ranks as the
    16-bit model's do); the advisor's sizing leaves it False, since it counts 2 bytes a weight.

    Raises:
        AdviseError: another model type or architecture, a key that makes
            SGLang size another kind of pool, or a value transformers would refuse.
    """
    mt = cfg.get("model_type")
    arch = (cfg.get("architectures") or [None])[0] if isinstance(cfg.get("architectures"), list) else cfg.get("architectures")
    if mt is None:  # transformers' AutoConfig (SGLang's loader) cannot read such a config either
        raise AdviseError(f"{where}: config.json has no model_type (SGLang loads it through transformers, which needs one: "
                          f"{', '.join(repr(t) for t in DENSE_MODEL_TYPES)} for the models the advisor covers)")
    if mt not in ARCHITECTURES or arch not in (None, ARCHITECTURES[mt]):
        raise AdviseError(f"{where}: model_type {mt!r} ({arch or 'no architecture'}) is not a dense MHA decoder of {', '.join(DENSE_MODEL_TYPES)}; "
                          "the advisor's weight count covers those only")
    if arch is None:
        raise AdviseError(f"{where}: config.json names no architectures (SGLang needs e.g. [\"{ARCHITECTURES[mt]}\"])")
    outside = [k for k in _OUTSIDE if cfg.get(k)]
    if outside:
        raise AdviseError(f"{where}: {', '.join(outside)} set: not a dense MHA decoder of {', '.join(DENSE_MODEL_TYPES)}; the advisor's weight count covers those only")
    quant = None if quantized_ok else next((cfg[k] for k in _QUANTIZATION_KEYS if cfg.get(k)), None)
    if quant:  # AWQ, GPTQ, FP8, ...: the weight bytes (and so the KV pool) are not 2 bytes a parameter
        method = quant.get("quant_method") or quant.get("format") if isinstance(quant, dict) else None
        raise AdviseError(f"{where}: quantized weights ({method or 'quantization_config'}): the advisor counts 16-bit weights "
                          "only and would misjudge the KV pool; advise the unquantized model's config.json")
    if mt == "qwen2" and cfg.get("use_sliding_window"):
        raise AdviseError(f"{where}: use_sliding_window is on: SGLang sizes a sliding-window pool there, which the advisor does not model")
    d = {**_DEFAULTS[mt], **{k: v for k, v in cfg.items() if v is not None or k == "num_key_value_heads"}}
    for k in _INT_KEYS + ("max_position_embeddings",):
        if not isinstance(d.get(k), int) or isinstance(d.get(k), bool) or d[k] <= 0:
            raise AdviseError(f"{where}: {k} must be a positive integer, not {d.get(k)!r}")
    heads = d["num_attention_heads"]
    kv = d.get("num_key_value_heads")
    kv = heads if kv is None else kv
    if not isinstance(kv, int) or isinstance(kv, bool) or kv <= 0:
        raise AdviseError(f"{where}: num_key_value_heads must be a positive integer, not {kv!r}")
    if mt == "llama" and d["hidden_size"] % heads:  # LlamaConfig.validate_architecture
        raise AdviseError(f"{where}: hidden_size {d['hidden_size']} is not a multiple of num_attention_heads {heads} (transformers refuses it)")
    hd = d.get("head_dim") or d["hidden_size"] // heads
    vhd = d.get("v_head_dim") or hd
    return ModelFacts(path=path, model_type=mt, hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, v_head_dim=vhd, vocab_size=d["vocab_size"],
                      tie_word_embeddings=bool(d.get("tie_word_embeddings")), attention_bias=bool(d.get("attention_bias")),
                      context_len=_context_length(cfg, _DEFAULTS[mt]["max_position_embeddings"]),
                      defaulted=tuple(k for k in _INT_KEYS + ("num_key_value_heads",) if cfg.get(k) is None))


# ----------------------------------------------------------------------------
# ServerArgs (sglang/srt/server_args.py)


def decode_graph_batch_sizes(max_bs: int) -> List[int]:
    """``ServerArgs._generate_decode_cuda_graph_batch_sizes`` (no speculative decoding, padding on)."""
    bs = [1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 512, 16)) + list(range(512, max_bs + 1, 32))
    bs = [b for b in bs if b <= max_bs]
    return bs if max_bs in bs else bs + [max_bs]


def prefill_graph_batch_sizes(max_bs: int) -> List[int]:
    """``ServerArgs._generate_prefill_cuda_graph_batch_sizes``."""
    sizes = (list(range(4, 33, 4)) + list(range(48, 257, 16)) + list(range(288, 513, 32)) + list(range(576, 1024 + 1, 64))
             + list(range(1280, 4096 + 1, 256)) + list(range(4608, max_bs + 1, 512)))
    return [s for s in sizes if s <= max_bs]


@dataclasses.dataclass(frozen=True)
class ServerSizing:
    """The ``ServerArgs`` values the advisor reads."""

    tp_size: int
    chunked_prefill_size: int
    mem_fraction_static: float
    decode_max_bs: int  # cuda_graph_config.decode.max_bs
    decode_bs: Tuple[int, ...]
    prefill_bs: Tuple[int, ...]  # cuda_graph_config.prefill.bs
    max_running_requests: Optional[int]
    #: ``post_capture_kv_sizing_planned()`` with SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1 (False without it).
    post_capture_planned: bool

    def max_prefill_buffer_tokens(self) -> int:
        """``ServerArgs.max_prefill_buffer_tokens`` (PP 1: the chunk)."""
        return self.chunked_prefill_size if self.chunked_prefill_size > 0 else 0

    def pre_capture_activation_reserve_mb(self, gpu_mem_mib: Optional[float]) -> float:
        """``ServerArgs.pre_capture_activation_reserve_mb`` (no PD decode role; a chunk, not ``max_prefill_tokens``)."""
        reserved = 512 + max(self.chunked_prefill_size, 2048) * 1.5 + self.tp_size / 8 * 1024
        if gpu_mem_mib is not None and gpu_mem_mib > 60 * 1024:
            reserved = max(reserved, 10 * 1024)
        return reserved


def server_sizing(model_path: str, gpu_mem_mib: float, tp: int, chunked_prefill_size: Optional[int] = None, post_capture: bool = False,
                  max_running_requests: Optional[int] = None) -> ServerSizing:
    """``ServerArgs(model_path=..., tp_size=tp, ...)`` on a GPU reporting
    ``gpu_mem_mib`` (``get_device_memory_capacity``), with
    SGLANG_ENABLE_POST_CAPTURE_KV_SIZING set to ``post_capture``:
    ``_handle_gpu_memory_settings`` (chunk and decode-graph batch by GPU
    size, prefill-graph sizes up to the chunk, ``mem_fraction_static`` from
    the reserve ``512 + max(chunk, 2048) * 1.5 + TP / 8 GiB + graphs``,
    at least 10 GiB on GPUs above 60 GiB, or ``512 + TP / 8 GiB`` where
    post-capture sizing is planned), ``reserve_for_graph_mb`` (2 MiB per
    decode-graph request, 8 MiB per prefill graph) and
    ``post_capture_kv_sizing_planned`` (the prefill graphs must hold the
    chunk). ``max_running_requests`` changes none of these outside PD decode."""
    g = gpu_mem_mib
    if g < 20 * 1024:
        chunk, max_bs = 2048, 8
    elif g < 35 * 1024:
        chunk, max_bs = 2048, (24 if tp < 4 else 80)
    elif g < 60 * 1024:
        chunk, max_bs = 4096, (32 if tp < 4 else 160)
    elif g < 160 * 1024:
        chunk, max_bs = 8192, (256 if tp < 4 else 512)
    else:
        chunk, max_bs = 16384, 512
    if chunked_prefill_size is not None:
        chunk = chunked_prefill_size
    decode_bs = decode_graph_batch_sizes(max_bs)
    prefill_max = chunk
    if "llama-2" in str(model_path).lower():  # SGLang's Llama-2 cap on the prefill graphs
        prefill_max = min(prefill_max, 4096)
    prefill_bs = prefill_graph_batch_sizes(prefill_max)
    planned = bool(post_capture) and chunk > 0 and chunk <= max(prefill_bs or (0,))
    if planned:
        reserved = 512 + tp / 8 * 1024
    else:
        reserved = 512 + max(chunk, 2048) * 1.5 + tp / 8 * 1024 + (max_bs * 2 + len(prefill_bs) * 8)
        if g > 60 * 1024:
            reserved = max(reserved, 10 * 1024)
    return ServerSizing(tp_size=tp, chunked_prefill_size=chunk, mem_fraction_static=round((g - reserved) / g, 3), decode_max_bs=max_bs,
                        decode_bs=tuple(decode_bs), prefill_bs=tuple(prefill_bs), max_running_requests=max_running_requests,
                        post_capture_planned=planned)


# ----------------------------------------------------------------------------
# The req_to_token table (sglang/srt/mem_cache/)


def resolve_max_num_reqs(tokens: int, context_len: int, max_running_requests: Optional[int] = None) -> int:
    """``KVCacheConfigurator.resolve_max_num_reqs`` (kv_cache_configurator.py;
    no DP attention, no mamba state): ``int(tokens / context_len * 512)``
    within [2048, 4096], or ``--max-running-requests``, at most half the pool."""
    if max_running_requests is not None:
        return min(max_running_requests, tokens // 2)
    return min(max(min(int(tokens / context_len * 512), 4096), 2048), tokens // 2)


#: ``get_req_to_token_extra_context_len`` (mem_cache/allocation_sizing.py) without speculative decoding.
REQ_TO_TOKEN_EXTRA_CONTEXT_LEN = 4


def req_to_token_bytes(tokens: int, context_len: int, max_running_requests: Optional[int] = None) -> int:
    """Bytes of SGLang's ``req_to_token`` table (``ReqToTokenPool``,
    mem_cache/memory_pool.py: int32 ``[max_num_reqs + 1, context_len + extra]``)."""
    reqs = resolve_max_num_reqs(max(0, tokens), context_len, max_running_requests)
    return (reqs + 1) * (context_len + REQ_TO_TOKEN_EXTRA_CONTEXT_LEN) * 4
