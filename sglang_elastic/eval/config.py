"""Experiment configs: one YAML file per experiment (``scripts/eval/configs/``),
validated with pydantic. A bad file raises :class:`EvalConfigError` whose one
message names the file and every offending field.

Shape::

    experiment: ttft_vs_chunk        # ttft_vs_chunk | capacity | reserve_vs_tp | decode_fraction
    name: ttft_vs_chunk              # -> docs/results/eval/<name>.json (default: experiment)
    cluster: {address: null, max_parallel_servers: null, startup_timeout_s: 1200}
    server_defaults: {model: llama-3.1-8b, tp: 1}      # merged into every server
    servers:                          # one SGLang server each (TP = tp GPUs)
      - {label: chunk-2048, chunked_prefill_size: 2048}
    workloads:                        # run one after another on every server
      - {kind: decode_then_long, decodes: 40, long_prompts: 6, long_input_len: 25000}
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Annotated, Any, Dict, List, Literal, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

EXPERIMENTS = ("ttft_vs_chunk", "capacity", "reserve_vs_tp", "decode_fraction")
TP_SIZES = (1, 2, 4, 8)


class EvalConfigError(ValueError):
    """A bad experiment config; the message names the file and the fields."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Dist(_Strict):
    """A token-length distribution, sampled with a seeded ``random.Random``.

    - ``fixed``: always ``value``;
    - ``uniform``: integers in ``[min, max]``;
    - ``lognormal``: ``median * exp(sigma * N(0, 1))``, clipped to ``[min, max]``
      (request lengths of chat traces are roughly log-normal).
    """

    dist: Literal["fixed", "uniform", "lognormal"]
    value: Optional[int] = Field(None, gt=0)
    min: Optional[int] = Field(None, gt=0)
    max: Optional[int] = Field(None, gt=0)
    median: Optional[float] = Field(None, gt=0)
    sigma: Optional[float] = Field(None, gt=0)

    @model_validator(mode="after")
    def _params(self):
        need = {"fixed": ("value",), "uniform": ("min", "max"), "lognormal": ("median", "sigma", "min", "max")}[self.dist]
        missing = [k for k in need if getattr(self, k) is None]
        if missing:
            raise ValueError(f"dist {self.dist} needs {', '.join(missing)}")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min ({self.min}) > max ({self.max})")
        return self

    def sample(self, rng: random.Random, n: int) -> List[int]:
        if self.dist == "fixed":
            return [self.value] * n
        if self.dist == "uniform":
            return [rng.randint(self.min, self.max) for _ in range(n)]
        return [int(min(self.max, max(self.min, round(self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0)))))) for _ in range(n)]

    @property
    def upper(self) -> int:
        return self.value if self.dist == "fixed" else self.max


class DecodeThenLong(_Strict):
    """E1/E2: ``decodes`` requests decode together; once every one has its first
    token (and ``settle_s`` more), ``long_prompts`` prompts of ``long_input_len``
    tokens arrive ``long_interval_s`` apart. TTFT is timed on the long prompts,
    ITL on the decodes while the long prompts are being prefilled."""

    kind: Literal["decode_then_long"]
    decodes: int = Field(40, ge=0)
    decode_input_len: int = Field(1024, gt=0)
    decode_output_len: int = Field(4096, gt=0)
    long_prompts: int = Field(6, gt=0)
    long_input_len: int = Field(25000, gt=0)
    long_output_len: int = Field(8, gt=0)
    long_interval_s: float = Field(0.0, ge=0)
    settle_s: float = Field(5.0, ge=0)
    repeats: int = Field(1, gt=0)
    seed: int = 0


class Mix(_Strict):
    """E4: ``num_requests`` requests with lengths from ``input_len`` /
    ``output_len``, Poisson arrivals at ``request_rate`` per second (``inf``:
    all at once)."""

    kind: Literal["mix"]
    name: str
    num_requests: int = Field(gt=0)
    request_rate: float = Field(gt=0)
    input_len: Dist
    output_len: Dist
    seed: int = 0


Workload = Annotated[Union[DecodeThenLong, Mix], Field(discriminator="kind")]


