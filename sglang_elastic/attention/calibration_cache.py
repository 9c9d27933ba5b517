"""Per-shape decode calibrations, cached on disk by layer shape and GPU.

The policy's constants describe one layer shape on one GPU: a calibration
fitted on Llama-3.1-8B (32 query / 8 KV heads) picks split where FlashInfer is
faster on Qwen2.5-7B (28 / 4). So a calibration is keyed by
:class:`ShapeKey` (GPU name and SM count; q heads, KV heads and head_dim per
tensor-parallel rank; KV dtype; page size) and used only for that key:

1. ``--decode-calibration PATH``: the user's file, as given (a warning when
   its recorded shape is another);
2. the cache (:class:`CalibrationCache`): a file written by the startup
   measurement on this GPU for this shape
   (:func:`sglang_elastic.attention.calibrate.calibrate_shape`);
3. a shipped file (``calibration/*.json``) whose ``gpu`` and ``shape`` cover
   the key (the H200 file: 32 / 8 heads, head_dim 128, bf16, pages 16 and 1);
4. else :func:`prior_calibration`: the cost model with the same constants for
   every path, so only the structure of each path's plan (FlashInfer's split
   rule, stragglers, waves, the merge) decides, with a wider margin towards
   FlashInfer (the stock path). The startup measurement replaces it with this
   shape's own constants and caches them.

Cache directory: ``--decode-calibration-cache DIR``, else
``$SGLANG_ELASTIC_CACHE_DIR/decode``, else ``$XDG_CACHE_HOME/sglang_elastic/decode``
(``~/.cache/sglang_elastic/decode``). One JSON per key, named by
:meth:`ShapeKey.file_name`, holding the calibration and its ``key``: a file
whose stored key is not the one asked for is never used (renamed or hand-copied
files included).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Optional, Sequence, Tuple

from sglang_elastic.attention.policy import (
    CALIBRATION_DIR, DTYPES, PATHS, SHIPPED, Calibration, CalibrationError, PathCost, calibration_from_dict,
)

logger = logging.getLogger(__name__)

CACHE_ENV = "SGLANG_ELASTIC_CACHE_DIR"
#: Margin of the prior: ours must be predicted this much faster than FlashInfer.
PRIOR_MARGIN = 0.08


@dataclasses.dataclass(frozen=True)
class ShapeKey:
    """What a calibration is valid for (per tensor-parallel rank).

    Raises:
        ValueError: a field out of range (the message names it).
    """

    gpu: str
    sm_count: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: str  # "bfloat16" / "float16"
    page_size: int

    def __post_init__(self):
        for f in ("sm_count", "q_heads", "kv_heads", "head_dim", "page_size"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ShapeKey.{f} must be a positive integer, not {v!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"ShapeKey.dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if not self.gpu:
            raise ValueError("ShapeKey.gpu must name the GPU")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def shape(self) -> dict:
        """The calibration ``shape`` object of this key."""
        return {"q_heads": self.q_heads, "kv_heads": self.kv_heads, "head_dim": self.head_dim, "dtype": self.dtype,
                "page_sizes": [self.page_size]}

    def file_name(self) -> str:
        gpu = re.sub(r"[^a-z0-9]+", "-", self.gpu.lower()).strip("-")
        return (f"{gpu}-sm{self.sm_count}_q{self.q_heads}-kv{self.kv_heads}-d{self.head_dim}_"
                f"{self.dtype}_page{self.page_size}.json")


def covers(calib: Calibration, key: ShapeKey) -> bool:
    """Whether ``calib`` was measured on ``key``'s GPU and layer shape."""
    s = calib.shape
    return (s is not None and calib.gpu == key.gpu and calib.sm_count == key.sm_count
            and (s["q_heads"], s["kv_heads"], s["head_dim"], s["dtype"]) == (key.q_heads, key.kv_heads, key.head_dim, key.dtype)
            and key.page_size in s["page_sizes"])


def default_cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root) / "decode"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "sglang_elastic" / "decode"


