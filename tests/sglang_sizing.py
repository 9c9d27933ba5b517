"""What :mod:`sglang_elastic.eval.sizing` restates, computed by the real
SGLang 0.5.17 (tests only: importing SGLang takes 15-20 s on 2 cores, which
``sglang-elastic advise`` no longer pays).

Each function has the signature of its light twin in ``sizing``, so a test
can run the whole advisor through SGLang (monkeypatching ``sizing``) and
compare every output with the light run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, Optional
from unittest import mock

from sglang_elastic.eval import sizing


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        old = logging.root.manager.disable
        logging.disable(logging.WARNING)
        try:
            yield
        finally:
            logging.disable(old)


def server_args(model_path, gpu_mem_mib: float, tp: int, chunked_prefill_size: Optional[int] = None, post_capture: bool = False,
                max_running_requests: Optional[int] = None):
    """SGLang's ``ServerArgs`` as ``launch_server`` builds it on a GPU
    reporting ``gpu_mem_mib``, with the serve defaults the advisor assumes."""
    import sglang.srt.server_args as sa_mod
    from sglang.srt.environ import envs

    kw = dict(model_path=str(model_path), device="cuda", tp_size=tp, load_format="dummy", skip_tokenizer_init=True, attention_backend="flashinfer",
              sampling_backend="pytorch", grammar_backend="none")
    if chunked_prefill_size is not None:
        kw["chunked_prefill_size"] = chunked_prefill_size
    if max_running_requests is not None:
        kw["max_running_requests"] = max_running_requests
    with _quiet(), mock.patch.object(sa_mod, "get_device_memory_capacity", lambda *a, **k: gpu_mem_mib), envs.SGLANG_ENABLE_POST_CAPTURE_KV_SIZING.override(post_capture):
        return sa_mod.ServerArgs(**kw)


class SGLangSizing(sizing.ServerSizing):
    """A :class:`~sglang_elastic.eval.sizing.ServerSizing` whose methods ask SGLang's ``ServerArgs``."""

    def max_prefill_buffer_tokens(self) -> int:
        return self._sa.max_prefill_buffer_tokens()

    def pre_capture_activation_reserve_mb(self, gpu_mem_mib):
        return self._sa.pre_capture_activation_reserve_mb(gpu_mem_mib)


def server_sizing(model_path, gpu_mem_mib: float, tp: int, chunked_prefill_size: Optional[int] = None, post_capture: bool = False,
                  max_running_requests: Optional[int] = None) -> sizing.ServerSizing:
    from sglang.srt.environ import envs

    sa = server_args(model_path, gpu_mem_mib, tp, chunked_prefill_size, post_capture, max_running_requests)
    with envs.SGLANG_ENABLE_POST_CAPTURE_KV_SIZING.override(post_capture):  # the check reads the env, as at launch
        planned = bool(sa.post_capture_kv_sizing_planned())
    cg = sa.cuda_graph_config
    out = SGLangSizing(tp_size=sa.tp_size, chunked_prefill_size=sa.chunked_prefill_size, mem_fraction_static=sa.mem_fraction_static,
                       decode_max_bs=int(cg.decode.max_bs), decode_bs=tuple(cg.decode.bs), prefill_bs=tuple(cg.prefill.bs or ()),
                       max_running_requests=sa.max_running_requests, post_capture_planned=planned)
    object.__setattr__(out, "_sa", sa)
    return out


def model_facts(path: str, cfg: Dict[str, Any], where: str) -> sizing.ModelFacts:
    """SGLang's ``ModelConfig`` for ``cfg`` (written to a directory of its own
    unless ``path`` is a directory holding exactly it)."""
    d = Path(path)
    if not (d.is_dir() and (d / "config.json").is_file() and json.loads((d / "config.json").read_text()) == cfg):
        d = Path(tempfile.mkdtemp(prefix="sizing-ref-"))
        (d / "config.json").write_text(json.dumps(cfg))
    mc = server_args(d, 143771, 1).get_model_config()
    hf = mc.hf_text_config
    if hf.model_type not in sizing.DENSE_MODEL_TYPES or mc.attention_arch.name != "MHA" or getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None):
        raise sizing.AdviseError(f"{where}: model_type {hf.model_type!r} is not a dense MHA decoder of {', '.join(sizing.DENSE_MODEL_TYPES)}")
    return sizing.ModelFacts(path=str(path), model_type=hf.model_type, hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
                             num_hidden_layers=mc.num_hidden_layers, num_attention_heads=hf.num_attention_heads, num_key_value_heads=mc.get_total_num_kv_heads(),
                             head_dim=mc.head_dim, v_head_dim=getattr(mc, "v_head_dim", mc.head_dim) or mc.head_dim, vocab_size=hf.vocab_size,
                             tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)), attention_bias=bool(getattr(hf, "attention_bias", False)),
                             context_len=mc.context_len)


def resolve_max_num_reqs(tokens: int, context_len: int, max_running_requests: Optional[int] = None) -> int:
    """SGLang's ``KVCacheConfigurator.resolve_max_num_reqs`` with this pool and cap (no DP attention, no mamba state)."""
    import sglang.srt.mem_cache.kv_cache_configurator as kvc

    this = SimpleNamespace(model_config=SimpleNamespace(context_len=context_len), ps=SimpleNamespace(attn_dp_size=1), mambaish_config=None)
    with mock.patch.object(kvc, "get_schedule", lambda: SimpleNamespace(max_running_requests=max_running_requests)):
        return kvc.KVCacheConfigurator.resolve_max_num_reqs(this, tokens)


def req_to_token_extra_context_len(model_path, gpu_mem_mib: float = 143771, tp: int = 1) -> int:
    from sglang.srt.mem_cache.allocation_sizing import get_req_to_token_extra_context_len

    return get_req_to_token_extra_context_len(server_args(model_path, gpu_mem_mib, tp))


def through_sglang(monkeypatch) -> None:
    """Make :mod:`sglang_elastic.eval.sizing` answer through SGLang for the rest of a test."""
    monkeypatch.setattr(sizing, "server_sizing", server_sizing)
    monkeypatch.setattr(sizing, "model_facts", model_facts)
    monkeypatch.setattr(sizing, "resolve_max_num_reqs", resolve_max_num_reqs)