class ServerConfig(_Strict):
    """One SGLang server: the embedded model shape, TP and the flags that differ
    between rows. ``reuse: <experiment>/<label>`` takes the row from that
    experiment's result JSON when its server config is identical (no start)."""

    label: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.+-]+$")
    model: str = "llama-3.1-8b"
    tp: int = 1
    chunked_prefill_size: Optional[int] = None
    mem_fraction_static: Optional[float] = Field(None, gt=0, lt=1)
    enable_elastic_kv: bool = False
    env: Dict[str, str] = Field(default_factory=dict)
    extra_args: List[str] = Field(default_factory=list)
    group: Optional[str] = None
    reuse: Optional[str] = Field(None, pattern=r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.+-]+$")

    @field_validator("model")
    @classmethod
    def _model(cls, v: str) -> str:
        from sglang_elastic.serve import model_names

        if v not in model_names():
            raise ValueError(f"unknown embedded model {v!r}; known: {', '.join(model_names())}")
        return v

    @field_validator("tp")
    @classmethod
    def _tp(cls, v: int) -> int:
        if v not in TP_SIZES:
            raise ValueError(f"tp must be one of {TP_SIZES}, not {v}")
        return v

    @field_validator("chunked_prefill_size")
    @classmethod
    def _chunk(cls, v: Optional[int]) -> Optional[int]:
        if v is not None and v != -1 and v < 1:
            raise ValueError(f"chunked_prefill_size must be positive (or -1: off), not {v}")
        return v

    @field_validator("extra_args")
    @classmethod
    def _extra(cls, v: List[str]) -> List[str]:
        owned = ("--tp", "--tp-size", "--chunked-prefill-size", "--mem-fraction-static", "--enable-elastic-kv", "--port", "--host", "--use-ray", "--model-path", "--incremental-streaming-output", "--stream-output")
        bad = [a for a in v if a.split("=", 1)[0] in owned]
        if bad:
            raise ValueError(f"{', '.join(bad)}: set through the server's own fields (tp, chunked_prefill_size, ...), the launcher owns --host/--port/--use-ray/--incremental-streaming-output")
        return v

    def launch_flags(self) -> List[str]:
        """SGLang flags of this row (before the launcher's --host/--port/--use-ray)."""
        flags = ["--tp-size", str(self.tp)]
        if self.chunked_prefill_size is not None:
            flags += ["--chunked-prefill-size", str(self.chunked_prefill_size)]
        if self.mem_fraction_static is not None:
            flags += ["--mem-fraction-static", str(self.mem_fraction_static)]
        if self.enable_elastic_kv:
            flags.append("--enable-elastic-kv")
        return flags + list(self.extra_args)

    def identity(self) -> Dict[str, Any]:
        """What makes two rows the same server (for ``reuse``)."""
        return {"model": self.model, "tp": self.tp, "flags": self.launch_flags(), "env": dict(sorted(self.env.items()))}


class ClusterConfig(_Strict):
    address: Optional[str] = None  # None: start a local Ray cluster
    max_parallel_servers: Optional[int] = Field(None, gt=0)
    startup_timeout_s: float = Field(1200.0, gt=0)
    log_dir: str = "/tmp/sglang-eval/logs"
    warm_first: bool = True  # start one server alone first (FlashInfer JIT cache), then the rest


class Experiment(_Strict):
    experiment: Literal["ttft_vs_chunk", "capacity", "reserve_vs_tp", "decode_fraction"]
    name: Optional[str] = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # a file stem: not "." or ".."
    description: str = ""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    server_defaults: Dict[str, Any] = Field(default_factory=dict)
    servers: List[ServerConfig] = Field(min_length=1)
    workloads: List[Workload] = Field(default_factory=list)
    baseline: Optional[str] = None  # capacity: the stock row's label
    ttft_tolerance: float = Field(0.01, gt=0, lt=1)

    @model_validator(mode="before")
    @classmethod
    def _merge_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("servers"), list):
            defaults = data.get("server_defaults") or {}
            if not isinstance(defaults, dict):
                return data
            data = dict(data)
            data["servers"] = [{**defaults, **s} if isinstance(s, dict) else s for s in data["servers"]]
        return data

    @model_validator(mode="after")
    def _consistent(self):
        labels = [s.label for s in self.servers]
        dup = sorted({x for x in labels if labels.count(x) > 1})
        if dup:
            raise ValueError(f"server labels must be unique: {', '.join(dup)}")
        kinds = {w.kind for w in self.workloads}
        if self.experiment in ("ttft_vs_chunk", "capacity") and kinds != {"decode_then_long"}:
            raise ValueError(f"{self.experiment} needs exactly decode_then_long workloads, got {sorted(kinds) or 'none'}")
        if self.experiment == "reserve_vs_tp" and self.workloads:
            raise ValueError("reserve_vs_tp reads server facts only: no workloads")
        if self.experiment == "decode_fraction":
            if not self.workloads or kinds != {"mix"}:
                raise ValueError(f"decode_fraction needs mix workloads, got {sorted(kinds) or 'none'}")
            names = [w.name for w in self.workloads]
            if len(set(names)) != len(names):
                raise ValueError("mix names must be unique")
        if self.experiment == "capacity":
            if self.baseline is None:
                raise ValueError("capacity needs baseline: the label of the stock row")
        if self.baseline is not None and self.baseline not in labels:
            raise ValueError(f"baseline {self.baseline!r} is not a server label ({', '.join(labels)})")
        return self

    @property
    def result_name(self) -> str:
        return self.name or self.experiment


