"""``sglang-elastic advise``: how much of SGLang's prefill reserve could be lent
to the KV cache, for a model shape, a GPU size and a TP degree.

Sizing is SGLang's own: what ``ServerArgs`` would pick on a GPU of the
given memory (``_handle_gpu_memory_settings``, sglang/srt/server_args.py:
``chunked_prefill_size``, the CUDA-graph batch sizes,
``mem_fraction_static``) and the KV cell size from SGLang's ``ModelConfig``
(``get_num_kv_heads(tp)``, ``head_dim``, layers; MHA:
``kv_heads * (head_dim + v_head_dim) * layers * 2 B``), computed by
:mod:`sglang_elastic.eval.sizing`, which restates that code without
importing SGLang or torch (an answer in well under a second); a CPU test
computes the same numbers through the real SGLang 0.5.17 and asserts
equality. What SGLang cannot answer without a GPU comes from measured
points (``calibration.json``):

- ``context_overhead_gib`` per TP degree: GPU memory taken before the model
  loads (CUDA context; at TP > 1 NCCL and custom all-reduce buffers too:
  1.36 GiB at TP 1, 2.2-2.3 GiB at TP 2 on the H200), so
  ``pre_model_load_free = gpu_mem - overhead``;
- what start-up takes out of that reserve after the KV pool (SGLang's
  reserve is ``pre_model_load_free * (1 - mem_fraction_static)``,
  kv_cache_configurator.py ``_profile_available_bytes``; what is left is
  ``available_gpu_mem`` in SGLang's start-up log), in three parts:

  - the ``req_to_token`` table, computed, not fitted
    (:func:`req_to_token_bytes`: SGLang's own row count and width, one int32
    per context position and request slot; 1.73 GiB for Llama-3.1-8B at TP 1,
    2.0 GiB at TP 2, 0.5 GiB for Qwen2.5-32B's 32K context);
  - the breakable prefill CUDA graphs, ``graph_bytes_per_layer_token`` per
    layer and token of ``--chunked-prefill-size`` (about 4.5 KiB on the
    H200, fitted on E1's chunk sweep, 2,048-32,768 tokens, and the three
    shapes at 8,192; above 8,192 a wider MLP than the sweep's takes more,
    :func:`chunk_caveats`);
  - a fixed part per TP degree ``graph_fixed_gib`` (decode graphs,
    workspaces; both grow at TP > 1).

  One slope for every model and TP, fitted by least squares within each TP
  degree's points, the fixed part the mean residual of each TP degree's
  points. Without the ``req_to_token`` term a fit on the total missed
  Llama-3.1-70B at TP 2 by 10 % of its free memory: Llama-3.1-8B's larger
  table (its 128K context and its pool's 3,539-4,096 request slots) had hidden
  its smaller prefill graphs (1.47 GiB against Qwen2.5-32B's 2.44 at TP 1).
  A TP degree without points takes the factors of the largest
  measured TP below it (``extrapolated_from_tp`` says so; from TP 2 to 4 or 8
  it misses SGLang's larger decode graphs there, batch 512 instead of 256).
  Lendable tokens are rounded down to the pool's lend step (whole 2 MiB
  granules of every K/V buffer).

Then ``kv = pre_model_load_free - weights/tp - reserve``, ``tokens = kv / cell``,
``free after graphs = reserve - graph_fixed - req_to_token(tokens) - per_layer_token * layers * chunk``,
``lendable = free after graphs - margin`` (the elastic pool's
``--elastic-kv-margin-mb``, default 1 GiB), ``extra tokens = lendable / cell``.

SGLang's own alternative, post-capture KV sizing
(``SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1``), is predicted the way
``compute_post_capture_kv_resize`` (sglang/srt/model_executor/
model_runner_components/kv_pool_runtime.py) sizes it: SGLang's
``mem_fraction_static`` with the env set caps the pool; after capture it
gets ``pre_model_load_free - weights/tp - graphs - headroom`` with
``headroom = pre_model_load_free * (1 - that fraction)``, or SGLang's whole
activation reserve (``pre_capture_activation_reserve_mb``) when more
requests may run than the decode CUDA graphs hold (``--max-running-requests``
unset or above their ``max_bs``: eager decodes). The elastic pool lends only
while the decode batch fits those graphs (``lend_max_batch``,
sglang_elastic/sched/controller.py), so both serve the same batches from the
extra memory; post-capture sizing needs no reclaim.
"""

from __future__ import annotations

import dataclasses
import json
import math
from importlib import resources
from pathlib import Path
from typing import Any, Dict, Optional

from sglang_elastic.eval import sizing
from sglang_elastic.eval.sizing import DENSE_MODEL_TYPES, AdviseError, ModelFacts  # noqa: F401  (DENSE_MODEL_TYPES, AdviseError: the advisor's names, as before)
from sglang_elastic.vmm.arena import token_quantum

GIB = 1 << 30
#: Below this, a gain in KV tokens (fraction of the pool) is not worth a change.
MIN_GAIN = 0.05
#: SGLang's --chunked-prefill-size on GPUs of the H200's size (server_args.py _handle_gpu_memory_settings).
DEFAULT_CHUNK = 8192
#: SGLang's activation term floors at 2048 tokens (server_args.py: max(chunked_prefill_size, 2048)).
SMALL_CHUNK = 2048
#: Without a KV pool at the asked chunk, an alternative is recommended only if
#: it gives at least this many tokens (a few long requests); else raise the TP degree.
MIN_POOL_TOKENS = 32768
DEFAULT_MARGIN_MIB = 1024  # sglang_elastic.config.ElasticKVConfig.margin_mb
#: The largest --gpu-mem-gb taken (GiB): above any GPU SGLang 0.5.17 runs on (B300: 288 GB), below a MiB figure given as GiB.
MAX_GPU_MEM_GIB = 1024
#: CUDA VMM's minimum allocation granularity on NVIDIA data-centre GPUs
#: (cuMemGetAllocationGranularity on the H200): the elastic pool maps whole granules.
VMM_GRANULARITY = 2 << 20


