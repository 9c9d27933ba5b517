"""How many KV tokens the offload pool holds on one GPU, and what bounds it.

One owner for the pool's size: SGLang asks this module (through the
``KVCacheConfigurator._resolve_memory_pool_config`` hook) instead of dividing
its KV budget by the stock cell size. Per token the GPU holds K of every
layer and V of the dense layers; the sparse layers' V lives in host memory.
Fixed costs come first out of SGLang's KV budget (the same bytes stock SGLang
would give its KV pool): the per-request hot buffers, their LRU state, the
prefix staging buffers. SGLang's ``max_total_num_tokens`` then counts what
really fits, so its admission (``PrefillAdder``), retraction and
``max_new_tokens`` clipping are unchanged and never overflow the host pool
(whose rows mirror the token ids one to one).

All quantities are bytes unless named otherwise. Pure arithmetic: CPU-testable
and shared with the benchmark's prediction.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from sglang_elastic.offload.policy import OffloadPolicy

#: V rows per hot-buffer page (``OffloadLayout.hot_page``): hot buffers are pages from one pool, granted as a
#: request's selection grows (``kernels/offload.py`` ``page_grant_run``).
HOT_PAGE = 64

#: ``--kv-offload-hot-slack`` default: hot rows per selected row (the fixed 4,096-row buffers it replaced were
#: twice the largest top-k).
HOT_SLACK = 2.0

#: Host RAM SGLang's host pools leave free (``HICACHE_HOST_MEMORY_RESERVE_BYTES``,
#: sglang/srt/mem_cache/pool_host/base.py); ours keeps the same reserve.
HOST_RESERVE_BYTES = 10 * (1 << 30)


class SizingError(ValueError):
    """The pool cannot hold one request of the context length; the message says why and what to change."""


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Per-rank KV shape: ``layers``, ``kv_heads``, ``head_dim``, ``v_head_dim``,
    ``q_heads``, ``elem`` (bytes per KV element), ``context_len`` (tokens)."""

    layers: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    q_heads: int
    elem: int
    context_len: int


@dataclasses.dataclass(frozen=True)
class OffloadSizing:
    """The result: ``tokens`` (the pool's ``max_total_num_tokens``),
    ``requests`` (``max_running_requests``), ``bound`` (``"hbm"``, ``"host"``
    or ``"max-total-tokens"``), ``tokens_hbm`` / ``tokens_host`` (what each
    side alone would hold), the byte split: ``device_token_bytes`` (per
    token on the GPU), ``device_fixed_bytes`` (hot buffers, their state,
    staging), ``host_token_bytes`` (per token on the host), ``host_bytes``
    (the host pool), ``stock_tokens`` (SGLang's own count for the same
    budget)."""

    tokens: int
    requests: int
    bound: str
    tokens_hbm: int
    tokens_host: int
    device_token_bytes: int
    device_fixed_bytes: int
    host_token_bytes: int
    host_bytes: int
    stock_tokens: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


#: ``--kv-offload-keep-v``'s GPU bytes per token: the scored requests' own index list (int32) and the
#: attended lists' room for a dense request's every position (K id and V row, int32 each).
KEEP_TOKEN_BYTES = 12


def device_token_bytes(shape: ModelShape, policy: OffloadPolicy, resident: bool = False, keep_v: bool = False,
                       hint_by_row: bool = False) -> int:
    """GPU bytes per token: K of every layer, V of the dense layers (of every
    layer when ``resident``), the token's ``loc_slot`` entry per sparse layer
    (int16; none with ``hint_by_row``, whose hint is per request row and position:
    :func:`device_fixed_bytes`) and its share of the decode step's score buffers (a float32 score
    per query head, a summed score and an index); ``keep_v``: :data:`KEEP_TOKEN_BYTES`
    (the kept V rows themselves are pool slots, lent by SGLang's allocator)."""
    dense = shape.layers if resident else min(policy.dense_layers, shape.layers)
    sparse = shape.layers - dense
    k = shape.layers * shape.kv_heads * shape.head_dim * shape.elem
    v = dense * shape.kv_heads * shape.v_head_dim * shape.elem
    hint = 0 if hint_by_row else 2 * sparse
    return k + v + hint + 4 * shape.q_heads + 8 + summary_token_bytes(shape, policy) + (KEEP_TOKEN_BYTES if keep_v and not resident else 0)