class CalibrationCache:
    """One calibration JSON per :class:`ShapeKey` under ``root``."""

    def __init__(self, root: Optional[os.PathLike] = None):
        self.root = Path(root) if root is not None else default_cache_dir()

    def path(self, key: ShapeKey) -> Path:
        return self.root / key.file_name()

    def load(self, key: ShapeKey) -> Optional[Calibration]:
        """The cached calibration of ``key``, or ``None`` (no file, a file for
        another key, or one that does not validate: logged, never raised, a
        cache must not stop a server)."""
        p = self.path(key)
        try:
            d = json.loads(p.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            logger.warning("persistentkv: ignoring unreadable calibration cache file %s: %s", p, e)
            return None
        if not isinstance(d, dict) or d.get("key") != key.to_json():
            logger.warning("persistentkv: ignoring calibration cache file %s: it holds key %s, not %s", p,
                           d.get("key") if isinstance(d, dict) else None, key.to_json())
            return None
        try:
            cd = d["calibration"]
            if isinstance(cd, dict) and not cd.get("fit_rms_rel_err") and isinstance(d.get("fit_rms_rel_err"), dict):
                # a file written before the calibration carried its fit errors (they were beside it): the policy's
                # margin needs them, or a refit's error would be traded at the flat margin
                cd = {**cd, "fit_rms_rel_err": {q: min(1.0, round(float(e), 4)) for q, e in d["fit_rms_rel_err"].items()}}
            calib = calibration_from_dict(cd, where=str(p))
        except (CalibrationError, KeyError, TypeError, ValueError) as e:
            logger.warning("persistentkv: ignoring calibration cache file %s: %s", p, e)
            return None
        if not covers(calib, key):
            logger.warning("persistentkv: ignoring calibration cache file %s: its calibration is for %s %s", p, calib.gpu, calib.shape)
            return None
        return calib

    def store(self, key: ShapeKey, calib: Calibration, extra: Optional[dict] = None) -> Path:
        """Write ``calib`` for ``key`` (atomically: a reader sees the old file or the new).

        Raises:
            ValueError: ``calib`` does not cover ``key`` (its gpu / shape say otherwise).
            OSError: the directory cannot be written.
        """
        if not covers(calib, key):
            raise ValueError(f"calibration for {calib.gpu} {calib.shape} cannot be cached under {key}")
        self.root.mkdir(parents=True, exist_ok=True)
        p = self.path(key)
        d = {"key": key.to_json(), "calibration": calib.to_json(), **(extra or {})}
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=p.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(d, f, indent=2)
                f.write("\n")
            os.replace(tmp, p)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return p


def shipped_calibrations() -> list:
    """The calibration files shipped in the package (those that validate), in :data:`SHIPPED` order."""
    from sglang_elastic.attention.policy import load_calibration

    out = []
    for name in SHIPPED:
        if (CALIBRATION_DIR / name).is_file():
            out.append(load_calibration(CALIBRATION_DIR / name))
    return out


def prior_calibration(key: ShapeKey, base: Optional[Calibration] = None) -> Calibration:
    """The cost-model prior for a key no measurement covers.

    Every path gets the same constants (``base``'s FlashInfer ones when
    ``base`` is for the same GPU, else neutral ones), so the paths differ
    only by their plans' structure; the margin is :data:`PRIOR_MARGIN`.
    Kernel configs (``split`` / ``compact``) are ``base``'s.
    """
    if base is not None and base.gpu == key.gpu and base.sm_count == key.sm_count:
        ref = base.paths["flashinfer"]
    else:
        ref = PathCost(launch_us=20.0, bw_tbps=3.0, cta_gbps=30.0, ctas_per_sm=2)
    kw = {} if base is None else {"split": base.split, "compact": base.compact, "merge_tbps": base.merge_tbps}
    return Calibration(gpu=key.gpu, sm_count=key.sm_count, paths={p: ref for p in PATHS}, margin=max(PRIOR_MARGIN, base.margin if base else 0.0),
                       provisional=True, source=f"prior: equal constants for every path (no measurement for {key.file_name()})",
                       shape=None, **kw)


def resolve(key: ShapeKey, explicit: Optional[Calibration] = None, cache: Optional[CalibrationCache] = None,
            shipped: Optional[Sequence[Calibration]] = None) -> Tuple[Calibration, str]:
    """The calibration for ``key`` and where it came from: ``explicit``,
    ``cache``, ``shipped`` or ``prior`` (module docstring's order)."""
    if explicit is not None:
        if explicit.shape is not None and not covers(explicit, key):
            logger.warning("persistentkv: --decode-calibration was measured on %s %s, this server runs %s: its choices may be off",
                           explicit.gpu, explicit.shape, key)
        return explicit, "explicit"
    if cache is not None:
        c = cache.load(key)
        if c is not None:
            return c, "cache"
    ship = shipped_calibrations() if shipped is None else list(shipped)
    for c in ship:
        if covers(c, key):
            return c, "shipped"
    base = next((c for c in ship if c.gpu == key.gpu), ship[0] if ship else None)
    return prior_calibration(key, base), "prior"