def model_facts(model: str) -> ModelFacts:
    """SGLang's ``ModelConfig`` values for ``--model-config`` (a model
    directory, a config JSON file, or an embedded name), read without SGLang
    (:func:`sglang_elastic.eval.sizing.model_facts`).

    Raises:
        AdviseError: nothing usable there; the message says what to pass.
    """
    from sglang_elastic.serve import model_names, model_path  # embedded shapes (light: no SGLang import)

    path, cfg = sizing.read_config(model, {n: model_path(n) for n in model_names()})
    return sizing.model_facts(path, cfg, f"--model-config {model}")


@dataclasses.dataclass(frozen=True)
class Shape:
    params: int
    num_layers: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype_bytes: int = 2
    #: SGLang's ``ModelConfig.context_len`` (tokens): the width of the ``req_to_token`` table.
    context_len: int = 0
    #: The MLP's ``intermediate_size``: what a chunk's activations grow with besides the layers.
    mlp_width: int = 0

    def row_bytes(self, tp: int) -> "list[int]":
        """Bytes per token of one layer's K and V buffers on one GPU (SGLang's MHA pool)."""
        kv = max(1, self.kv_heads // tp)
        return [kv * self.head_dim * self.dtype_bytes, kv * self.v_head_dim * self.dtype_bytes]

    def cell_bytes(self, tp: int) -> int:
        """KV bytes per token per GPU (SGLang's MHA cell size at this TP): every layer's K and V rows."""
        return sum(self.row_bytes(tp)) * self.num_layers

    def weight_bytes(self, tp: int) -> float:
        return self.params * self.dtype_bytes / tp


def shape_of(m: ModelFacts) -> Shape:
    """Parameter count (dense decoder: embeddings, attention, gated MLP, norms,
    LM head) and KV layout from SGLang's ``ModelConfig`` values."""
    h, inter, layers, vocab = m.hidden_size, m.intermediate_size, m.num_hidden_layers, m.vocab_size
    heads, kv, hd = m.num_attention_heads, m.num_key_value_heads, m.head_dim
    bias = m.attention_bias or m.model_type == "qwen2"  # Qwen2 has q/k/v biases
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h + ((heads + 2 * kv) * hd if bias else 0)
    per_layer = attn + 3 * h * inter + 2 * h
    params = vocab * h * (1 if m.tie_word_embeddings else 2) + layers * per_layer + h
    return Shape(params=params, num_layers=layers, kv_heads=kv, head_dim=hd, v_head_dim=m.v_head_dim, context_len=m.context_len, mlp_width=inter)


#: What each calibration point must hold (scripts/eval/advisor_points.py and derive() read them).
CALIBRATION_KEYS = ("label", "model", "tp", "gpu_mem_mib", "mem_fraction_static", "max_total_num_tokens", "free_after_graphs_gib")
#: The calibration's records of post-capture sizing (with the request cap: no eager-decode headroom)
#: measured safe (``post_capture_served``) and out of memory (``post_capture_oom``) under E2's
#: workload, and of starts cut off in prefill-graph capture (``prefill_graph_partial``): their keys
#: and types. A calibration file without a section takes the packaged file's.
RECORD_KEYS = {
    "post_capture_served": {"tp": int, "chunked_prefill_size": int, "source": str},
    "post_capture_oom": {"tp": int, "chunked_prefill_size": int, "free_after_sizing_gib": (int, float), "what": str, "source": str},
    "prefill_graph_partial": {"label": str, "what": str, "source": str},
}


def load_calibration(path: Optional[Path] = None) -> Dict[str, Any]:
    """The measured points and records (``calibration.json``, or ``path``).

    Raises:
        AdviseError: the file cannot be read, or a point or record lacks a
            key or has one of the wrong type.
    """
    if path is None:
        text = resources.files("sglang_elastic.eval").joinpath("calibration.json").read_text()
        source = "sglang_elastic/eval/calibration.json"
    else:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise AdviseError(f"--calibration {path}: {e.strerror}") from None
        source = str(path)
    try:
        cal = json.loads(text)
        points = cal["points"]
        assert isinstance(points, list) and points, "no list of points"
        for i, pt in enumerate(points):
            missing = [k for k in CALIBRATION_KEYS if not isinstance(pt, dict) or k not in pt]
            assert not missing, f"point {i} lacks {', '.join(missing)}"
        for section, keys in RECORD_KEYS.items():
            if section not in cal and path is not None:  # the packaged records (measured failures among them) still hold
                cal[section] = load_calibration()[section]
            recs = cal.get(section, [])
            assert isinstance(recs, list), f"{section} is not a list"
            for i, rec in enumerate(recs):
                bad = [k for k, t in keys.items() if not isinstance(rec, dict) or not isinstance(rec.get(k), t) or isinstance(rec.get(k), bool)]
                assert not bad, f"{section}[{i}]: {', '.join(bad)} missing or of the wrong type"
    except json.JSONDecodeError as e:
        raise AdviseError(f"{source}: not a calibration file (not valid JSON: {e.msg} at line {e.lineno})") from None
    except KeyError as e:
        raise AdviseError(f"{source}: not a calibration file (no {e.args[0]!r} key; sglang_elastic/eval/calibration.json shows the form)") from None
    except TypeError:
        raise AdviseError(f"{source}: not a calibration file (a JSON object with a 'points' list is expected; "
                          "sglang_elastic/eval/calibration.json shows the form)") from None
    except AssertionError as e:
        raise AdviseError(f"{source}: not a calibration file ({e})") from None
    cal["source"] = source
    return cal


def derive(point: Dict[str, Any]) -> Dict[str, float]:
    """Factors of one measured point (see the module doc)."""
    m = model_facts(point["model"])
    sa = sizing.server_sizing(m.path, point["gpu_mem_mib"], point["tp"], point.get("chunked_prefill_size"))
    shape = shape_of(m)
    mfs = point["mem_fraction_static"]
    kv_gib = point["max_total_num_tokens"] * shape.cell_bytes(point["tp"]) / GIB
    weights_gib = shape.weight_bytes(point["tp"]) / GIB
    pre_free = (kv_gib + weights_gib) / mfs
    reserve = pre_free * (1 - mfs)
    return {
        "tp": point["tp"],
        "sglang_mem_fraction_static": sa.mem_fraction_static,
        "pre_model_load_free_gib": pre_free,
        "context_overhead_gib": point["gpu_mem_mib"] / 1024 - pre_free,
        "reserve_gib": reserve,
        "graph_gib": reserve - point["free_after_graphs_gib"],
        "req_to_token_gib": sizing.req_to_token_bytes(point["max_total_num_tokens"], shape.context_len) / GIB,
        "chunk": sa.chunked_prefill_size,
        "layer_tokens": shape.num_layers * sa.chunked_prefill_size,
        "mlp_width": shape.mlp_width,
    }


def factors(cal: Dict[str, Any], tp: Optional[int] = None) -> Dict[str, Any]:
    """The context overhead and the graph memory's fixed part (both per TP
    degree: the mean over that degree's points) and its prefill-graph part
    (one slope, bytes per layer and chunk token: least squares of
    ``graph_gib - req_to_token_gib`` on ``layers * chunk`` within each TP
    degree; no spread: 0). With ``tp``, the factors for that degree: a
    degree without points takes the largest measured one below it (else the
    smallest above), named in ``extrapolated_from_tp``.

    Raises:
        AdviseError: the calibration has no points.
    """
    if not cal.get("points"):
        raise AdviseError("the calibration has no measured points")
    ds = [derive(p) for p in cal["points"]]
    by_tp: Dict[int, list] = {}
    for d in ds:
        by_tp.setdefault(d["tp"], []).append(d)
    sxy = sxx = 0.0

    def y(d):  # what the fit explains: the graphs and workspaces, the req_to_token table (computed) taken off
        return d["graph_gib"] - d["req_to_token_gib"]

    for group in by_tp.values():  # pooled within-TP regression: TP shifts the intercept, not the slope
        mx = sum(d["layer_tokens"] for d in group) / len(group)
        my = sum(y(d) for d in group) / len(group)
        sxx += sum((d["layer_tokens"] - mx) ** 2 for d in group)
        sxy += sum((d["layer_tokens"] - mx) * (y(d) - my) for d in group)
    slope = sxy / sxx if sxx > 0 else 0.0
    per_tp = {t: {"context_overhead_gib": sum(d["context_overhead_gib"] for d in g) / len(g),
                  "graph_fixed_gib": sum(y(d) - slope * d["layer_tokens"] for d in g) / len(g), "points": len(g)} for t, g in sorted(by_tp.items())}
    # the widest MLP among points above SGLang's default chunk: the slope's reach (module doc)
    sweep = [d["mlp_width"] for d in ds if d["chunk"] > DEFAULT_CHUNK]
    out: Dict[str, Any] = {"graph_bytes_per_layer_token": slope * GIB, "per_tp": per_tp, "large_chunk_max_mlp_width": max(sweep) if sweep else None}
    if tp is not None:
        below = [t for t in per_tp if t <= tp]
        used = max(below) if below else min(per_tp)
        out.update(context_overhead_gib=per_tp[used]["context_overhead_gib"], graph_fixed_gib=per_tp[used]["graph_fixed_gib"],
                   extrapolated_from_tp=None if used == tp else used)
    return out


def _kv_tokens(pre_free_gib: float, weights_gib: float, mfs: float, cell: int):
    reserve = pre_free_gib * (1 - mfs)
    kv = pre_free_gib - weights_gib - reserve
    return reserve, kv, max(0, int(kv * GIB // cell))


def tp_split_error(m, tp: int) -> Optional[str]:
    """Why SGLang 0.5.17 refuses to split model ``m`` (:func:`model_facts`) over ``tp`` GPUs, in one line, or None.
    QKVParallelLinear splits the query heads evenly and the KV heads evenly, or replicates them when they are fewer
    than the ranks; MergedColumnParallelLinear divides the MLP width by the ranks."""
    if m.num_attention_heads % tp:
        return f"--tp {tp}: the model's {m.num_attention_heads} attention heads do not split evenly over {tp} GPUs (SGLang refuses it)"
    kvh = m.num_key_value_heads
    if (kvh >= tp and kvh % tp) or (kvh < tp and tp % kvh):
        return f"--tp {tp}: the model's {kvh} KV heads neither split evenly over {tp} GPUs nor replicate onto them (SGLang refuses it)"
    if m.intermediate_size % tp:
        return f"--tp {tp}: the model's MLP width {m.intermediate_size} does not split evenly over {tp} GPUs (SGLang refuses it)"
    return None


def predict(model: str, gpu_mem_gib: float, tp: int, chunked_prefill_size: Optional[int] = None, margin_mib: float = DEFAULT_MARGIN_MIB,
            calibration: Optional[Dict[str, Any]] = None, max_running_requests: Optional[int] = None) -> Dict[str, Any]:
    """Reserve, lendable bytes, extra KV tokens, SGLang's post-capture
    sizing and a recommendation.

    Args:
        model: a model directory / ``config.json`` or an embedded name.
        gpu_mem_gib: one GPU's memory, GiB.
        tp: tensor-parallel degree (1, 2, 4, 8).
        chunked_prefill_size: tokens (default: SGLang's choice for the GPU).
        margin_mib: ``--elastic-kv-margin-mb``, MiB.
        calibration: measured points (default: the packaged file).
        max_running_requests: the server's ``--max-running-requests``
            (default: unset, SGLang sizes it from the pool, far above the
            decode graphs' batch); it sets the ``req_to_token`` table's rows
            (:func:`req_to_token_bytes`) and whether post-capture sizing
            keeps SGLang's eager-decode headroom.

    Raises:
        AdviseError: a bad argument, an unknown model layout, or a reserve
            larger than the GPU.
    """
    if not math.isfinite(gpu_mem_gib) or gpu_mem_gib <= 0:
        raise AdviseError(f"--gpu-mem-gb must be a positive number, not {gpu_mem_gib}")
    if gpu_mem_gib > MAX_GPU_MEM_GIB:  # a typo (MiB for GiB) more likely than such a GPU; the fit is extrapolated far past the H200 anyway
        raise AdviseError(f"--gpu-mem-gb {gpu_mem_gib:g}: more than {MAX_GPU_MEM_GIB} GiB for one GPU; give one GPU's memory in GiB (an H200: 140.4)")
    if not math.isfinite(margin_mib) or margin_mib < 0:
        raise AdviseError(f"--margin-mb must be >= 0, not {margin_mib}")
    if margin_mib > DEFAULT_MARGIN_MIB and margin_mib >= gpu_mem_gib * 1024:  # (a GPU too small for the default: the reserve's message)
        raise AdviseError(f"--margin-mb {margin_mib:g}: at least the GPU's whole memory ({gpu_mem_gib:g} GiB)")
    if tp not in (1, 2, 4, 8):
        raise AdviseError(f"--tp must be 1, 2, 4 or 8, not {tp}")
    if chunked_prefill_size is not None and chunked_prefill_size < 1:
        raise AdviseError(f"--chunked-prefill-size must be positive, not {chunked_prefill_size}")
    if max_running_requests is not None and max_running_requests < 1:
        raise AdviseError(f"--max-running-requests must be positive, not {max_running_requests}")
    m = model_facts(model)
    why = tp_split_error(m, tp)
    if why:
        raise AdviseError(why)
    cal = calibration or load_calibration()
    f = factors(cal, tp)
    gpu_mem_mib = gpu_mem_gib * 1024
    sa = sizing.server_sizing(m.path, gpu_mem_mib, tp, chunked_prefill_size)
    shape = shape_of(m)
    cell = shape.cell_bytes(tp)
    pre_free = gpu_mem_gib - f["context_overhead_gib"]
    weights = shape.weight_bytes(tp) / GIB
    reserve, kv, tokens = _kv_tokens(pre_free, weights, sa.mem_fraction_static, cell)
    if sa.mem_fraction_static <= 0:
        raise AdviseError(
            f"SGLang would keep back {gpu_mem_mib * (1 - sa.mem_fraction_static):,.0f} MiB for activations at --chunked-prefill-size "
            f"{sa.chunked_prefill_size}, more than the {gpu_mem_gib:g} GiB GPU: "
            + ("use a smaller chunk or a larger GPU" if sa.chunked_prefill_size > SMALL_CHUNK else
               f"SGLang counts at least {SMALL_CHUNK} tokens of activations whatever the chunk; use a larger GPU"))
    prefill_graphs = f["graph_bytes_per_layer_token"] * shape.num_layers * sa.chunked_prefill_size / GIB
    req_to_token = sizing.req_to_token_bytes(tokens, shape.context_len, max_running_requests) / GIB
    graph = f["graph_fixed_gib"] + prefill_graphs + req_to_token
    free_after = max(0.0, reserve - graph)
    lendable = max(0.0, free_after - margin_mib / 1024) if tokens > 0 else 0.0
    # the pool lends whole steps of pages mapped at VMM granularity (sglang_elastic/vmm/arena.py token_quantum)
    step = token_quantum(shape.row_bytes(tp), VMM_GRANULARITY)
    extra = int(lendable * GIB // cell) // step * step
    small = sizing.server_sizing(m.path, gpu_mem_mib, tp, SMALL_CHUNK)
    _, _, small_tokens = _kv_tokens(pre_free, weights, small.mem_fraction_static, cell)
    chunk_gain = small_tokens - tokens if sa.chunked_prefill_size > SMALL_CHUNK else 0
    graph_bs = sa.decode_max_bs
    within = max_running_requests is not None and max_running_requests <= graph_bs  # no eager decodes
    graphs = f["graph_fixed_gib"] + prefill_graphs  # post-capture sizing's req_to_token table follows its own pool
    pc, pc_mfs, pc_free, pc_cap = _post_capture(m, gpu_mem_mib, tp, sa.chunked_prefill_size, pre_free, weights, graphs, shape, max_running_requests)
    # issue 22, build 3: the pool lends what post-capture sizing leaves free (less the margin) while the decode batch
    # fits the graphs, within the address space SGLang reserved before capture; nothing on a pool of no tokens
    pc_lend = 0
    if pc:
        pc_lend = min(int(max(0.0, pc_free - margin_mib / 1024) * GIB // cell), pc_cap - pc) // step * step
    # the request cap does not decide whether SGLang post-capture-sizes: unavailable is unavailable capped too
    pc_capped = pc if within or pc is None else post_capture_tokens(m, gpu_mem_mib, tp, sa.chunked_prefill_size, pre_free, weights, graphs, shape, graph_bs)[0]
    risk = None if pc_capped is None else post_capture_oom_risk(cal, tp, sa.chunked_prefill_size)
    out = {
        "model": str(model),
        "gpu_mem_gib": gpu_mem_gib,
        "tp": tp,
        "chunked_prefill_size": sa.chunked_prefill_size,
        "mem_fraction_static": sa.mem_fraction_static,
        "sglang_reserved_mib": round(gpu_mem_mib * (1 - sa.mem_fraction_static)),
        "reserve_gib": reserve,
        "reserve_fraction_of_hbm": reserve / gpu_mem_gib,
        "weights_gib_per_gpu": weights,
        "kv_pool_gib": kv,
        "reserve_fraction_of_kv_pool": reserve / kv if kv > 0 else None,
        "kv_cell_bytes": cell,
        "max_total_num_tokens": tokens,
        "req_to_token_gib": req_to_token,
        "prefill_graphs_gib": prefill_graphs,
        "free_after_graphs_gib": free_after,
        "lendable_gib": lendable,
        "extra_kv_tokens": extra,
        "lend_step_tokens": step,
        "extra_kv_fraction": extra / tokens if tokens else None,
        "small_chunk": SMALL_CHUNK,
        "small_chunk_mem_fraction_static": small.mem_fraction_static,
        "small_chunk_extra_kv_tokens": chunk_gain,
        "max_running_requests": max_running_requests,
        "decode_graph_max_bs": graph_bs,
        "within_decode_graphs": within,
        "post_capture_mem_fraction_static": pc_mfs,
        "post_capture_kv_tokens": pc,
        "post_capture_extra_kv_tokens": None if pc is None else pc - tokens,
        "post_capture_free_gib": pc_free,
        "post_capture_elastic_extra_kv_tokens": None if pc is None else pc_lend,
        "post_capture_capped_kv_tokens": pc_capped,
        "post_capture_unavailable_reason": None if pc is not None else post_capture_unavailable_reason(m, gpu_mem_mib, tp, sa.chunked_prefill_size),
        # with the request cap at most the graphs' batch, SGLang keeps no eager-decode headroom: what was measured to run out of memory
        "post_capture_oom_risk": risk,
        "post_capture_untested": None if pc_capped is None or risk else post_capture_untested(cal, tp, sa.chunked_prefill_size),
        "caveats": caveats(cal, gpu_mem_gib, tp, graph_bs, f) + chunk_caveats(cal, f, shape, sa.chunked_prefill_size)
                   + ([f"config.json lacks {', '.join(m.defaulted)}: transformers' {m.model_type} defaults stand in, as SGLang would take them"
                       + (f" ({m.num_key_value_heads} KV heads of {m.num_attention_heads} attention heads)" if "num_key_value_heads" in m.defaulted else "")]
                      if m.defaulted else []),
        "factors": f,
        "calibration": cal["source"],
        "calibration_points": len(cal["points"]),
    }
    for what in (out["post_capture_oom_risk"], out["post_capture_untested"]):
        if what:
            out["caveats"].append(f"post-capture sizing with --max-running-requests at most {graph_bs}: {what}")
    out["recommendation"], out["reason"] = recommend(out)
    return out


def post_capture_tokens(m: ModelFacts, gpu_mem_mib: float, tp: int, chunk: int, pre_free: float, weights: float, graphs: float, shape: Shape,
                        max_running_requests: Optional[int]) -> "tuple[Optional[int], Optional[float]]":
    """KV tokens and ``mem_fraction_static`` under SGLang's post-capture
    sizing (module doc), or (None, None) where SGLang would not
    post-capture-size this setup. ``graphs`` (GiB): the CUDA graphs and
    workspaces without the ``req_to_token`` table, which is sized here for
    the pool SGLang allocates before capture (the capped one) and stays
    when the pool grows after it."""
    tokens, mfs, _, _ = _post_capture(m, gpu_mem_mib, tp, chunk, pre_free, weights, graphs, shape, max_running_requests)
    return tokens, mfs


def _post_capture(m: ModelFacts, gpu_mem_mib: float, tp: int, chunk: int, pre_free: float, weights: float, graphs: float, shape: Shape,
                  max_running_requests: Optional[int]) -> "tuple[Optional[int], Optional[float], Optional[float], Optional[int]]":
    """:func:`post_capture_tokens`, the GiB SGLang leaves free after it (its activation headroom: what the elastic
    pool lends on top, less its margin) and the tokens of the pool SGLang reserves before capture (the bound of the
    pool's address space, so of base and lend together)."""
    sa = sizing.server_sizing(m.path, gpu_mem_mib, tp, chunk, post_capture=True, max_running_requests=max_running_requests)
    if not sa.post_capture_planned:
        return None, None, None, None
    cell = shape.cell_bytes(tp)
    _, _, cap = _kv_tokens(pre_free, weights, sa.mem_fraction_static, cell)
    graph = graphs + sizing.req_to_token_bytes(cap, shape.context_len, max_running_requests) / GIB
    headroom = pre_free * (1 - sa.mem_fraction_static)
    if max_running_requests is None or max_running_requests > sa.decode_max_bs:  # eager decodes: SGLang keeps its reserve
        headroom = max(headroom, sa.pre_capture_activation_reserve_mb(gpu_mem_mib) / 1024)
    return max(0, min(int((pre_free - weights - graph - headroom) * GIB // cell), cap)), sa.mem_fraction_static, headroom, cap


def post_capture_oom_risk(cal: Dict[str, Any], tp: int, chunk: int) -> Optional[str]:
    """Why SGLang's post-capture sizing with the request cap (no eager-decode
    headroom) is not safe here, or None: a measured out-of-memory failure
    (the calibration's ``post_capture_oom``) at this TP degree and chunk or
    smaller ones. Capped, post-capture sizing leaves SGLang only
    ``pre_model_load_free * (1 - mem_fraction_static)`` (about 0.5-0.7 GiB
    on the H200) for what prefill allocates outside its CUDA graphs,
    whatever the chunk; TP > 1 adds its communication buffers to that.
    Without the cap SGLang keeps its whole activation reserve, which this
    does not concern."""
    for o in cal.get("post_capture_oom") or []:
        if tp >= o["tp"] and chunk >= o["chunked_prefill_size"]:
            return (f"SGLang's post-capture sizing ran out of memory at TP {o['tp']} and --chunked-prefill-size {o['chunked_prefill_size']:,} "
                    f"({o['free_after_sizing_gib']:.2f} GiB free per GPU after sizing; {o['what']}; {o['source']})")
    return None


def post_capture_untested(cal: Dict[str, Any], tp: int, chunk: int) -> Optional[str]:
    """Why capped post-capture sizing is untested here, or None: no
    ``post_capture_served`` record at this TP degree with this chunk or a
    larger one (the advisor then names it but does not recommend it)."""
    served = [o for o in cal.get("post_capture_served") or [] if o["tp"] == tp]
    if any(o["chunked_prefill_size"] >= chunk for o in served):
        return None
    if served:
        what = f"capped post-capture sizing was measured to serve at TP {tp} up to --chunked-prefill-size {max(o['chunked_prefill_size'] for o in served):,} only"
    else:
        tps = sorted({o["tp"] for o in cal.get("post_capture_served") or []})
        what = (f"capped post-capture sizing was never measured at TP {tp}"
                + (f" (only at TP {' and '.join(str(t) for t in tps)})" if tps else ""))
    return (f"{what}; it leaves about 0.5-0.7 GiB per GPU for prefill work "
            f"outside the CUDA graphs, and at TP 2 with a 32,768-token chunk that ran out of memory")


def post_capture_unavailable_reason(m: ModelFacts, gpu_mem_mib: float, tp: int, chunk: int) -> str:
    """Why SGLang would not post-capture-size this setup (``ServerArgs.post_capture_kv_sizing_planned``)."""
    sa = sizing.server_sizing(m.path, gpu_mem_mib, tp, chunk, post_capture=True)
    largest = max(sa.prefill_bs or (0,))
    if sa.max_prefill_buffer_tokens() > largest:
        fits = [c for c in (2048, 4096, 8192, 12288, 16384, 32768) if c <= largest]
        return (f"SGLang post-capture-sizes only when the prefill CUDA graphs hold the largest prefill batch: "
                f"{sa.max_prefill_buffer_tokens():,} tokens at --chunked-prefill-size {chunk:,} against graphs up to {largest:,}"
                + (f" (--chunked-prefill-size {max(fits):,} fits)" if fits else ""))
    return "SGLang's post_capture_kv_sizing_planned() says no for this setup"


def caveats(cal: Dict[str, Any], gpu_mem_gib: float, tp: int, graph_bs: int, f: Dict[str, Any]) -> "list[str]":
    """Where the prediction leaves the measured points (their GPU size, their
    decode-graph batch), in words."""
    out = []
    mems = sorted({p["gpu_mem_mib"] / 1024 for p in cal["points"]})
    if mems and not (0.9 * mems[0] <= gpu_mem_gib <= 1.1 * mems[-1]):
        out.append(f"measured on {mems[0]:.1f}{'' if len(mems) == 1 else f'-{mems[-1]:.1f}'} GiB GPUs only: on {gpu_mem_gib:g} GiB SGLang captures other CUDA graphs "
                   f"(decode up to {graph_bs}), and their memory is taken as measured there, so the free memory, the lendable bytes and the "
                   f"post-capture tokens are rough (checked, not fitted, on an 80 GB H100: within 0.5 %; docs/eval.md's advisor table)")
    measured_bs = {p.get("decode_graph_max_bs", 256) for p in cal["points"]}
    if f.get("extrapolated_from_tp"):
        more = graph_bs > max(measured_bs)
        out.append(f"no measured point at TP {tp}: TP {f['extrapolated_from_tp']}'s context and graph memory"
                   + (f"; SGLang captures decode graphs up to batch {graph_bs} here ({max(measured_bs)} where measured), which take more memory "
                      f"than counted, so the free memory and the lendable bytes are overstated; gains within a few % of each other do not decide" if more else ""))
    return out


def chunk_caveats(cal: Dict[str, Any], f: Dict[str, Any], shape: Shape, chunk: int) -> "list[str]":
    """Above SGLang's default chunk the prefill-graph slope rests on the
    measured models' MLP widths; a wider MLP's largest graph holds more
    (the calibration's ``prefill_graph_partial`` records say how much), so
    the free memory is overstated there."""
    widest = f.get("large_chunk_max_mlp_width")
    if chunk <= DEFAULT_CHUNK or (widest is not None and shape.mlp_width <= widest):
        return []
    seen = "; ".join(f"{o['label']}: {o['what']} ({o['source']})" for o in cal.get("prefill_graph_partial") or [])
    measured = (f"was measured on MLPs up to {widest:,} wide, this one is {shape.mlp_width:,}: a wider MLP's graphs take more than the per-layer slope counts"
                if widest is not None else "was not measured (no calibration point above it): the per-layer slope is extrapolated")
    return [f"the prefill graphs' memory above chunk {DEFAULT_CHUNK:,} {measured}, so the free memory, the lendable bytes and the post-capture "
            f"tokens are overstated" + (f" ({seen})" if seen else "")]


def recommend(p: Dict[str, Any]) -> "tuple[str, str]":
    """``post-capture sizing`` / ``elastic`` / ``smaller chunk`` / ``neither``,
    with the reason in numbers."""
    tokens = p["max_total_num_tokens"]
    if tokens <= 0:
        none = (f"the weights ({p['weights_gib_per_gpu']:.1f} GiB per GPU) and SGLang's reserve ({p['reserve_gib']:.1f} GiB) "
                f"leave no KV pool on a {p['gpu_mem_gib']:g} GiB GPU at TP {p['tp']} and --chunked-prefill-size {p['chunked_prefill_size']}")
        chunk = f"--chunked-prefill-size {p['small_chunk']} gives {p['small_chunk_extra_kv_tokens']:,} KV tokens"
        if p["small_chunk_extra_kv_tokens"] >= MIN_POOL_TOKENS:
            return "smaller chunk", f"{none}; {chunk}"
        unsafe = p.get("post_capture_oom_risk") or p.get("post_capture_untested")  # of sizing without eager headroom
        bs = p["decode_graph_max_bs"]
        pc = [(n, m) for n, m in ((p["post_capture_kv_tokens"], p["max_running_requests"]), (p["post_capture_capped_kv_tokens"], bs)) if n]
        post = ("SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1" + (f" with --max-running-requests {pc[0][1]}" if pc[0][1] else "") + f" gives {pc[0][0]:,} KV tokens") if pc else ""
        if pc and pc[0][0] >= MIN_POOL_TOKENS and not (unsafe and pc[0][1] is not None and pc[0][1] <= bs):
            return "post-capture sizing", f"{none}; {post}"
        small = "; ".join(x for x in (chunk if p["small_chunk_extra_kv_tokens"] > 0 else "", post) if x)
        return "neither", f"{none}: raise the TP degree or use a larger GPU" + (f" ({small}: fewer than {MIN_POOL_TOKENS:,})" if small else "")
    eg = p["extra_kv_tokens"] / tokens
    cg = p["small_chunk_extra_kv_tokens"] / tokens
    pg = (p["post_capture_extra_kv_tokens"] or 0) / tokens
    bs, mrr, within = p["decode_graph_max_bs"], p["max_running_requests"], p["within_decode_graphs"]
    risk, untested = p.get("post_capture_oom_risk"), p.get("post_capture_untested")  # both of sizing without eager headroom
    if within and pg >= MIN_GAIN and pg >= eg and pg >= cg and not risk and not untested:
        return "post-capture sizing", (
            f"SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1 with --max-running-requests {mrr} sizes the pool after CUDA-graph capture: "
            f"+{p['post_capture_extra_kv_tokens']:,} KV tokens ({pg:.0%} of {tokens:,}) for good, with nothing to reclaim; lending would add "
            f"{p['extra_kv_tokens']:,} ({eg:.0%}) while only decodes of at most {bs} requests run, a {p['small_chunk']}-token chunk {p['small_chunk_extra_kv_tokens']:,} ({cg:.0%})"
        )
    # post-capture sizing as an alternative worth naming: as asked, or capped at the graphs' batch
    alt = ""
    capped = p["post_capture_capped_kv_tokens"]
    cap_gain = (pg if within else (capped - tokens) / tokens) if capped is not None else 0.0
    flags = f"SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1 with --max-running-requests {mrr if within else bs}"
    if risk and cap_gain >= MIN_GAIN:
        alt = f"; not {flags}, although it would add {int(cap_gain * tokens):,} ({cap_gain:.0%}): it ran out of memory in this setup (caveat)"
    elif untested and cap_gain >= MIN_GAIN:
        alt = f"; {flags} would add {int(cap_gain * tokens):,} ({cap_gain:.0%}) for good, but it is untested here and may run out of memory (caveat)"
    elif within and pg >= MIN_GAIN:
        alt = f"; SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1 would add {p['post_capture_extra_kv_tokens']:,} ({pg:.0%}) for good"
    elif not within and not risk and capped is not None and (capped - tokens) / tokens >= MIN_GAIN:
        alt = (f"; if at most {bs} requests need to run at once, SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1 with --max-running-requests {bs} "
               f"adds {capped - tokens:,} ({(capped - tokens) / tokens:.0%}) for good (without that cap it keeps SGLang's whole reserve for eager decodes)")
    if eg >= MIN_GAIN and eg >= cg:
        return "elastic", (
            f"lending {p['lendable_gib']:.1f} GiB of the {p['reserve_gib']:.1f} GiB reserve adds {p['extra_kv_tokens']:,} KV tokens "
            f"({eg:.0%} of {tokens:,}) while only decodes of at most {bs} requests run; --chunked-prefill-size {p['small_chunk']} would add {p['small_chunk_extra_kv_tokens']:,} ({cg:.0%}) for good"
            + alt
        )
    if cg >= MIN_GAIN:
        return "smaller chunk", (
            f"--chunked-prefill-size {p['small_chunk']} adds {p['small_chunk_extra_kv_tokens']:,} KV tokens ({cg:.0%}) permanently "
            f"(mem_fraction_static {p['mem_fraction_static']} -> {p['small_chunk_mem_fraction_static']}), more than lending ({p['extra_kv_tokens']:,}, {eg:.0%})"
            + alt
        )
    post = f", post-capture sizing {pg:.1%}" if pg > 0 else ""
    return "neither", f"lending adds {eg:.1%} and a {p['small_chunk']}-token chunk {cg:.1%}{post} to a pool of {tokens:,} tokens, all under {MIN_GAIN:.0%}" + alt


def format_text(p: Dict[str, Any]) -> str:
    lines = [
        f"model {p['model']}, {p['gpu_mem_gib']:g} GiB per GPU, TP {p['tp']}, chunked_prefill_size {p['chunked_prefill_size']}",
        f"  SGLang: mem_fraction_static {p['mem_fraction_static']} (reserved {p['sglang_reserved_mib']:,} MiB of the GPU)",
        f"  reserve (kept out of the KV pool): {p['reserve_gib']:.2f} GiB = {p['reserve_fraction_of_hbm']:.1%} of HBM"
        + (f", {p['reserve_fraction_of_kv_pool']:.1%} of the KV pool" if p["reserve_fraction_of_kv_pool"] else ""),
        (f"  KV pool: {p['kv_pool_gib']:.2f} GiB = {p['max_total_num_tokens']:,} tokens ({p['kv_cell_bytes']:,} B/token/GPU)" if p["kv_pool_gib"] >= 0 else
         f"  KV pool: none: the weights and SGLang's reserve take {-p['kv_pool_gib']:.2f} GiB more than SGLang finds free on the GPU before "
         f"loading them ({p['kv_cell_bytes']:,} B/token/GPU)"),
        f"  free after CUDA graphs (reserve - {p['factors']['graph_fixed_gib']:.2f} GiB fixed - {p['req_to_token_gib']:.2f} GiB req_to_token - "
        f"{p['prefill_graphs_gib']:.2f} GiB prefill graphs at {p['factors']['graph_bytes_per_layer_token'] / 1024:.1f} KiB per layer and chunk token): "
        f"{p['free_after_graphs_gib']:.2f} GiB; lendable: {p['lendable_gib']:.2f} GiB = +{p['extra_kv_tokens']:,} KV tokens",
        f"  chunked_prefill_size {p['small_chunk']}: mem_fraction_static {p['small_chunk_mem_fraction_static']}, +{p['small_chunk_extra_kv_tokens']:,} KV tokens",
        "  SGLang's post-capture KV sizing (SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1): "
        + (f"not available: {p['post_capture_unavailable_reason']}" if p["post_capture_kv_tokens"] is None else
           f"{p['post_capture_kv_tokens']:,} KV tokens with --max-running-requests {p['max_running_requests'] or 'unset'}"
           + ("" if p["within_decode_graphs"] or p["post_capture_capped_kv_tokens"] is None else
              f", {p['post_capture_capped_kv_tokens']:,} with {p['decode_graph_max_bs']} (the decode CUDA graphs' batch)")
           + ("; with the cap not safe here (caveat)" if p.get("post_capture_oom_risk") else
              "; with the cap untested here (caveat)" if p.get("post_capture_untested") else "")
           + (f"; lending on top of it (--enable-elastic-kv): +{p['post_capture_elastic_extra_kv_tokens']:,} while the decode batch fits the "
              f"decode CUDA graphs (at most {p['decode_graph_max_bs']} requests; {p['post_capture_kv_tokens'] + p['post_capture_elastic_extra_kv_tokens']:,} in all)"
              if p.get("post_capture_elastic_extra_kv_tokens") else "")),
        f"recommendation: {p['recommendation']}: {p['reason']}",
        f"(calibration: {p['calibration']}, {p['calibration_points']} measured point(s))",
    ] + [f"caveat: {c}" for c in p["caveats"]]
    return "\n".join(lines)


#: ``--max-running-requests`` the offload pool assumes when unset (``sglang_elastic.offload.hooks.DEFAULT_REQUESTS``:
#: every running request holds hot buffers, so the pool is sized for a cap).
OFFLOAD_DEFAULT_REQUESTS = 64


def predict_offload(p: Dict[str, Any], host_mem_gib: float, request_tokens: Optional[int] = None, max_running_requests: Optional[int] = None,
                    keep_v: bool = True, radix_cache: bool = True) -> Dict[str, Any]:
    """What ``--enable-kv-offload`` would hold on the GPU :func:`predict` described (``p``): the offload pool's tokens
    and bound, from the same KV budget stock SGLang gives its pool, by the pool's own sizing
    (:func:`sglang_elastic.offload.sizing.size_pool`, the function the server calls), with the shipped defaults.

    Args:
        p: :func:`predict`'s result (its ``kv_pool_gib`` is SGLang's KV budget on one GPU).
        host_mem_gib: host RAM free per GPU, GiB (the host pool keeps 10 GiB of it free, as SGLang's host pools do).
        request_tokens: tokens per request of the workload (prompt + output): how many run at once (default 32,768,
            or the model's context length if shorter).
        max_running_requests: the server's cap (default: the offload pool's 64; every request holds hot buffers).
        keep_v, radix_cache: ``--kv-offload-keep-v`` (the default) and SGLang's radix cache (on by default): each
            adds a few bytes per token.

    Returns:
        ``tokens``, ``bound`` (``hbm`` or ``host``), ``tokens_hbm``, ``tokens_host``, ``stock_tokens`` (the same budget as
        SGLang's pool), ``ratio``, ``hot_and_staging_gib``, ``host_pool_gib``, ``requests`` (the cap), ``request_tokens``,
        ``stock_requests_at_once`` / ``offload_requests_at_once`` (each pool's tokens over ``request_tokens``, within
        ``max_running_requests`` where given); or ``error`` (the server's one-line start-up refusal) when the pool cannot
        hold one request of the model's context length.

    Raises:
        AdviseError: a bad argument, or ``request_tokens`` above the model's context length.
    """
    from sglang_elastic.config import OffloadConfig
    from sglang_elastic.offload.sizing import ModelShape, SizingError, size_pool

    if not math.isfinite(host_mem_gib) or host_mem_gib <= 0:
        raise AdviseError(f"--host-mem-gb must be a positive number (free host RAM per GPU, GiB), not {host_mem_gib}")
    if request_tokens is not None and request_tokens < 1:
        raise AdviseError(f"--request-tokens must be positive, not {request_tokens}")
    if max_running_requests is not None and max_running_requests < 1:
        raise AdviseError(f"--max-running-requests must be positive, not {max_running_requests}")
    tp = p["tp"]
    m = model_facts(p["model"])
    if request_tokens is None:
        request_tokens = min(32768, m.context_len)
    elif request_tokens > m.context_len:
        raise AdviseError(f"--request-tokens {request_tokens}: more than the model's context length, {m.context_len} (SGLang refuses such a request)")
    shape = ModelShape(layers=m.num_hidden_layers, kv_heads=max(1, m.num_key_value_heads // tp), head_dim=m.head_dim, v_head_dim=m.v_head_dim,
                       q_heads=m.num_attention_heads // tp, elem=2, context_len=m.context_len)
    cfg = OffloadConfig(enabled=True)
    requests = max_running_requests or OFFLOAD_DEFAULT_REQUESTS
    keep_v = keep_v and shape.head_dim == shape.v_head_dim  # the server's default: no keep-v where a V row cannot take a K slot
    out: Dict[str, Any] = {"requests": requests, "request_tokens": request_tokens, "host_mem_gib": host_mem_gib, "keep_v": keep_v}
    if p["kv_pool_gib"] <= 0:
        return {**out, "error": "no KV budget on this GPU (above): nothing to offload from"}
    try:
        sz = size_pool(int(p["kv_pool_gib"] * GIB), shape, cfg.policy(), cfg.hot_tokens, requests, int(host_mem_gib * GIB),
                       slack=cfg.hot_slack, keep_v=keep_v, hint_by_row=radix_cache)
    except SizingError as e:
        return {**out, "error": str(e)}
    stock_at_once = sz.stock_tokens // request_tokens  # SGLang's own cap, when unset, is far above what its pool holds
    return {**out, "tokens": sz.tokens, "bound": sz.bound, "tokens_hbm": sz.tokens_hbm, "tokens_host": sz.tokens_host,
            "stock_tokens": sz.stock_tokens, "ratio": sz.tokens / max(sz.stock_tokens, 1),
            "hot_and_staging_gib": sz.device_fixed_bytes / GIB, "host_pool_gib": sz.host_bytes / GIB,
            "stock_requests_at_once": stock_at_once if max_running_requests is None else min(stock_at_once, max_running_requests),
            "offload_requests_at_once": min(requests, sz.tokens // request_tokens)}


def format_offload_text(o: Dict[str, Any]) -> str:
    head = (f"KV offload (--enable-kv-offload: K of every token in HBM, the sparse layers' V in pinned host memory; "
            f"{o['requests']} requests, {o['host_mem_gib']:g} GiB host RAM free per GPU):")
    if "error" in o:
        return (f"{head}\n  not possible: the server would refuse to start: {o['error']}\n"
                "  (the server's flags named there; here --host-mem-gb gives the host RAM, and the context length is the model config's)")
    other = o["tokens_host"] if o["bound"] == "hbm" else o["tokens_hbm"]
    return "\n".join([
        head,
        f"  pool: {o['tokens']:,} tokens ({o['ratio']:.2f}x the {o['stock_tokens']:,} SGLang's pool holds from the same budget), "
        f"bound: {o['bound']} (the {'host' if o['bound'] == 'hbm' else 'GPU'} would hold {other:,})",
        f"  of the budget: {o['hot_and_staging_gib']:.1f} GiB of hot buffers and prefix staging; host pool {o['host_pool_gib']:.0f} GiB pinned",
        f"  requests of {o['request_tokens']:,} tokens at once: stock {o['stock_requests_at_once']}, offload {o['offload_requests_at_once']}"
        + (f" (the cap, {o['requests']}: raise --max-running-requests)" if o["offload_requests_at_once"] == o["requests"] else ""),
        ("  a load that fits in stock's pool runs dense (keep-v): no gain, +0.5 % median ITL measured; past it, requests beyond "
         "V's room attend 5 % of their context (lossy, docs/offload.md) and copy their misses over PCIe" if o.get("keep_v") else
         "  no keep-v for this model (V's head_dim differs from K's): every request attends 5 % of its context (lossy, "
         "docs/offload.md) and copies its misses over PCIe, whether or not the load fits in stock's pool"),
    ])