def summary_token_bytes(shape: ModelShape, policy: OffloadPolicy) -> int:
    """``estimate``'s GPU bytes per token (0 otherwise): a V summary row per
    sparse layer of the policy and its free-stack entry (int32), per
    ``chunk`` tokens, and the token's attended mark (an int32 stamp: marks are never cleared)."""
    if policy.denominator != "estimate":
        return 0
    sparse = shape.layers - min(policy.dense_layers, shape.layers)
    row = sparse * shape.kv_heads * shape.v_head_dim * shape.elem + 4
    return -(-row // policy.chunk) + 4


def host_token_bytes(shape: ModelShape, policy: OffloadPolicy, resident: bool = False) -> int:
    """Host bytes per token: V of every sparse layer (none when ``resident``)."""
    if resident:
        return 0
    sparse = shape.layers - min(policy.dense_layers, shape.layers)
    return sparse * shape.kv_heads * shape.v_head_dim * shape.elem


def slack_64ths(slack: float) -> int:
    """``slack`` as the integer number of 64ths the kernels use (rounded up: never fewer rows than asked)."""
    import math

    return math.ceil(slack * 64 - 1e-9)


def hot_pages(policy: OffloadPolicy, tokens: int, request_rows: int, hot_tokens: int, slack: float = HOT_SLACK,
              page: int = HOT_PAGE) -> int:
    """Pages of ``page`` V rows (per sparse layer) that cover every running
    request's hot buffer, whatever their lengths, while SGLang holds at most
    ``tokens`` tokens in at most ``request_rows`` rows.

    A request of ``L`` tokens selects ``k(L) <= budget * L`` rows and is
    granted ``ceil(min(hot_tokens, ceil(k * slack)) / page)`` pages
    (:func:`~sglang_elastic.kernels.offload.page_grant_run`): at most
    ``(slack * k + 1) / page + 1`` and at most ``ceil(hot_tokens / page)``.
    Summed over requests whose lengths add up to ``tokens`` or less, that is
    at most the smaller of the two counts below, so a grant never finds the
    pool empty.
    """
    s = slack_64ths(slack) / 64
    num = round(policy.budget_frac * 1_000_000)
    by_tokens = -(-(int(-(-(tokens * num * s) // 1_000_000)) + request_rows) // page) + request_rows
    by_rows = request_rows * -(-hot_tokens // page)
    return max(1, min(by_tokens, by_rows))


def device_fixed_bytes(shape: ModelShape, policy: OffloadPolicy, hot_tokens: int, requests: int, resident: bool = False,
                       slack: float = HOT_SLACK, tokens: int = 0, keep_v: bool = False, hint_by_row: bool = False) -> int:
    """GPU bytes beside K and the dense layers' V of ``tokens`` tokens: per
    request row (``requests`` + SGLang's padding row) and sparse layer,
    ``sink + window`` fixed V rows and ``hot_tokens`` slots' position and
    time (int32 each), the hot-buffer pages that ``tokens`` need
    (:func:`hot_pages`; none when ``resident``); the prefix staging buffers
    (K and V of one layer for the context length); ``estimate``'s V
    summaries (:func:`summary_bytes`); ``keep_v``: the kept V rows' table (int32 per
    request row and position of the context) and kept lengths; ``hint_by_row`` (SGLang's radix cache
    on): the hot buffers' slot hint per sparse layer, request row and position of the context (int16)."""
    sparse = 0 if resident else shape.layers - min(policy.dense_layers, shape.layers)
    rows = requests + 1
    row_bytes = sparse * shape.kv_heads * shape.v_head_dim * shape.elem
    v_rows = (rows * (policy.sink + policy.window) + (hot_pages(policy, tokens, rows, hot_tokens, slack) * HOT_PAGE if sparse else 0)
              + 1) * row_bytes
    state = rows * hot_tokens * sparse * 8 + rows * (-(-hot_tokens // HOT_PAGE) + 1) * 4
    staging = shape.context_len * shape.kv_heads * (shape.head_dim + shape.v_head_dim) * shape.elem
    keep = (rows * (shape.context_len + 1) * 4) if keep_v and not resident else 0
    hint = rows * shape.context_len * sparse * 2 if hint_by_row else 0
    return v_rows + state + staging + summary_bytes(shape, policy, requests) + keep + hint


def summary_bytes(shape: ModelShape, policy: OffloadPolicy, requests: int, max_splits: int = 32) -> int:
    """``estimate``'s fixed GPU bytes (0 otherwise): the slot table (int32 per
    request row and chunk of the context), one slot more per request row and
    two spare slots (V rows of every sparse layer), and the estimate's float32
    partials (``max_splits`` per request row). The slots themselves grow with
    the token count (:func:`summary_token_bytes`)."""
    if policy.denominator != "estimate":
        return 0
    sparse = shape.layers - min(policy.dense_layers, shape.layers)
    rows = requests + 1
    table = rows * -(-shape.context_len // policy.chunk) * 4
    spare = (rows + 2) * sparse * shape.kv_heads * shape.v_head_dim * shape.elem
    partials = rows * max_splits * shape.q_heads * shape.head_dim * 4
    return table + spare + partials


def size_pool(
    available_bytes: int, shape: ModelShape, policy: OffloadPolicy, hot_tokens: int, requests: int,
    host_available_bytes: int, host_limit_bytes: Optional[int] = None, max_total_tokens: Optional[int] = None,
    page_size: int = 1, resident: bool = False, slack: float = HOT_SLACK, keep_v: bool = False, hint_by_row: bool = False,
) -> OffloadSizing:
    """The offload pool's size for a KV budget.

    Args:
        available_bytes: SGLang's KV budget on this GPU (``_profile_available_bytes``:
            free memory after the weights less the activation reserve).
        shape: the model's per-rank KV shape.
        policy: the attended-set rule (its ``dense_layers`` keep V on the GPU).
        hot_tokens: the most hot-buffer rows one request may hold per sparse layer.
        requests: ``max_running_requests`` (hot buffers are per request).
        host_available_bytes: free host RAM now (``psutil.virtual_memory().available``);
            :data:`HOST_RESERVE_BYTES` of it stays free.
        host_limit_bytes: ``--kv-offload-host-gb`` as bytes (a cap), or None.
        max_total_tokens: SGLang's ``--max-total-tokens`` cap, or None.
        page_size: the token count is a multiple of it.
        resident: the exactness reference (V of every layer on the GPU, no host pool).
        slack: hot-buffer rows per selected row (``--kv-offload-hot-slack``): the
            pages come with the tokens (:func:`hot_pages`), not per request row.
        keep_v: ``--kv-offload-keep-v`` (its tables and lists: :data:`KEEP_TOKEN_BYTES`).
        hint_by_row: the hot buffers' slot hint per request row and position, not per token id
            (SGLang's radix cache on: :class:`~sglang_elastic.offload.pool.OffloadLayout`).

    Returns:
        :class:`OffloadSizing`.

    Raises:
        SizingError: when the pool would hold less than one request of
            ``shape.context_len`` tokens (names the bound and the flag to change),
            when ``policy.dense_layers`` leaves no sparse layer, or ``requests < 1``.
    """
    if requests < 1:
        raise SizingError(f"--max-running-requests must be >= 1 with --enable-kv-offload, not {requests}")
    if not resident and policy.dense_layers >= shape.layers:
        raise SizingError(f"--kv-offload-dense-layers {policy.dense_layers} leaves none of the model's {shape.layers} layers sparse: "
                          f"nothing would be offloaded (use at most {shape.layers - 1})")
    per_dev = device_token_bytes(shape, policy, resident, keep_v, hint_by_row)
    per_host = host_token_bytes(shape, policy, resident)
    tokens_hbm = _tokens_that_fit(available_bytes, shape, policy, hot_tokens, requests, resident, slack, per_dev, keep_v,
                                  hint_by_row) - page_size
    tokens_hbm = max(0, tokens_hbm)
    fixed = device_fixed_bytes(shape, policy, hot_tokens, requests, resident, slack, tokens_hbm + page_size, keep_v, hint_by_row)
    host_budget = host_available_bytes - HOST_RESERVE_BYTES
    if host_limit_bytes is not None:
        host_budget = min(host_budget, host_limit_bytes)
    tokens_host = max(0, host_budget // per_host - page_size) if per_host else tokens_hbm
    tokens, bound = (tokens_hbm, "hbm") if tokens_hbm <= tokens_host else (tokens_host, "host")
    if max_total_tokens is not None and max_total_tokens < tokens:
        tokens, bound = max_total_tokens, "max-total-tokens"
    tokens = tokens // page_size * page_size
    fixed = device_fixed_bytes(shape, policy, hot_tokens, requests, resident, slack, tokens + page_size, keep_v, hint_by_row)
    cell = shape.layers * shape.kv_heads * (shape.head_dim + shape.v_head_dim) * shape.elem
    stock = available_bytes // cell // page_size * page_size
    if tokens < shape.context_len:
        why = {
            "hbm": f"the GPU holds K of only {tokens_hbm} tokens after {fixed / 2**30:.1f} GiB of hot buffers for {requests} requests "
                   f"(each request keeps {policy.sink} + {policy.window} sink and window V rows per sparse layer; lower --kv-offload-sink / "
                   "--kv-offload-window, --kv-offload-hot-slack, --max-running-requests or --kv-offload-hot-tokens, or --context-length)",
            "host": f"host memory holds V of only {tokens_host} tokens ({max(host_budget, 0) / 2**30:.1f} GiB usable after a "
                    f"{HOST_RESERVE_BYTES >> 30} GiB reserve; raise --kv-offload-host-gb or free host RAM, or lower --context-length)",
            "max-total-tokens": f"--max-total-tokens {max_total_tokens} is below the context length",
        }[bound]
        raise SizingError(f"--enable-kv-offload: the pool would hold {tokens} tokens, less than one {shape.context_len}-token request: {why}")
    return OffloadSizing(
        tokens=tokens, requests=requests, bound=bound, tokens_hbm=tokens_hbm, tokens_host=tokens_host,
        device_token_bytes=per_dev, device_fixed_bytes=fixed, host_token_bytes=per_host,
        host_bytes=(tokens + page_size) * per_host, stock_tokens=stock,
    )


def _tokens_that_fit(available: int, shape: ModelShape, policy: OffloadPolicy, hot_tokens: int, requests: int, resident: bool,
                     slack: float, per_dev: int, keep_v: bool = False, hint_by_row: bool = False) -> int:
    """The most tokens ``T`` with ``T * per_dev + device_fixed_bytes(.., T) <= available``
    (the fixed bytes grow with ``T`` through the hot pages): a bisection."""
    lo, hi = 0, max(0, available // max(per_dev, 1)) + 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if mid * per_dev + device_fixed_bytes(shape, policy, hot_tokens, requests, resident, slack, mid, keep_v, hint_by_row) <= available:
            lo = mid
        else:
            hi = mid - 1
    return lo


__all__ = ["HOST_RESERVE_BYTES", "HOT_PAGE", "KEEP_TOKEN_BYTES", "HOT_SLACK", "hot_pages", "slack_64ths", "ModelShape", "OffloadSizing", "SizingError", "device_fixed_bytes", "device_token_bytes",
           "host_token_bytes", "size_pool", "summary_bytes", "summary_token_bytes"]
