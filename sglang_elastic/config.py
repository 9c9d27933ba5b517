"""sglang-elastic's server flags: one module, one frozen config object.

The flags join SGLang's own parser (``python -m sglang.launch_server`` /
``sglang serve``): the plugin hooks ``ServerArgs.add_cli_args`` to add them and
``ServerArgs.from_cli_args`` to parse and check them (a bad value stops the
launch with one line naming the flag), then publishes the config in the
environment variable ``SGLANG_ELASTIC_CONFIG`` so SGLang's scheduler
processes, which receive ``ServerArgs`` but not our fields, read the same
values with :func:`current`.

Flags (all off by default; nothing changes unless ``--enable-elastic-kv``):

- ``--enable-elastic-kv``: build the elastic KV pool instead of SGLang's.
- ``--elastic-kv-mode {dynamic,always-lent,off}``: ``dynamic`` lends while only
  decodes run and reclaims before a prefill needs the reserve;
  ``always-lent`` lends at start and never reclaims (reproduces the Elastic KV
  paper's finding that a permanently committed reserve runs out of memory on
  a long prompt: warned at start-up); ``off`` builds the pool but never lends.
- ``--elastic-kv-lend-bytes N``: bytes to lend (suffixes K/M/G/KiB/MiB/GiB
  accepted; default: measured after CUDA-graph capture).
- ``--elastic-kv-handle-mb N``: MiB of one physical handle, i.e. of one
  per-layer K or V buffer's slice of a lend/reclaim step (default 0: the whole
  reserve in one step, one handle per buffer). The H200's driver cannot map
  one handle at offsets into several buffers, so a step takes one handle per
  buffer (64 for Llama-3.1-8B): fewer, larger steps are faster.
- ``--elastic-kv-lend-after-steps N``: decode-only steps in a row before
  lending (hysteresis, default 32).
- ``--elastic-kv-activation-rule {sglang,measured}``: what a plain eager
  prefill is taken to need while lent (default ``sglang``: SGLang's estimate,
  512 MiB + 1.5 MiB a token + 128 MiB a rank; ``measured``, experimental: bounded by what the
  server's eager prefill passes took, never more than SGLang's estimate).
- ``--elastic-kv-reclaim-wait {decode,block}``: while a reclaim's unmap
  gives its memory back on the helper thread, the prefill it is for waits
  and the decode batch runs (default ``decode``: SGLang forms no prefill in
  those passes, as its own prefill delayers do), or the scheduler blocks
  until the memory is back (``block``).
- ``--elastic-kv-margin-mb N``: memory kept free for decode-time activations
  and sampling when measuring the lendable bytes (default 1024). It also
  bounds the decode batch that may run while lent: one above the decode CUDA
  graphs' ``max_bs`` runs eagerly, so ``dynamic`` lends only while the batch
  fits the graphs or, by SGLang's own activation estimate, the margin
  (:func:`sglang_elastic.sched.controller.lend_max_batch`).

KV offload to host memory (:mod:`sglang_elastic.offload`; all need
``--enable-kv-offload``, which builds the offload pool and selects the
``kvoffload`` attention backend):

- ``--enable-kv-offload``: K of every token on the GPU, V of the sparse
  layers in pinned host memory, per-request hot buffers of V rows.
- ``--kv-offload-topk N`` (2048), ``--kv-offload-budget F`` (0.05),
  ``--kv-offload-sink N`` (4), ``--kv-offload-window N`` (32),
  ``--kv-offload-dense-layers N`` (2), ``--kv-offload-denominator
  {estimate,selected,full}`` (estimate), ``--kv-offload-chunk N`` (16, or
  the largest that fits a smaller window; positions per V summary of
  ``estimate``): the attended set
  (:class:`sglang_elastic.offload.policy.OffloadPolicy`).
- ``--kv-offload-hot-tokens N`` (4096): the most LRU V rows one request
  holds per sparse layer on the GPU; ``--kv-offload-hot-slack F`` (2.0):
  hot rows granted per selected row as a request grows (pages from one pool
  sized by the tokens the server holds, not a full buffer per request);
  ``--kv-offload-hot-slack-max F`` (0: off): a request whose selection keeps
  missing grows its hot buffer up to F rows per selected row, in pages
  nobody needs now, and gives them back when the pool runs short.
- ``--kv-offload-host-gb G``: cap on the host pool (default: free host RAM
  less a 10 GiB reserve).
- ``--kv-offload-resident-v``: keep V on the GPU too (the same selection,
  no host tier: the exactness reference; capacity as stock).
- ``--kv-offload-prefetch {off,speculative}`` (off): InfiniGen's prefetch of
  layer l+1's selected V rows while layer l runs.
- ``--kv-offload-copy-timing``: CUDA events around a sampled decode step's V
  copies and prefetch waits; the share of copy time hidden behind compute on
  ``/metrics`` (:mod:`sglang_elastic.offload.copytime`).
- ``--kv-offload-keep-v [BOOL]`` / ``--no-kv-offload-keep-v`` (on unless
  ``--kv-offload-resident-v``; ``kv-offload-keep-v: false`` in SGLang's ``--config`` YAML): dense while V fits: a request keeps its V in
  idle pool slots lent by SGLang's allocator and attends to every position,
  until the allocator runs short (then the largest such requests continue
  sparse) (:mod:`sglang_elastic.offload.keep`). Off quietly for a model whose
  V head_dim differs from K's; ``--no-kv-offload-keep-v`` runs every request
  on the sparse rule (the accuracy and exactness runs of the rule do).

Decode attention (only with SGLang's ``--decode-attention-backend persistentkv``,
the backend this package registers; :mod:`sglang_elastic.attention`):

- ``--decode-policy {auto,flashinfer,split,compact}``: ``auto`` picks per decode
  batch with the calibrated cost model; the others force one path (default auto).
- ``--decode-calibration PATH``: the policy's calibration JSON (default: the
  one for this GPU and layer shape: the calibration cache, else a shipped file
  measured on this shape, else the cost-model prior;
  :mod:`sglang_elastic.attention.calibration_cache`).
- ``--decode-calibration-cache DIR|off``: where per-shape calibrations are
  cached (default ``$SGLANG_ELASTIC_CACHE_DIR/decode``, else
  ``$XDG_CACHE_HOME/sglang_elastic/decode``); ``off``: neither read nor written.
- ``--decode-startup-calibration {auto,force,off}`` (auto): time every path at
  CUDA-graph capture when no measurement covers this shape (``force``: always;
  ``off``: never, the prior until online correction moves it).
- ``--decode-online-correction {on,off}`` (on): time a sample of the decode
  graph replays and correct the choice per batch bucket
  (:mod:`sglang_elastic.attention.online`).
"""

from __future__ import annotations

import argparse
import dataclasses
import fractions
import json
import logging
import os
import re
from typing import List, Optional, Sequence

#: JSON-lines file that receives one record per lend/reclaim of TP rank 0's
#: scheduler (:mod:`sglang_elastic.sched.controller`; read by the benchmarks
#: and the eval launcher).
EVENTS_ENV = "SGLANG_ELASTIC_EVENTS"

logger = logging.getLogger(__name__)

ENV = "SGLANG_ELASTIC_CONFIG"
MODES = ("dynamic", "always-lent", "off")
#: --elastic-kv-activation-rule: an eager prefill's need while lent (sglang_elastic.sched.controller.EagerActivations)
ACTIVATION_RULES = ("sglang", "measured")
#: --elastic-kv-reclaim-wait: what the scheduler does while a reclaim's memory comes back (sglang_elastic.sched.controller.ElasticController.defer_prefill)
RECLAIM_WAITS = ("decode", "block")
#: ElasticKVConfig fields set by an ``--elastic-kv-*`` flag (each needs ``--enable-elastic-kv``)
ELASTIC_FLAG_FIELDS = ("mode", "lend_bytes", "handle_mb", "lend_after_steps", "margin_mb", "activation_rule", "reclaim_wait")
DECODE_POLICIES = ("auto", "flashinfer", "split", "compact")
STARTUP_CALIBRATION = ("auto", "force", "off")
ONLINE = ("on", "off")
#: The SGLang attention backend name the decode flags belong to.
DECODE_BACKEND = "persistentkv"