def _format(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def parse(data: Any, source: str = "<config>") -> Experiment:
    """Validate a loaded YAML document; :class:`EvalConfigError` on any problem."""
    if not isinstance(data, dict):
        raise EvalConfigError(f"{source}: the config must be a mapping, not {type(data).__name__}")
    try:
        return Experiment.model_validate(data)
    except ValidationError as e:
        raise EvalConfigError(f"{source}: {_format(e)}") from None


def renamed(exp: Experiment, name: str) -> Tuple[Experiment, List[str]]:
    """``exp`` under another result name (``run.py --name``: the same rows measured elsewhere, another GPU say, in
    a file of their own), its ``reuse`` rows measured instead of taken from another experiment's result (that one
    ran on the GPU the config was measured on). Returns the experiment and the labels that lost their ``reuse``.

    Raises:
        EvalConfigError: ``name`` is not a valid result name.
    """
    data = exp.model_dump(exclude_unset=True)
    reused = [s.label for s in exp.servers if s.reuse]
    data["servers"] = [{k: v for k, v in s.items() if k != "reuse"} for s in data["servers"]]
    return parse({**data, "name": name}), reused


def load(path: Union[str, Path]) -> Experiment:
    """Read and validate one experiment YAML file; a ``reuse`` target must
    name a row of an experiment configured in the same folder
    (:func:`check_reuse_targets`).

    Raises:
        EvalConfigError: the file cannot be read, is not valid YAML, fails
            validation, or a ``reuse`` target names no such row.
    """
    path = Path(path)
    exp = parse(_read_yaml(path), str(path))
    check_reuse_targets(exp, path)
    return exp


def _read_yaml(path: Path) -> Any:
    import yaml

    try:
        text = path.read_text()
    except OSError as e:
        raise EvalConfigError(f"{path}: cannot read: {e.strerror}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:  # one line: the problem and where (PyYAML's own text spans several, with the line quoted)
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise EvalConfigError(f"{path}: not valid YAML{where}: {what}") from None


def check_reuse_targets(exp: Experiment, path: Path) -> None:
    """Every ``reuse: <experiment>/<label>`` names an experiment whose config
    sits beside ``path`` (its ``name``, else its ``experiment``) and a label
    of that config: a typo would otherwise only show at run time, as a
    warning, and the row would be measured anew.

    Raises:
        EvalConfigError: naming the row, the target and what exists.
    """
    targets = [(i, s) for i, s in enumerate(exp.servers) if s.reuse]
    if not targets:
        return
    labels: Dict[str, List[str]] = {}
    for other in sorted(path.parent.glob("*.yaml")):
        if other.resolve() == path.resolve():
            labels[exp.result_name] = [s.label for s in exp.servers]
            continue
        try:  # a sibling that does not parse is its own problem: its name and labels as far as they read
            data = _read_yaml(other)
        except EvalConfigError:
            continue
        if isinstance(data, dict):
            name = data.get("name") or data.get("experiment")
            rows = [s.get("label") for s in data.get("servers") or [] if isinstance(s, dict)]
            if isinstance(name, str):
                labels.setdefault(name, []).extend(x for x in rows if isinstance(x, str))
    for i, s in targets:
        other, label = s.reuse.split("/", 1)
        if other not in labels:
            raise EvalConfigError(f"{path}: servers.{i}.reuse: no experiment {other!r} among the configs in {path.parent} "
                                  f"(there: {', '.join(sorted(labels))})")
        if label not in labels[other]:
            raise EvalConfigError(f"{path}: servers.{i}.reuse: {other!r} has no row {label!r} (rows: {', '.join(labels[other])})")