class ConfigError(ValueError):
    """A bad flag value; the message names the flag."""


DENOMINATORS = ("selected", "full", "estimate")
CHUNKS = (8, 16, 32, 64)
PREFETCH = ("off", "speculative")
EVICTIONS = ("lru", "lfu")  # kernels/offload.py EVICTIONS (config stays torch-free)
#: sink + window must stay below this: rows every request keeps per sparse layer (as --kv-offload-hot-tokens' bound)
MAX_FIXED_ROWS = 32768
#: The SGLang attention backend ``--enable-kv-offload`` runs (prefill on FlashInfer, decode ours).
OFFLOAD_BACKEND = "kvoffload"


#: ``--kv-offload-keep-reserve``'s default: a kept request's next slot must leave 2 % of the pool free. A demotion
#: is for good, so a larger share only demotes earlier: 1/8 (the default until 2026-12-06) demoted 2 requests a load
#: with ~85,000 slots free at 64 x 4K + 512 on an H100 (warm p99 ITL +24 % against stock), 0.02 none (-2.3 %).
KEEP_RESERVE = 0.02


#: The host tier's fields (the hot buffers and the host pool), which --kv-offload-resident-v refuses: they set nothing there.
_HOST_TIER = {"hot_slack": "no hot buffers to size", "hot_slack_max": "no hot buffers to grow", "eviction": "no hot buffers to evict from",
              "host_gb": "no host pool to cap"}


def _host_tier_refusal(field: str) -> str:
    """The one-line refusal of a host-tier flag (:data:`_HOST_TIER`) beside ``--kv-offload-resident-v``."""
    return f"--kv-offload-{field.replace('_', '-')} has {_HOST_TIER[field]} with --kv-offload-resident-v (V stays on the GPU)"


def without_host_tier_flags(argv: Sequence[str]) -> List[str]:
    """``argv`` without the host tier's flags (``--kv-offload-hot-slack``, ``-hot-slack-max``, ``-eviction``,
    ``-host-gb``; as ``--flag V`` or ``--flag=V``, names in full): what a resident-V copy of an offload server
    (``--kv-offload-resident-v``, which refuses them) keeps; they do not change the selection."""
    flags = tuple(f"--kv-offload-{f.replace('_', '-')}" for f in _HOST_TIER)
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x in flags:
            skip = True
        elif not x.startswith(tuple(f + "=" for f in flags)):
            out.append(x)
    return out


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """The ``--kv-offload-*`` flags (:mod:`sglang_elastic.offload`).

    Fields (flag): ``enabled`` (``--enable-kv-offload``); ``topk``, ``budget``,
    ``sink``, ``window``, ``dense_layers``, ``denominator`` (the attended set:
    :meth:`policy`); ``hot_tokens`` (the most LRU V rows per request and sparse
    layer); ``hot_slack`` (hot rows granted per selected row, 1 to 16); ``hot_slack_max``
    (adaptive growth up to this slack while a request's selection misses; 0: off);
    ``host_gb`` (cap on the host pool, GB of 1e9 bytes; None: free host RAM
    less 10 GiB; at TP > 1 an equal share per rank on the host, less 10 GiB each); ``resident_v`` (no host tier: the exactness reference);
    ``prefetch``; ``eviction`` (the hot buffer's victim rule); ``keep_v`` (a request
    keeps V in idle pool slots and attends densely while SGLang's allocator has
    them: :mod:`sglang_elastic.offload.keep`; None, the default: on unless
    ``resident_v``, see :attr:`keep_v_wanted`); ``keep_reserve`` (the share of
    the pool a kept request's next slot must leave free, else it is demoted; None, the default:
    :data:`KEEP_RESERVE`, see :attr:`reserve_share`); ``copy_timing`` (CUDA events around
    every V copy and prefetch wait of a sampled decode step: the share of copy time
    hidden behind compute on ``/metrics``, :mod:`sglang_elastic.offload.copytime`);
    ``dense_launch`` (the all-dense step's attention launch, ``key=value,...``:
    :meth:`split_config`).

    Raises:
        ConfigError: a value out of range, or a ``--kv-offload-*`` flag without
            ``--enable-kv-offload``; the message names the flag.
    """

    enabled: bool = False
    topk: int = 2048
    budget: float = 0.05
    sink: int = 4
    window: int = 32
    dense_layers: int = 2
    denominator: str = "estimate"
    chunk: int = 16
    hot_tokens: int = 4096
    hot_slack: float = 2.0
    hot_slack_max: float = 0.0
    host_gb: Optional[float] = None
    resident_v: bool = False
    prefetch: str = "off"
    eviction: str = "lru"
    keep_v: Optional[bool] = None
    keep_reserve: Optional[float] = None
    copy_timing: bool = False
    dense_launch: str = ""

    def __post_init__(self):
        from sglang_elastic.offload.policy import PolicyError

        if self.window < 1:
            raise ConfigError(f"--kv-offload-window must be >= 1 (the newest token is in the window), not {self.window}")
        if self.sink + self.window >= MAX_FIXED_ROWS:
            raise ConfigError(f"--kv-offload-sink {self.sink} + --kv-offload-window {self.window} must be below {MAX_FIXED_ROWS}: "
                              "every request keeps that many V rows per sparse layer on the GPU, besides its hot buffer")
        try:
            self.policy()
        except PolicyError as e:
            raise ConfigError(str(e)) from None
        if self.hot_tokens < self.topk:
            raise ConfigError(f"--kv-offload-hot-tokens {self.hot_tokens} must be at least --kv-offload-topk {self.topk}")
        if self.hot_tokens >= 32768:
            raise ConfigError(f"--kv-offload-hot-tokens must be below 32768, not {self.hot_tokens}")
        if not 1.0 <= self.hot_slack <= 16.0:
            raise ConfigError(f"--kv-offload-hot-slack must be between 1 and 16 (hot rows per selected row), not {self.hot_slack}")
        if self.hot_slack_max and not self.hot_slack <= self.hot_slack_max <= 16.0:
            raise ConfigError(f"--kv-offload-hot-slack-max must be between --kv-offload-hot-slack ({self.hot_slack}) and 16, "
                              f"or 0 (off), not {self.hot_slack_max}")
        if self.host_gb is not None and not 0 < self.host_gb < float("inf"):
            raise ConfigError(f"--kv-offload-host-gb must be a positive number of GB (omit it for free host RAM), not {self.host_gb}")
        if self.prefetch not in PREFETCH:
            raise ConfigError(f"--kv-offload-prefetch must be one of {', '.join(PREFETCH)}, not {self.prefetch!r}")
        if self.eviction not in EVICTIONS:
            raise ConfigError(f"--kv-offload-eviction must be one of {', '.join(EVICTIONS)}, not {self.eviction!r}")
        if self.prefetch != "off" and self.resident_v:
            raise ConfigError("--kv-offload-prefetch has nothing to fetch with --kv-offload-resident-v (V stays on the GPU)")
        if self.resident_v:  # no hot buffers and no host pool there: a flag that sets them would do nothing
            for f in _HOST_TIER:
                if getattr(self, f) != OffloadConfig.__dataclass_fields__[f].default:
                    raise ConfigError(_host_tier_refusal(f))
        if self.keep_v and self.resident_v:
            raise ConfigError("--kv-offload-keep-v has nothing to keep with --kv-offload-resident-v (V stays on the GPU)")
        if self.keep_reserve is not None:
            if not 0.0 <= self.keep_reserve <= 0.5:
                raise ConfigError(f"--kv-offload-keep-reserve must be a share of the pool between 0 and 0.5, not {self.keep_reserve}")
            if not self.keep_v_wanted:
                why = " (off with --kv-offload-resident-v)" if self.resident_v else ""
                raise ConfigError(f"--kv-offload-keep-reserve sets a share kept free by --kv-offload-keep-v, which is off{why}")
        if self.copy_timing and self.resident_v:
            raise ConfigError("--kv-offload-copy-timing has no copies to time with --kv-offload-resident-v (V stays on the GPU)")
        if self.dense_launch:
            if not self.keep_v_wanted:
                why = " (off with --kv-offload-resident-v)" if self.resident_v else ""
                raise ConfigError(f"--kv-offload-dense-launch sets the all-dense step of --kv-offload-keep-v, which is off{why}")
            try:
                self.split_config()
            except ValueError as e:
                raise ConfigError(str(e)) from None
        defaults = OffloadConfig.__dataclass_fields__
        given = [f for f in defaults if f != "enabled" and getattr(self, f) != defaults[f].default]
        if not self.enabled and given:
            _refuse_without_enable("kv-offload", given[0], getattr(self, given[0]))

    @property
    def reserve_share(self) -> float:
        """The share of the pool a kept request's next slot must leave free: ``keep_reserve`` as given, else
        :data:`KEEP_RESERVE` (``--kv-offload-keep-reserve``; :class:`sglang_elastic.offload.keep.KeepV`)."""
        return KEEP_RESERVE if self.keep_reserve is None else self.keep_reserve

    @property
    def keep_v_wanted(self) -> bool:
        """Dense while V fits: as given, or by default on with offload unless ``resident_v``
        (the pool builder still turns it off for a model whose V head_dim differs from K's,
        unless it was asked for: :func:`sglang_elastic.offload.hooks.resolve_memory_pool_config`).
        On by default since the H200 runs of 2026-12-04: +6.3 % median ITL against stock on a
        load that fits then, +0.5 % with the all-dense launch of 2026-12-05 (+31 % without keep-v), the same capacity and throughput past HBM, and on
        SmolLM2 through SGLang, with 164 demotions, as many answers kept as the sparse rule or
        more in every cell (2 dense-solved answers lost of 900 samples, against the sparse rule's 6)."""
        if self.keep_v is not None:
            return self.keep_v
        return self.enabled and not self.resident_v

    def split_config(self):
        """The decoder's launch settings (:class:`~sglang_elastic.offload.decode.SplitConfig`), with the all-dense
        step's from ``--kv-offload-dense-launch`` (:meth:`~sglang_elastic.offload.decode.SplitConfig.with_dense_launch`)."""
        from sglang_elastic.offload.decode import SplitConfig

        return SplitConfig.with_dense_launch(self.dense_launch)

    def policy(self):
        """The attended-set rule (:class:`~sglang_elastic.offload.policy.OffloadPolicy`)."""
        from sglang_elastic.offload.policy import OffloadPolicy

        return OffloadPolicy(sink=self.sink, window=self.window, budget_frac=self.budget, max_topk=self.topk,
                             dense_layers=self.dense_layers, denominator=self.denominator, chunk=self.chunk)


@dataclasses.dataclass(frozen=True)
class ElasticKVConfig:
    """The server's sglang-elastic flags, checked on construction.

    Fields (flag): ``enabled`` (``--enable-elastic-kv``); ``mode``
    (``--elastic-kv-mode``: ``dynamic`` / ``always-lent`` / ``off``);
    ``lend_bytes`` (``--elastic-kv-lend-bytes``, bytes; None = free device
    memory after CUDA-graph capture less ``margin_mb``); ``handle_mb``
    (``--elastic-kv-handle-mb``, MiB per physical handle; 0 = one step);
    ``lend_after_steps`` (``--elastic-kv-lend-after-steps``, decode-only
    scheduler steps); ``margin_mb`` (``--elastic-kv-margin-mb``, MiB);
    ``activation_rule`` (``--elastic-kv-activation-rule``: what a plain eager
    prefill is taken to need while lent: ``sglang``, SGLang's estimate, or
    ``measured`` (experimental), bounded by what the server's eager prefill
    passes took and never more than SGLang's estimate:
    :class:`sglang_elastic.sched.controller.EagerActivations`);
    ``reclaim_wait`` (``--elastic-kv-reclaim-wait``: ``decode``, the decode
    batch runs while a reclaim's memory comes back and the prefill waits, or
    ``block``, the scheduler waits:
    :meth:`sglang_elastic.sched.controller.ElasticController.defer_prefill`);
    ``decode_policy`` / ``decode_calibration`` (``--decode-policy`` /
    ``--decode-calibration``, for the ``persistentkv`` decode backend).

    Raises:
        ConfigError: on a bad value or an ``--elastic-kv-*`` flag without
            ``--enable-elastic-kv``; the message names the flag.
    """

    enabled: bool = False
    mode: str = "dynamic"
    lend_bytes: Optional[int] = None  # None: measured after CUDA-graph capture
    handle_mb: int = 0
    lend_after_steps: int = 32
    margin_mb: int = 1024
    activation_rule: str = "sglang"
    reclaim_wait: str = "decode"
    decode_policy: str = "auto"
    decode_calibration: Optional[str] = None  # None: this shape's (cache, shipped or the prior)
    decode_calibration_cache: Optional[str] = None  # None: the default cache directory; "off": none
    decode_startup_calibration: str = "auto"
    decode_online: str = "on"
    offload: OffloadConfig = OffloadConfig()

    def __post_init__(self):
        if self.decode_policy not in DECODE_POLICIES:
            raise ConfigError(f"--decode-policy must be one of {', '.join(DECODE_POLICIES)}, not {self.decode_policy!r}")
        if self.decode_startup_calibration not in STARTUP_CALIBRATION:
            raise ConfigError(f"--decode-startup-calibration must be one of {', '.join(STARTUP_CALIBRATION)}, not {self.decode_startup_calibration!r}")
        if self.decode_online not in ONLINE:
            raise ConfigError(f"--decode-online-correction must be one of {', '.join(ONLINE)}, not {self.decode_online!r}")
        if self.mode not in MODES:
            raise ConfigError(f"--elastic-kv-mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.lend_bytes is not None and self.lend_bytes <= 0:
            raise ConfigError(f"--elastic-kv-lend-bytes must be positive, not {self.lend_bytes}")
        if self.handle_mb < 0:
            raise ConfigError(f"--elastic-kv-handle-mb must be >= 0, not {self.handle_mb}")
        if self.lend_after_steps < 1:
            raise ConfigError(f"--elastic-kv-lend-after-steps must be >= 1, not {self.lend_after_steps}")
        if self.margin_mb < 0:
            raise ConfigError(f"--elastic-kv-margin-mb must be >= 0, not {self.margin_mb}")
        if self.activation_rule not in ACTIVATION_RULES:
            raise ConfigError(f"--elastic-kv-activation-rule must be one of {', '.join(ACTIVATION_RULES)}, not {self.activation_rule!r}")
        if self.reclaim_wait not in RECLAIM_WAITS:
            raise ConfigError(f"--elastic-kv-reclaim-wait must be one of {', '.join(RECLAIM_WAITS)}, not {self.reclaim_wait!r}")
        defaults = ElasticKVConfig.__dataclass_fields__
        given = [f for f in ELASTIC_FLAG_FIELDS if getattr(self, f) != defaults[f].default]
        if not self.enabled and given:
            _refuse_without_enable("elastic-kv", given[0], getattr(self, given[0]))
        if self.enabled and self.offload.enabled:
            raise ConfigError("--enable-elastic-kv and --enable-kv-offload both replace SGLang's KV pool: use one")

    def to_env(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_env(cls, text: str) -> "ElasticKVConfig":
        try:
            d = json.loads(text)
            d["offload"] = OffloadConfig(**d.get("offload", {}))
            return cls(**d)
        except (TypeError, AttributeError, json.JSONDecodeError, ConfigError) as e:
            raise ConfigError(f"{ENV} is not a valid sglang-elastic config: {e}") from e


_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "kb": 1000, "mb": 1000**2, "gb": 1000**3}


def parse_bytes(text: str) -> int:
    """``"8GiB"`` -> 8589934592; ``"1.5G"`` -> 1500000000; a plain integer is bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (examples: 8589934592, 8GiB, 512MiB)")
    value = fractions.Fraction(m.group(1))  # exact: "1.005KB" is 1005 bytes
    n = int(value * _UNITS[m.group(2).lower()])
    if n == 0 and value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is less than one byte (examples: 8589934592, 8GiB, 512MiB)")
    return n


class _OnOff(argparse._StoreAction):
    """``--X [BOOL]`` / ``--no-X``: an on/off flag that SGLang's ``--config`` YAML can set (its merger takes only
    store and store_true actions: ``X: false`` in the file becomes ``--X false``). ``--X`` alone is on; ``--X true``
    / ``false`` (also yes/no, on/off, 1/0) as written; ``--no-X`` is off (``--no-X false``: on)."""

    _WORDS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}

    def __init__(self, option_strings, dest, **kw):
        name = option_strings[0]
        super().__init__([name, "--no-" + name[2:]], dest, nargs="?", const=True, metavar="BOOL", **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        value = True if values is True else self._WORDS.get(str(values).strip().lower())
        if value is None:
            parser.error(f"argument {option_string}: expected true or false, not {values!r}")
        setattr(namespace, self.dest, value != option_string.startswith("--no-"))


class _Keys(argparse._StoreAction):
    """A ``KEY=VALUE,...`` flag whose occurrences are all kept, in order (:func:`_merged_launch` joins their keys:
    argparse's ``store`` would keep the last value whole); a store action, so SGLang's ``--config`` YAML can set it."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, (getattr(namespace, self.dest, None) or []) + [values])


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add the sglang-elastic flags to an argparse parser (SGLang's)."""
    g = parser.add_argument_group("sglang-elastic: elastic KV pool")
    g.add_argument("--enable-elastic-kv", action="store_true", help="Build the elastic (CUDA VMM) KV pool: lend the prefill reserve to the KV cache while only decodes run.")
    g.add_argument("--elastic-kv-mode", choices=MODES, default=None, help="dynamic (the default): lend/reclaim as the batch needs; always-lent: lend at start, never reclaim (reproduces the OOM of a committed reserve); off: never lend.")
    g.add_argument("--elastic-kv-lend-bytes", type=parse_bytes, default=None, help="Bytes to lend (default: measured after CUDA-graph capture).")
    g.add_argument("--elastic-kv-handle-mb", type=int, default=None, help="MiB of one physical handle = one K or V buffer's slice of a lend/reclaim step (default 0: the whole reserve in one step).")
    g.add_argument("--elastic-kv-lend-after-steps", type=int, default=None, help="Decode-only steps in a row before lending (hysteresis; default 32).")
    g.add_argument("--elastic-kv-activation-rule", choices=ACTIVATION_RULES, default=None, help="What a plain eager prefill is taken to need while lent: sglang (the default; SGLang's estimate: 512 MiB + 1.5 MiB a token + 128 MiB, 12.6 GiB for a chunk of 8192) or measured (experimental: 1.25x the bound the server's measured eager prefill passes give by tokens and requests, plus 256 MiB, never more than SGLang's estimate; on the H200 1.39 GiB for 8,192 tokens against SGLang's 12.6 GiB, never exceeded; a one-step lend then leaves that need free, so such a prefill runs lent). Every eager prefill's peak is logged as an event either way.")
    g.add_argument("--elastic-kv-reclaim-wait", choices=RECLAIM_WAITS, default=None, help="While a reclaim's unmap gives its memory back (on a helper thread), decode (the default): the prefill it is for waits and the running decode batch takes its steps (no prefill forms in those passes, at most 16), or block: the scheduler waits for the memory, and every running request with it.")
    g.add_argument("--elastic-kv-margin-mb", type=int, default=None, help="MiB kept free for decode activations when measuring the lendable bytes (default 1024); also bounds the eager decode batch (above the decode CUDA graphs) that may run while lent.")
    o = parser.add_argument_group("sglang-elastic: KV offload to host memory (with --enable-kv-offload)")
    o.add_argument("--enable-kv-offload", action="store_true", help="Keep K of every token on the GPU and V of the sparse layers in pinned host memory; decode attends to sink, window and the top-k rows (about 1.6-1.8x the KV tokens of stock on an H200). Works with SGLang's radix cache.")
    o.add_argument("--kv-offload-topk", type=int, default=None, help="Most selected V rows per request and layer besides sink and window (default 2048).")
    o.add_argument("--kv-offload-budget", type=float, default=None, help="Attended fraction of the context (sink + window + top-k), at least sink + window rows (default 0.05).")
    o.add_argument("--kv-offload-sink", type=int, default=None, help="First tokens always attended (default 4).")
    o.add_argument("--kv-offload-window", type=int, default=None, help="Last tokens always attended (>= 1) (default 32).")
    o.add_argument("--kv-offload-dense-layers", type=int, default=None, help="Layers 0..N-1 attend to every token and keep V on the GPU (default 2).")
    o.add_argument("--kv-offload-denominator", choices=DENOMINATORS, default=None, help="Softmax denominator: estimate (exact over every token, the unattended rows' V estimated by chunk means kept on the GPU; met the 0.02 next-token KL gate in all 18 task/length cells on SmolLM2 through SGLang, docs/offload.md; costs 1/chunk of a V row per token on the GPU), selected (renormalised over the attended rows; missed the KL gate in 4 cells) or full (exact, only the V sum is sparse; 3-9x the KL of selected on the CPU oracle) (default estimate).")
    o.add_argument("--kv-offload-chunk", type=int, choices=CHUNKS, default=None, help="Positions per V summary with --kv-offload-denominator estimate, at most --kv-offload-window (default 16, or the largest that fits a smaller window).")
    o.add_argument("--kv-offload-hot-tokens", type=int, default=None, help="The most LRU V rows one request keeps per sparse layer on the GPU (>= --kv-offload-topk) (default 4096).")
    o.add_argument("--kv-offload-hot-slack", type=float, default=None, help="Hot-buffer rows granted per selected row as a request grows, in pages from one pool sized by the tokens held (1 to 16) (default 2).")
    o.add_argument("--kv-offload-hot-slack-max", type=float, default=None, help="Adaptive hot buffers: a request whose selection missed at least 1/16 of its rows in the last step grows by one row per selected row a step, up to this many, in hot pages nobody needs now (an eighth of the pool stays free), and gives them back when the pool runs short (between --kv-offload-hot-slack and 16; default 0: off; not yet measured on a GPU).")
    o.add_argument("--kv-offload-host-gb", type=float, default=None, help="Cap on the pinned host pool, GB of 1e9 bytes as SGLang's --hicache-size (default: free host RAM less 10 GiB; at TP > 1 each rank on the host an equal share of the free RAM, less 10 GiB each).")
    o.add_argument("--kv-offload-resident-v", action="store_true", help="Keep V on the GPU as well (same selection, no host tier): the exactness reference, stock capacity.")
    o.add_argument("--kv-offload-eviction", choices=EVICTIONS, default=None, help="Hot-buffer victims: lru (least recently used) or lfu (InfiniGen's least often selected, then least recently; a measured option) (default lru).")
    o.add_argument("--kv-offload-keep-v", action=_OnOff, default=None, help="Dense while V fits (on by default, off with --kv-offload-resident-v): a request keeps its V in idle KV-pool slots lent by SGLang's allocator and attends to every position (no selection, no PCIe); when the allocator runs short the largest such requests continue sparse from their host V. On the H200: +0.5 %% median ITL against stock on a load that fits in HBM (one run, 2026-12-05; +31 %% with --no-kv-offload-keep-v), unchanged past HBM (docs/offload.md). --no-kv-offload-keep-v: every request on the sparse rule (the prefetch and adaptive hot buffers were measured that way).")
    o.add_argument("--kv-offload-keep-reserve", type=float, default=None, metavar="SHARE", help="With --kv-offload-keep-v: the share of the KV pool a kept request's next slot must leave free, else the largest kept requests are demoted to the sparse rule (0 to 0.5; default 0.02). A demotion is for good, so a larger share moves demotions earlier rather than avoiding them: on an H100 at 64 x 4K + 512, 0.125 (the default before 2026-12-06) demoted 2 requests with ~85,000 slots free and the steps after ran 30 %% slower, 0.02 demoted none (warm p99 ITL 19.7 ms against stock's 20.2). No admission waits on it at any share: the allocator demotes before it could fail.")
    o.add_argument("--kv-offload-copy-timing", action="store_true", help="Time the V copies of one decode step in 16 with CUDA events inside the decode graphs (4 event records per sparse layer and step, 6 with prefetch) and report the share of copy time hidden behind compute (sglang_elastic:offload_copy_hidden_share, offload_copy_ms_per_step on /metrics; copy_* in the counters). Under SGLang's overlap scheduler the graph of a step due for a read is launched again before the GPU has passed it: the host then waits for that step once (copy_waits, copy_wait_ms) instead of losing it. Off by default.")
    o.add_argument("--kv-offload-dense-launch", default=None, action=_Keys, metavar="KEY=VALUE,...", help="The kept requests' attention launch (with --kv-offload-keep-v: the all-dense step, while every request keeps its V, and the kept requests of a general step; given again, here or in --config's YAML, its keys join, a later value of a key winning): min_chunk (positions; 0: 512), fused (one launch: the last chunk merges), pdl (programmatic dependent launch behind the KV store), block_n (0: 64, 16, 32, 64, 128), num_warps (none, 1, 2, 4, 8, 16), num_stages (none, 1-6), min_ctas (every setting here applies only to batches of at least this many programs a chunk, requests x KV heads), chunk_mean (an integer percent, 0-1000, 0 turning it off: the minimum chunk raised to that share of the real requests' mean context where no request is longer than twice that, else min_chunk, which stays its floor; a min_chunk given without chunk_mean turns it off; 125 gave -2.3 %% median ITL against chunk_mean=0 at 32 x 8,448 on an H100, one run), kept_stream (0/1, whatever min_ctas is: in a general step, with sparse requests, the kept requests' launch on a side stream beside the sparse requests' selection; bit-equal, -1.3 to -4.6 %% a sparse layer at 64 x 4.6K on an H100, kernel level only). Default: min_chunk=8192,fused=1,pdl=1,block_n=128,num_warps=none,num_stages=3,min_ctas=256,chunk_mean=125,kept_stream=0 (scripts/gpu/sweep_dense_kept.py's pick on the H200, chunk_mean measured on an H100; docs/offload.md); the keys given replace those.")
    o.add_argument("--kv-offload-prefetch", choices=PREFETCH, default=None, help="speculative: while layer l runs, select layer l+1's rows with layer l's input through layer l+1's query weights and copy their misses ahead (InfiniGen); costs a second K read per layer: +57 %% median ITL on the Llama-3.1-8B shape at 64 x 32K on the H200 (default off).")
    d = parser.add_argument_group("sglang-elastic: decode attention (with --decode-attention-backend persistentkv)")
    d.add_argument("--decode-policy", choices=DECODE_POLICIES, default=None, help="Decode path per batch: auto (calibrated cost model, default), or force flashinfer, split (split-KV) or compact (work queue). Applies only with --decode-attention-backend persistentkv.")
    d.add_argument("--decode-calibration", default=None, metavar="PATH", help="Calibration JSON of the decode policy (default: this GPU and layer shape's: the calibration cache, else a shipped file measured on this shape, else the cost-model prior). Applies only with --decode-attention-backend persistentkv.")
    d.add_argument("--decode-calibration-cache", default=None, metavar="DIR", help="Directory of per-shape decode calibrations (default: $SGLANG_ELASTIC_CACHE_DIR/decode or $XDG_CACHE_HOME/sglang_elastic/decode); 'off': no cache.")
    d.add_argument("--decode-startup-calibration", choices=STARTUP_CALIBRATION, default=None, help="auto (default): time every decode path at CUDA-graph capture when no calibration covers this GPU and shape, and cache the fit; force: always; off: never.")
    d.add_argument("--decode-online-correction", choices=ONLINE, default=None, help="on (default): time a sample of decode graph replays (CUDA events, no sync) and correct the path per batch bucket; off: the calibrated cost model alone.")


def from_namespace(ns: argparse.Namespace) -> ElasticKVConfig:
    """The config from parsed flags (missing flags take their defaults).

    Raises:
        ConfigError: a bad value; ``--decode-policy`` / ``--decode-calibration``
        without ``--decode-attention-backend persistentkv``; a calibration file
        that does not load.
    """
    policy = getattr(ns, "decode_policy", None)
    calibration = getattr(ns, "decode_calibration", None)
    decode_flags = {"--decode-policy": policy, "--decode-calibration": calibration,
                    "--decode-calibration-cache": getattr(ns, "decode_calibration_cache", None),
                    "--decode-startup-calibration": getattr(ns, "decode_startup_calibration", None),
                    "--decode-online-correction": getattr(ns, "decode_online_correction", None)}
    given = [f for f, v in decode_flags.items() if v is not None]
    cache = decode_flags["--decode-calibration-cache"]
    if given:
        decode_backend = (getattr(ns, "decode_attention_backend", None) or getattr(ns, "attention_backend", None)
                          or (OFFLOAD_BACKEND if getattr(ns, "enable_kv_offload", False) else None))
        if decode_backend != DECODE_BACKEND:
            flag = given[0]
            raise ConfigError(f"{flag} applies only with --decode-attention-backend {DECODE_BACKEND} (decode backend here: {decode_backend or 'SGLang default'})")
    if policy not in (None, "auto"):  # a forced path reads no calibration and corrects nothing: asking for either is a mistake
        for flag, on in (("--decode-startup-calibration", ("force",)), ("--decode-online-correction", ("on",))):
            if decode_flags[flag] in on:
                raise ConfigError(f"{flag} {decode_flags[flag]} applies to --decode-policy auto only: --decode-policy {policy} "
                                  "forces one path; drop one of the two")
    if calibration is not None:
        from sglang_elastic.attention.policy import CalibrationError, load_calibration

        if not calibration.strip():
            raise ConfigError("--decode-calibration needs the path of a calibration JSON, not an empty value "
                              "(omit it for this GPU and shape's own)")

        try:
            load_calibration(calibration)
        except CalibrationError as e:
            raise ConfigError(f"--decode-calibration: {e}") from None
        calibration = os.path.abspath(calibration)
    # the --elastic-kv-* parser defaults are None: a flag given at its default value without --enable-elastic-kv is refused too
    elastic = {f: getattr(ns, f"elastic_kv_{f}", None) for f in ELASTIC_FLAG_FIELDS}
    elastic = {f: v for f, v in elastic.items() if v is not None}
    if elastic and not getattr(ns, "enable_elastic_kv", False):
        first = next(iter(elastic))
        _refuse_without_enable("elastic-kv", first, elastic[first])
    why = _NO_RECLAIM_MODES.get(elastic.get("mode"))
    for flag in _RECLAIM_ONLY if why else ():
        if flag in elastic:
            raise ConfigError(f"--elastic-kv-mode {elastic['mode']} {why}: drop --elastic-kv-{flag.replace('_', '-')} {elastic[flag]}")
    return ElasticKVConfig(
        enabled=bool(getattr(ns, "enable_elastic_kv", False)),
        **elastic,
        decode_policy=policy or "auto",
        decode_calibration=calibration,
        decode_calibration_cache=_calibration_cache(cache),
        decode_startup_calibration=getattr(ns, "decode_startup_calibration", None) or "auto",
        decode_online=getattr(ns, "decode_online_correction", None) or "on",
        offload=_offload_config(ns),
    )


def _calibration_cache(value: Optional[str]) -> Optional[str]:
    """``--decode-calibration-cache``: None (the default directory), ``off`` (any case), or a directory
    (made at the first write; an existing file or an empty value is refused: ``os.path.abspath("")``
    would have cached into the working directory)."""
    if value is None:
        return None
    if value.strip().lower() == "off":
        return "off"
    if not value.strip():
        raise ConfigError("--decode-calibration-cache needs a directory or off, not an empty value")
    if os.path.exists(value) and not os.path.isdir(value):
        raise ConfigError(f"--decode-calibration-cache {value} is a file: give a directory (made if missing) or off")
    return os.path.abspath(value)


#: OffloadConfig fields whose flag has an on and an off form (``--X`` / ``--no-X``, default None)
ON_OFF_FLAGS = ("keep_v",)


#: --elastic-kv-* flags only ``dynamic``'s lend/reclaim cycle reads: given with a mode that has no cycle (the
#: reason), they are refused, as a contradiction the user should see (``off`` still measures what it could
#: lend, with --elastic-kv-lend-bytes, -handle-mb and -margin-mb, and reports it)
_RECLAIM_ONLY = ("lend_after_steps", "activation_rule", "reclaim_wait")
_NO_RECLAIM_MODES = {"off": "never lends or reclaims", "always-lent": "lends once at start-up and never reclaims"}


def _refuse_without_enable(prefix: str, field: str, value) -> None:
    """Raise the one-line refusal of ``--PREFIX-FIELD`` (``--no-...`` for an on/off flag given off) without its enable flag."""
    flag = f"--{prefix}-{field.replace('_', '-')}"
    if value is False and field in ON_OFF_FLAGS:
        flag = f"{flag} false (--no-{flag[2:]})"
    raise ConfigError(f"{flag} (and every --{prefix}-* flag) needs --enable-{prefix}")


def _merged_launch(items: Sequence[str]) -> str:
    """``--kv-offload-dense-launch`` given several times (in ``--config``'s YAML and on the command line, which
    SGLang's merger puts after the file's, or twice on the command line): one ``KEY=VALUE,...`` value whose keys are
    every occurrence's, a later occurrence's value of a key replacing an earlier one's. A key twice in one value stays
    twice (:meth:`~sglang_elastic.offload.decode.SplitConfig.with_dense_launch` refuses it).

    Raises:
        ConfigError: an empty value (it would read as the defaults).
    """
    if any(not x.strip() for x in items):
        raise ConfigError("--kv-offload-dense-launch needs KEY=VALUE,... (omit it for the defaults)")
    key = lambda part: part.split("=", 1)[0].strip()
    later: set = set()
    kept: List[List[str]] = []
    for item in reversed(items):
        parts = item.split(",")
        kept.append([x for x in parts if key(x) not in later])
        later |= {key(x) for x in parts}
    return ",".join(x for parts in reversed(kept) for x in parts)


def _offload_config(ns: argparse.Namespace) -> "OffloadConfig":
    """``OffloadConfig`` from the ``--kv-offload-*`` flags. Their parser
    defaults are None, so a flag given at its default value without
    ``--enable-kv-offload`` is refused too (not only a changed value)."""
    fields = OffloadConfig.__dataclass_fields__
    given = {f: getattr(ns, f"kv_offload_{f}", None) for f in fields if f != "enabled"}
    # a store_true flag not given reads False; --no-kv-offload-keep-v (an on/off flag, None when not given) is a value
    given = {f: v for f, v in given.items() if v is not None and (v is not False or f in ON_OFF_FLAGS)}
    if isinstance(given.get("dense_launch"), list):  # (action=_Keys: every occurrence, in order)
        given["dense_launch"] = _merged_launch(given["dense_launch"])
    enabled = bool(getattr(ns, "enable_kv_offload", False))
    if given.get("resident_v"):  # given at its default value too (OffloadConfig's own check sees only changed values)
        for f in _HOST_TIER:
            if f in given:
                raise ConfigError(_host_tier_refusal(f))
    if given and not enabled:
        first = next(iter(given))
        _refuse_without_enable("kv-offload", first, given[first])
    denominator = given.get("denominator", OffloadConfig.denominator)
    if "chunk" in given and denominator != "estimate":
        raise ConfigError(f"--kv-offload-chunk applies only with --kv-offload-denominator estimate (the chunk means it sizes), "
                          f"not {denominator}")
    window = given.get("window", OffloadConfig.window)
    if denominator == "estimate" and "chunk" not in given and 1 <= window < OffloadConfig.chunk:
        # the default chunk follows a smaller window (the last, incomplete chunk must lie inside it)
        fits = [c for c in CHUNKS if c <= window]
        if not fits:
            how = "given" if "denominator" in given else "the default"
            raise ConfigError(f"--kv-offload-window {window} is below the smallest V-summary chunk ({CHUNKS[0]}) of "
                              f"--kv-offload-denominator estimate ({how}): give a window of at least {CHUNKS[0]}, "
                              f"or --kv-offload-denominator selected")
        given["chunk"] = fits[-1]
    return OffloadConfig(enabled=enabled, **given)


#: SGLang features the elastic pool does not support: (flag, test on its
#: value[, why]); without a why, the message gives the general reason.
_UNSUPPORTED = (
    ("--speculative-algorithm", lambda v: v is not None),
    ("--enable-hierarchical-cache", bool),
    ("--enable-hisparse", bool),
    ("--enable-lmcache", bool),
    ("--enable-flexkv", bool),
    ("--disaggregation-mode", lambda v: v not in (None, "null")),
    ("--pp-size", lambda v: (v or 1) > 1),
    ("--dcp-size", lambda v: (v or 1) > 1),
    ("--enable-dp-attention", bool),
    ("--enable-page-major-kv-layout", bool),
    ("--enable-unified-memory", bool),
    ("--enable-memory-saver", bool),
    # SGLang 0.5.17's quantized KV caches (--kv-cache-dtype choices): pools of their own, not the MHA pool we place
    ("--kv-cache-dtype", lambda v: v in ("fp4_e2m1", "mxfp8", "nvfp4", "fp4_mx_block16"), "a quantized KV cache has its own pool class"),
    # KV holders a reclaim cannot vacate (sglang_elastic/sched/controller.py lists every holder)
    ("--enable-pdmux", bool, "PD-multiplexing keeps its split prefill batch's KV outside the running batch across scheduler steps"),
    ("--dllm-algorithm", lambda v: v is not None, "diffusion LLMs keep requests' KV in a staging queue outside the running batch"),
    ("--radix-cache-backend", bool, "a registered radix-cache backend keeps KV ids where a reclaim does not look"),
    ("--enable-session-radix-cache", bool, "it needs SGLang's unified radix tree, whose nodes a reclaim cannot remap"),
    ("--kv-canary", lambda v: v not in (None, "none"), "the KV canary attaches only to SGLang's own pool classes"),
)
#: Environment switches of SGLang's tree cache that a reclaim cannot vacate.
_UNSUPPORTED_ENV = (
    ("SGLANG_ENABLE_UNIFIED_RADIX_TREE", "the unified radix tree keeps KV ids in components a reclaim cannot remap"),
    ("SGLANG_EXPERIMENTAL_CPP_RADIX_TREE", "the C++ radix tree keeps KV ids where a reclaim cannot remap them"),
)


#: --kv-cache-dtype values that keep the KV cache bf16/fp16, what the project's kernels read ("auto": the model's dtype).
_BF16_FP16_KV = ("auto", "bfloat16", "bf16", "float16", "fp16")

#: CUDA-graph backends the offload pool is validated with, per phase (None: SGLang's default, full decode and breakable
#: prefill graphs), for --cuda-graph-backend-{decode,prefill} and the same phases of --cuda-graph-config.
_OFFLOAD_GRAPHS = {"decode": (None, "full", "disabled"), "prefill": (None, "breakable", "disabled")}
_OFFLOAD_GRAPHS_WHY = {
    "decode": "validated with SGLang's full decode graphs (keep-v's two graph variants are chosen per replay)",
    "prefill": "validated with SGLang's breakable prefill graphs (a full or piecewise prefill graph prepares its metadata "
               "without the prefill's V-row plan and staging)",
}

#: SGLang features the offload pool does not support: (flag, test on its value, why).
_OFFLOAD_UNSUPPORTED = (
    ("--speculative-algorithm", lambda v: v is not None, "no target-verify path over a host V tier"),
    ("--disaggregation-mode", lambda v: v not in (None, "null"), "PD transfer reads whole KV rows from the GPU pool"),
    ("--pp-size", lambda v: (v or 1) > 1, "the pool holds every layer of the model"),
    ("--dcp-size", lambda v: (v or 1) > 1, "decode context parallelism splits the KV the selection scores"),
    ("--enable-dp-attention", bool, "not built for DP attention"),
    ("--enable-hierarchical-cache", bool, "HiCache keeps its own host copy of whole prefixes"),
    ("--enable-hisparse", bool, "HiSparse is SGLang's DSA-only sparse attention"),
    ("--enable-lmcache", bool, "LMCache moves whole prefixes"),
    ("--enable-page-major-kv-layout", bool, "the pool keeps SGLang's per-layer NHD layout"),
    ("--enable-unified-memory", bool, "the pool keeps SGLang's per-layer NHD layout"),
    ("--enable-memory-saver", bool, "pinned host rows cannot be released and restored"),
    ("--enable-mixed-chunk", bool, "a mixed batch would run decode rows through the prefill path, which reads V from staging"),
    ("--enable-two-batch-overlap", bool, "not built for two-batch overlap"),
    ("--enable-streaming-session", bool, "a session slot keeps a finished turn's rows outside the running batch"),
    ("--kv-cache-dtype", lambda v: v is not None and v not in _BF16_FP16_KV, "the kernels read bf16/fp16 KV"),
    ("--page-size", lambda v: (v or 1) != 1, "validated at page size 1 only"),
    # a review of SGLang 0.5.17's other features (2026-12-04): each below runs KV writes or graph replays the pool does not plan
    ("--enable-pdmux", bool, "PD-multiplexing runs a split prefill beside decodes over one pool whose per-forward V-row plan is single"),
    ("--radix-cache-backend", lambda v: v is not None, "validated with SGLang's default radix cache only (a registered cache, "
                                                       "which SGLang takes even with --disable-radix-cache, may hold KV ids otherwise)"),
    ("--enable-prefill-cp", bool, "context-parallel prefill reorders the tokens each rank writes, past the prefill's V-row plan"),
    ("--attn-cp-size", lambda v: (v or 1) > 1, "context parallelism splits the KV the selection scores"),
    ("--dllm-algorithm", lambda v: v is not None, "a diffusion step is an extend inside the decode graphs, which plan decodes only"),
    ("--debug-cuda-graph", bool, "validated with SGLang's full decode graphs (a debug replay reruns the step's Python)"),
    ("--enable-torch-compile", bool, "not validated under torch.compile (the decode step updates the pool's hot-buffer state in place)"),
    ("--enable-deterministic-inference", bool, "it needs one of SGLang's own attention backends, and a sparse decode is not batch-invariant"),
    ("--rl-on-policy-target", lambda v: v is not None, "SGLang turns on deterministic inference for it, which needs one of its own "
                                                        "attention backends (and a sparse decode is not batch-invariant)"),
    ("--enable-flexkv", bool, "FlexKV moves whole prefixes (and SGLang ignores it without the radix cache)"),
    ("--enable-session-radix-cache", bool, "it needs the radix cache"),
    ("--kv-canary", lambda v: v not in (None, "none"), "the KV canary attaches only to SGLang's own pool classes"),
)


#: Radix-tree implementations other than SGLang's default ``RadixCache`` (which the offload pool supports:
#: ``OffloadKVPool.plan_prefix``, ``keep.KeepV._evict``), chosen by environment switches.
_OFFLOAD_RADIX_ENV = (
    ("SGLANG_EXPERIMENTAL_CPP_RADIX_TREE", "validated with SGLang's default radix cache only (unset it, or pass --disable-radix-cache)"),
    ("SGLANG_ENABLE_UNIFIED_RADIX_TREE", "validated with SGLang's default radix cache only (unset it, or pass --disable-radix-cache)"),
)


def model_config(ns: argparse.Namespace) -> Optional[dict]:
    """A local model's ``config.json`` (``--model-path``) with ``--json-model-override-args`` applied over it, as
    SGLang applies them (a shallow update), read as the advisor reads it (:func:`sglang_elastic.eval.sizing.read_config`);
    None for a hub id, no file, not a JSON object, or overrides that are not a JSON object (SGLang reports those):
    then the pool's sizing checks the model after the weights load."""
    path = getattr(ns, "model_path", None)
    if not path:
        return None
    from sglang_elastic.eval.sizing import AdviseError, read_config

    try:
        _, c = read_config(os.path.expanduser(path), {})
        over = json.loads(getattr(ns, "json_model_override_args", None) or "{}")
    except (AdviseError, ValueError):
        return None
    return {**c, **over} if isinstance(over, dict) else None


def _model_int(c: Optional[dict], key: str) -> Optional[int]:
    """A positive integer ``key`` of a model config (or of its ``text_config``), else None."""
    if c is None:
        return None
    n = c.get(key, (c.get("text_config") or {}).get(key))
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def _context_length(c: Optional[dict]) -> Optional[int]:
    """The context length SGLang 0.5.17 derives from a model config (``get_context_length``: the first of its
    context keys, times the RoPE scaling factor), or None without a config."""
    if c is None:
        return None
    import types

    from sglang.srt.utils.hf_transformers.common import get_context_length

    return get_context_length(types.SimpleNamespace(**{k: v for k, v in c.items() if isinstance(k, str) and k.isidentifier()}))


#: ``--kv-offload-eviction lfu`` packs a slot's last use in 21 bits (``kernels/offload.py``'s ``_swap_in_kernel`` literals;
#: the kernels module takes this value)
LFU_MAX_LEN = 1 << 21


def _fp32_kv(ns: argparse.Namespace) -> bool:
    """The KV cache would be float32: ``--kv-cache-dtype auto`` (the model's dtype) with ``--dtype float32`` (SGLang's
    ``auto`` dtype never picks float32: a float32 checkpoint runs in float16)."""
    kv = str(getattr(ns, "kv_cache_dtype", None) or "auto")
    return kv == "auto" and str(getattr(ns, "dtype", None) or "auto").lower() in ("float32", "float")


def _check_offload(cfg: ElasticKVConfig, ns: argparse.Namespace) -> None:
    """Refuse, at start-up, what ``--enable-kv-offload`` does not support (one line with the reason)."""
    if not cfg.offload.enabled:
        return
    for flag, bad, why in _OFFLOAD_UNSUPPORTED:
        v = getattr(ns, flag[2:].replace("-", "_"), None)
        if bad(v):
            raise ConfigError(f"--enable-kv-offload does not support {flag} {v!r}: {why}")
    graphs = getattr(ns, "cuda_graph_config", None)  # SGLang's JSON form, which takes precedence over the per-phase flags
    for phase, ok in _OFFLOAD_GRAPHS.items():
        phase_cfg = (graphs.get(phase) if isinstance(graphs, dict) else getattr(graphs, phase, None)) if graphs is not None else None
        json_backend = phase_cfg.get("backend") if isinstance(phase_cfg, dict) else getattr(phase_cfg, "backend", None)
        for where, backend in ((f"--cuda-graph-backend-{phase}", getattr(ns, f"cuda_graph_backend_{phase}", None)),
                               (f"--cuda-graph-config {phase} backend", json_backend)):
            if backend not in ok:
                raise ConfigError(f"--enable-kv-offload does not support {where} {backend!r}: {_OFFLOAD_GRAPHS_WHY[phase]}")
    if _fp32_kv(ns):
        raise ConfigError(f"--enable-kv-offload does not support --dtype {ns.dtype}: the kernels read bf16/fp16 KV, and the KV cache "
                          "takes the model's dtype (pass --dtype bfloat16 or float16)")
    mc = model_config(ns)
    context = getattr(ns, "context_length", None) or _context_length(mc)
    if cfg.offload.eviction == "lfu" and context is not None and context >= LFU_MAX_LEN:
        raise ConfigError(f"--kv-offload-eviction lfu packs a slot's last use in 21 bits: contexts below {LFU_MAX_LEN:,} positions, "
                          f"not {context:,} (use lru, or a shorter --context-length)")
    layers = _model_int(mc, "num_hidden_layers")
    dense = cfg.offload.dense_layers
    if layers is not None and dense >= layers and not cfg.offload.resident_v:  # as sizing refuses it, before the weights load
        raise ConfigError(f"--kv-offload-dense-layers {dense} leaves none of the model's {layers} layers sparse: nothing would be "
                          f"offloaded (use at most {layers - 1})")
    if env_on("SGLANG_ENABLE_DETERMINISTIC_INFERENCE"):
        raise ConfigError(f"--enable-kv-offload does not support SGLANG_ENABLE_DETERMINISTIC_INFERENCE="
                          f"{os.environ['SGLANG_ENABLE_DETERMINISTIC_INFERENCE']}: it needs one of SGLang's own "
                          "attention backends, and a sparse decode is not batch-invariant")
    for env, why in _OFFLOAD_RADIX_ENV:  # SGLang's default radix cache is supported (a matched prefix is rebuilt per request)
        if not getattr(ns, "disable_radix_cache", False) and env_on(env):
            raise ConfigError(f"--enable-kv-offload does not support {env}={os.environ[env]}: {why}")
    for flag in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
        v = getattr(ns, flag, None)
        if v not in (None, OFFLOAD_BACKEND):
            raise ConfigError(f"--enable-kv-offload runs its own attention backend ({OFFLOAD_BACKEND}: FlashInfer prefill, offload decode): "
                              f"drop --{flag.replace('_', '-')} {v}")
    if env_on("SGLANG_ENABLE_POST_CAPTURE_KV_SIZING"):
        raise ConfigError("--enable-kv-offload sizes the KV pool itself: unset SGLANG_ENABLE_POST_CAPTURE_KV_SIZING")


def env_on(name: str) -> bool:
    """An SGLang boolean environment switch as SGLang 0.5.17 reads it (``sglang/srt/environ.py``,
    ``EnvBool``: ``true``, ``1``, ``yes``, ``y`` in any case; unset or another value: off, as SGLang
    falls back to the default False with a warning). Before 2026-12-06 our refusals read only
    ``1``/``true``/``yes``, so ``=y`` turned a feature on past them."""
    raw = os.environ.get(name)
    if raw is None:
        return False
    from sglang.srt.environ import EnvBool

    try:
        return bool(EnvBool(False).parse(raw))
    except ValueError:
        return False


def _check_backends(cfg: ElasticKVConfig, ns: argparse.Namespace) -> None:
    """The project's backends where SGLang would misuse them: ``persistentkv``
    is decode-only (as the prefill backend SGLang would call its missing
    extend path at the first prefill, after the start-up), ``kvoffload``
    needs the offload pool (``--enable-kv-offload``)."""
    main = getattr(ns, "attention_backend", None)
    prefill = getattr(ns, "prefill_attention_backend", None) or main
    if prefill == DECODE_BACKEND:
        flag = "--prefill-attention-backend" if getattr(ns, "prefill_attention_backend", None) else "--attention-backend"
        raise ConfigError(f"{flag} {DECODE_BACKEND}: it is a decode-only backend; pass --decode-attention-backend {DECODE_BACKEND} "
                          "(prefill stays on SGLang's)")
    if getattr(ns, "decode_attention_backend", None) == DECODE_BACKEND:  # as the backend's start refuses them (_check_supported), before it
        fix = f"drop --decode-attention-backend {DECODE_BACKEND} (FlashInfer or Triton decode them)"
        kv = str(getattr(ns, "kv_cache_dtype", None) or "auto")
        if kv not in _BF16_FP16_KV:  # (fp8_*, fp4_e2m1, mxfp8, nvfp4, ...)
            raise ConfigError(f"--decode-attention-backend {DECODE_BACKEND} reads bf16/fp16 KV caches, not --kv-cache-dtype {kv}; {fix}")
        if _fp32_kv(ns):
            raise ConfigError(f"--decode-attention-backend {DECODE_BACKEND} reads bf16/fp16 KV caches, not the float32 one --dtype "
                              f"{ns.dtype} gives; pass --dtype bfloat16 or float16, or {fix}")
        if (getattr(ns, "dcp_size", None) or 1) > 1:
            raise ConfigError(f"--decode-attention-backend {DECODE_BACKEND} does not support --dcp-size {ns.dcp_size} (decode context "
                              f"parallelism splits each request's KV over ranks); {fix}")
        if getattr(ns, "speculative_algorithm", None):
            raise ConfigError(f"--decode-attention-backend {DECODE_BACKEND} has no target-verify path for "
                              f"--speculative-algorithm {ns.speculative_algorithm}; {fix}")
    if not cfg.offload.enabled:
        for flag in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
            if getattr(ns, flag, None) == OFFLOAD_BACKEND:
                raise ConfigError(f"--{flag.replace('_', '-')} {OFFLOAD_BACKEND} runs over the offload pool: pass --enable-kv-offload "
                                  "(which selects it) instead")


def apply_offload_defaults(cfg: ElasticKVConfig, ns: argparse.Namespace) -> None:
    """With ``--enable-kv-offload``, SGLang's attention backend is ``kvoffload``."""
    if cfg.offload.enabled:
        ns.attention_backend = OFFLOAD_BACKEND


def check_server_args(cfg: ElasticKVConfig, ns: argparse.Namespace) -> None:
    """Refuse SGLang features the elastic pool or the offload pool does not support, at start-up.

    Raises:
        ConfigError: naming the first conflicting flag.
    """
    _check_offload(cfg, ns)
    _check_backends(cfg, ns)
    if not cfg.enabled:
        return
    for flag, bad, *why in _UNSUPPORTED:
        v = getattr(ns, flag[2:].replace("-", "_"), None)
        if bad(v):
            reason = why[0] if why else "the elastic pool is SGLang's plain MHA pool on one device, no spec decoding, no host-cache tiers"
            raise ConfigError(f"--enable-elastic-kv does not support {flag} {v!r} ({reason})")
    for env, reason in _UNSUPPORTED_ENV:
        if env_on(env):
            raise ConfigError(f"--enable-elastic-kv does not support {env}={os.environ[env]} ({reason})")
    events = os.environ.get(EVENTS_ENV)
    if events:  # opened (append) by the scheduler after the weights load and the graphs capture: a bad path fails here
        where = os.path.dirname(os.path.abspath(events))
        if os.path.isdir(events) or (not os.access(events, os.W_OK) if os.path.exists(events) else
                                     not (os.path.isdir(where) and os.access(where, os.W_OK | os.X_OK))):
            raise ConfigError(f"{EVENTS_ENV}={events}: not a file that can be written (the lend/reclaim records are appended there)")


def publish(cfg: ElasticKVConfig) -> None:
    """Make ``cfg`` visible to this process's children (SGLang's schedulers)."""
    os.environ[ENV] = cfg.to_env()
    if cfg.enabled and cfg.mode == "always-lent":
        logger.warning("sglang-elastic: --elastic-kv-mode always-lent commits the prefill reserve to the KV cache for good; a long prompt can run out of memory (this mode exists to show that)")


def current() -> ElasticKVConfig:
    """The config of this server (from ``SGLANG_ELASTIC_CONFIG``; defaults when unset)."""
    text = os.environ.get(ENV)
    return ElasticKVConfig.from_env(text) if text else ElasticKVConfig()
