"""Paged generation: mlx-lm's generate and stream_generate, the frozen weights
paged from the SSD under the same memory budget as training.

    from mlx_lm import generate
    from mlx_pager.generate import load_paged
    model, tokenizer = load_paged("path/to/model", adapter_path="adapters",
                                  memory_budget="8GB", ssd_cache_dir="/tmp/mlx-pager-cache")
    print(generate(model, tokenizer, "hello", max_tokens=100))

``load_paged`` loads the model as ``mlx_lm.load(path, adapter_path=...)``
does (adapters applied by mlx-lm's own ``load_adapters``, resident), hands its
frozen weights to the pager (store.py) and returns a ``PagedModel``: an object
that mlx-lm's generation functions call like the model itself
(``model(tokens, cache=cache)``), which runs the forward pass block by block:

  record   the model's own ``__call__`` with recording stand-ins for its
           blocks (step.py): the embedding output and each block's call
           arguments (mask, its KV cache), for any architecture that calls
           the blocks of ``model.layers`` in order;
  blocks   for each block i: page it in, run it on the whole input (a prompt
           chunk: layer-major, one read of the block per chunk; or the one
           token of a decode step), evaluate its output AND its cache state,
           page it out. Only the pages the budget allows are ever in memory;
  head     the model's ``__call__`` again with the last block replaced by a
           stand-in returning the last hidden state: final norm, LM head and
           softcapping are the model's own; the logits stay lazy, as mlx-lm
           expects (prefill chunks' logits are never computed).

Where the page budget holds every block at once (nothing to page), a call
binds them all, builds the whole forward graph and returns it unevaluated,
as the model itself would: mlx-lm's generate_step then evaluates it with
``mx.async_eval`` while it builds the next token's graph, which a forward
evaluated block by block cannot overlap (bench_generate, 100%).

The pager's schedule is the cyclic order of the blocks, repeating: every
prompt chunk and every decode step sweeps them in order, so Belady's MIN
keeps about k-1 of the k pages the budget holds resident from one token to
the next (LRU keeps none on a cyclic order) and reads the rest each token;
readahead starts a read as soon as MIN would allow it.

The memory plan (budget.py's MemoryPlan) holds the process baseline, the
resident page, the adapters, the KV cache (sized from the model config for
the tokens to be held, grown, with the page budget shrunk, when a call needs
more) and one prompt chunk's working set; the pages get what is left. The
governor (governor.py) checks the process's RSS after every block (after
every call where nothing is paged).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import carry, heap, step
from .budget import CACHE_SLACK, BudgetError, MemoryPlan, baseline_spread, format_size, parse_size
from .checks import check_backend_ops, check_blocks_unpatched, check_budget_fits, check_pageable, load_tokenizer
from .governor import Governor, process_rss
from .layers import BlockList
from .memlimit import budget_named, budget_or_default, raise_advice
from .session import model_path_of, plan_slack
from .simulate import waited
from .store import PagedWeights

KV_STEP = 256  # mlx-lm's KVCache grows its buffers in steps of this many tokens
DEFAULT_KV_TOKENS = 2048  # reserved at load time; grown on demand


class ModelNotFound(FileNotFoundError):
    """The model (or adapter) path does not exist; the message says what to pass."""


# ------------------------------------------------------------ sizing helpers --
def _config_get(config: dict, *names, default=None):
    for c in (config, config.get("text_config") or {}):
        for n in names:
            if c.get(n) is not None:
                return c[n]
    return default


def kv_bytes_per_token(config: dict, itemsize: int) -> int:
    """Bytes of keys and values one token adds to the cache, over all layers
    (standard multi-head / grouped-query attention; an upper bound for
    models that cache less, e.g. sliding-window layers)."""
    layers = int(_config_get(config, "num_hidden_layers", "n_layer", default=32))
    heads = int(_config_get(config, "num_attention_heads", "n_head", default=32))
    kv_heads = int(_config_get(config, "num_key_value_heads", default=heads))
    hidden = int(_config_get(config, "hidden_size", "d_model", default=4096))
    head_dim = int(_config_get(config, "head_dim", default=hidden // max(1, heads)) or hidden // heads)
    return 2 * layers * kv_heads * head_dim * itemsize


def kv_cache_bytes(config: dict, itemsize: int, tokens: int) -> int:
    """The KV cache for `tokens` tokens as mlx-lm allocates it (buffers grown
    in steps of 256 tokens), plus one layer's copy while a buffer grows."""
    cap = KV_STEP * math.ceil(max(1, tokens) / KV_STEP)
    per_layer = kv_bytes_per_token(config, itemsize) // max(1, int(_config_get(config, "num_hidden_layers", default=1)))
    return kv_bytes_per_token(config, itemsize) * cap + per_layer * (cap + KV_STEP)


# The fewest prompt tokens a prefill chunk holds where the budget is tight.
MIN_PREFILL_CHUNK = 16


def chunk_working_set(config: dict, tokens: int, context: int) -> int:
    """A conservative estimate of one block's working set for a chunk of
    `tokens` new tokens attending over `context` tokens (float32 at worst):
    hidden- and MLP-sized temporaries and the attention scores."""
    d = int(_config_get(config, "hidden_size", default=4096))
    f = int(_config_get(config, "intermediate_size", default=4 * d))
    heads = int(_config_get(config, "num_attention_heads", default=32))
    vocab = int(_config_get(config, "vocab_size", default=32000))
    return tokens * (16 * d + 6 * f) * 4 + 2 * heads * tokens * max(context, tokens) * 4 + 4 * vocab * 4


def min_reads_per_sweep(footprints: List[int], page_budget: int, sweeps: Optional[int] = None) -> int:
    """Bytes Belady's MIN reads per sweep of the blocks in steady state, for
    a cyclic schedule (every prompt chunk and decode step sweeps the blocks
    in order), each page charged its footprint against the byte budget.

    On a cyclic order MIN does not keep a fixed hot set: the pages it keeps
    rotate, and the reads per sweep alternate (n equal pages, room for k:
    n(n-k)/(n-1) on average, e.g. 8.53 of 16 pages with room for 8, where a
    fixed set of k-1 hot pages reads 9). So this is the average over
    `sweeps` sweeps (default 2n + 2), leaving out the first (cold) and the
    last (MIN knows the sequence ends there)."""
    n = len(footprints)
    sweeps = sweeps or 2 * n + 2
    seq = list(range(n)) * sweeps
    nxt, last = [0] * len(seq), {}
    for t in range(len(seq) - 1, -1, -1):
        nxt[t] = last.get(seq[t], 10**9 + t)
        last[seq[t]] = t
    cache, used, per_sweep = {}, 0, [0] * sweeps
    for t, pg in enumerate(seq):
        if pg not in cache:
            per_sweep[t // n] += footprints[pg]
            while cache and used + footprints[pg] > page_budget:
                victim = max(cache, key=cache.get)
                used -= footprints[victim]
                del cache[victim]
            used += footprints[pg]
        cache[pg] = nxt[t]
    steady = per_sweep[1:-1]
    return round(sum(steady) / len(steady))


# ------------------------------------------------------------- the model --
@dataclass
class CallStats:
    """One call of the paged model: a prompt chunk (tokens > 1) or a decode
    step. `seconds`: from this call to the next one (its graph, its
    evaluation, whatever the caller does with the logits: what a token costs
    the caller, however much of the graph is evaluated inside the call);
    None until the next call."""

    tokens: int
    started: float
    bytes_read: int
    pages_read: int
    seconds: Optional[float] = None
    # what the call waited for the pager (reads, room), inside the call
    wait_s: float = 0.0


@dataclass
class PagedGeneration:
    """What the paged model did so far (see PagedModel.summary)."""

    calls: List[CallStats] = field(default_factory=list)


def _cache_arrays(args, kwargs) -> list:
    """The arrays of every cache object among a block's call arguments, so
    that its update is evaluated while the block's weights are in memory."""
    out = []
    for v in list(args) + list(kwargs.values()):
        if v is None or isinstance(v, (mx.array, str, int, float, bool)):
            continue
        state = getattr(v, "state", None)
        if state is not None:
            out.extend(a for _, a in tree_flatten(state) if isinstance(a, mx.array))
    return out


def _offset(cache) -> int:
    if not cache:
        return 0
    return max((int(getattr(c, "offset", 0) or 0) for c in cache), default=0)


class PagedModel:
    """An mlx-lm model whose blocks are paged: call it as the model
    (``model(tokens, cache=cache, **kwargs)``), pass it to
    ``mlx_lm.generate`` / ``mlx_lm.stream_generate``. Every other attribute
    (``layers``, ``make_cache``, ``args``, ...) is the wrapped model's."""

    def __init__(
        self,
        model: nn.Module,
        weights: PagedWeights,
        plan: MemoryPlan,
        config: dict,
        act_itemsize: int,
        prefill_step_size: int,
        kv_tokens: int,
        page_budget: Optional[int] = None,
    ):
        self.model = model
        self.weights = weights
        self.plan = plan
        self.config = config
        self.act_itemsize = act_itemsize
        self.blocks = BlockList(model).blocks()
        self.stats = PagedGeneration()
        self.requested_chunk = max(1, int(prefill_step_size))
        self.prefill_chunk = self.requested_chunk
        self.kv_tokens = 0
        self.chunk_bytes = 0  # the prompt chunk's working set (reserve)
        self.cache_limit: Optional[int] = None  # MLX's, as _use_cache set it
        self.gov: Optional[Governor] = None
        # Benchmarks and tests: exactly this many bytes of pages besides the
        # rest of the plan (the memory budget follows from it).
        self.fixed_page_budget = None if page_budget is None else parse_size(page_budget, "page_budget")
        self._pinned = weights.page_charge_bound(weights.resident_id)
        self.reserve(kv_tokens)  # sizes KV cache and prompt chunk, checks the budget
        self.gov = Governor(plan, weights.pager, pinned_bytes=self._pinned)
        weights.pager.set_budget(int(self._pinned + plan.page_budget))

    def __getattr__(self, name):
        # Only called for attributes not found on PagedModel itself.
        if name in ("model", "__setstate__"):
            raise AttributeError(name)
        return getattr(self.model, name)

    # ------------------------------------------------------------ budget --
    def reserve(self, kv_tokens: int, prefill_step_size: Optional[int] = None) -> None:
        """Sizes the plan for a KV cache of `kv_tokens` tokens and prompt
        chunks of at most `prefill_step_size` tokens (shrunk to fit), and
        sets the page budget to what is left. Raises BudgetError, naming the
        minimum, when one block page no longer fits."""
        if prefill_step_size is not None:
            self.requested_chunk = max(1, int(prefill_step_size))
        p = self.plan
        kv = kv_cache_bytes(self.config, self.act_itemsize, kv_tokens)
        # The prompt chunk may use a quarter of what is left after the rest,
        # or one block page's worth, but never the room one block page needs
        # (and never less than it needs for MIN_PREFILL_CHUNK tokens): pages
        # come first. (Up to session 51 it could take one page's worth where
        # that left no page: a 4-bit MoE whose 512-token chunk reserved 212
        # MB was refused at 1.2 GB and told to give 1.57 GB, where chunks of
        # 16 tokens generate within 1.3 GB.)
        free = p.budget - p.fixed_without_activations - kv
        allowance = min(max(p.max_page, free // 4), free - p.max_page)
        chunk = self.requested_chunk
        while (
            self.fixed_page_budget is None
            and chunk > MIN_PREFILL_CHUNK
            and chunk_working_set(self.config, chunk, kv_tokens) > allowance
        ):
            chunk = max(MIN_PREFILL_CHUNK, chunk // 2)
        self.chunk_bytes = chunk_working_set(self.config, chunk, kv_tokens)
        p.activations = kv + self.chunk_bytes
        if self.fixed_page_budget is not None:
            p.budget = p.fixed + self.fixed_page_budget
            if self.fixed_page_budget < p.max_page:
                W = self.weights
                parts = f" in {W.pages_per_block} parts" if W.pages_per_block > 1 else ""
                raise BudgetError(
                    f"page_budget {self.fixed_page_budget} ({format_size(self.fixed_page_budget)}) does not hold "
                    f"one block: the largest block's pages may take {p.max_page} bytes{parts}. Raise page_budget "
                    f"to at least {p.max_page} ({format_size(p.max_page, up=True)}), or leave it out (the memory "
                    "budget plans the pages)."
                )
        if p.page_budget < p.max_page:
            # The least budget: the one whose chunk shrinks to its least.
            least_chunk = min(chunk, MIN_PREFILL_CHUNK)
            p.activations = kv + chunk_working_set(self.config, least_chunk, kv_tokens)
            chunk, need = least_chunk, p.least
            raise BudgetError(
                f"{budget_named(p.budget, p.given)} is too small to generate with this model: "
                f"it needs at least {format_size(need, up=True)} (one block page {format_size(p.max_page)} + "
                f"resident set (embeddings, norm, head) {format_size(p.resident)} + adapters "
                f"{format_size(p.trainable)} + KV cache for {kv_tokens} tokens {format_size(kv)} + "
                f"a {chunk}-token prompt chunk {format_size(p.activations - kv)} + process "
                f"{format_size(p.baseline)} + its spread from run to run {format_size(baseline_spread(p.baseline))} "
                f"+ slack {format_size(p.slack)}). "
                f"{raise_advice(int(need * 1.05), p.given)}, or lower --max-tokens or the prompt length."
            )
        self.kv_tokens, self.prefill_chunk = kv_tokens, chunk
        if self.gov is not None:
            self.weights.pager.set_budget(int(self._pinned + p.page_budget))

    @property
    def page_budget(self) -> int:
        return self.plan.page_budget

    # ------------------------------------------------------------ forward --
    def __call__(self, inputs: mx.array, cache=None, **kwargs) -> mx.array:
        T = inputs.shape[1]
        need = _offset(cache) + T
        if cache is not None and need > self.kv_tokens:
            self.reserve(KV_STEP * math.ceil(need / KV_STEP))
        if T <= self.prefill_chunk:
            return self._forward(inputs, cache, kwargs)
        # A prompt longer than the planned chunk: chunk by chunk, each
        # chunk through all blocks (its logits stay lazy, as mlx-lm leaves
        # a prefill's logits unevaluated).
        emb = kwargs.pop("input_embeddings", None)
        parts = []
        for t0 in range(0, T, self.prefill_chunk):
            t1 = min(T, t0 + self.prefill_chunk)
            kw = dict(kwargs)
            if emb is not None:
                kw["input_embeddings"] = emb[:, t0:t1]
            parts.append(self._forward(inputs[:, t0:t1], cache, kw))
        return mx.concatenate(parts, axis=1)

    def holds_all(self) -> bool:
        """Whether the page budget, as the governor leaves it now, holds
        every block's pages at once."""
        W = self.weights
        return sum(W.block_charge_bound(i) for i in range(W.num_blocks)) <= step.page_room(W)

    def _use_cache(self, holds_all: bool) -> None:
        """MLX's cache of freed buffers: where nothing is paged, room for the
        prompt chunk's working set, which the plan holds for it anyway. On the
        CPU backend every op's output is a malloc, and the trainer's
        M_MMAP_THRESHOLD (heap.serve_large_by_mmap) makes each one
        not cached a fresh mapping: a prompt chunk ran at ~0.87x mlx-lm's speed
        with the default 32 MB (the governor's 48 MB), at mlx-lm's with this.
        Where pages stream, the governor's small cache: freed page frames
        then go back to the OS, not into MLX's cache beside the budget."""
        limit = CACHE_SLACK + (self.chunk_bytes if holds_all else 0)
        if limit != self.cache_limit:
            mx.set_cache_limit(int(limit))
            if self.cache_limit is not None and limit < self.cache_limit:
                mx.clear_cache()
            self.cache_limit = limit

    def _forward(self, inputs, cache, kwargs) -> mx.array:
        model, L = self.model, len(self.blocks)
        pager = self.weights.pager
        before = pager.stats()
        tic = time.perf_counter()
        calls_so_far = self.stats.calls
        if calls_so_far and calls_so_far[-1].seconds is None:
            calls_so_far[-1].seconds = tic - calls_so_far[-1].started
        # Each block's call arguments (mask, its own KV cache); the logits of
        # this recording pass are never evaluated.
        h, calls = step.record_calls(model, inputs, per_block_state=True, cache=cache, **kwargs)
        carries = carry.Carries(calls)
        extras = {}  # what blocks pass later ones besides h (carry.py), until their last consumer
        holds_all = self.holds_all()
        self._use_cache(holds_all)
        if holds_all:
            # Nothing to page: the model's own lazy graph, its arrays the
            # pages' (they stay valid once released: a page evicted while a
            # graph views it is freed when the graph lets go).
            with self.weights.bound(*range(L)):
                for i in range(L):
                    link = carry.link(carries, i, extras)
                    h = carry.kept(step.run_linked(self.blocks[i], h, calls[i], link), link, extras)
                extras = None
                if inputs.shape[1] > 1:
                    # A prompt chunk: its cache evaluated here, as block by
                    # block (mlx-lm evaluates it next anyway; the chunk's time
                    # is its own). Not its output: a prefill never uses the
                    # last block's, which mlx-lm then never computes (the last
                    # block's attention output and MLP, 1/L of the chunk);
                    # a caller that wants the logits evaluates them.
                    mx.eval([_cache_arrays(*c) for c in calls])
            calls = None
            self.gov.check()
        else:
            for i in range(L):
                args, kw = calls[i]
                link = carry.link(carries, i, extras)
                with self.weights.bound(i):
                    h = carry.kept(step.run_linked(self.blocks[i], h, (args, kw), link), link, extras)
                    mx.eval(h, _cache_arrays(args, kw), carry.kept_arrays(link, extras))
                del args, kw, link
                carry.forget(carries, [extras], upto=i)
                calls[i] = None
                self.gov.check()
        logits = step.head_call(model, inputs, h, cache=cache, **kwargs)
        after = pager.stats()
        calls_so_far.append(
            CallStats(
                inputs.shape[1],
                tic,
                after["bytes_read"] - before["bytes_read"],
                after["pages_read"] - before["pages_read"],
                wait_s=waited(after) - waited(before),
            )
        )
        return logits

    # ------------------------------------------------------------ reports --
    def min_bytes_per_token(self) -> int:
        """Belady's minimum of bytes read per decode step for the page budget."""
        fps = [self.weights.page_footprint(p) for p in self.weights.page_order]
        return min_reads_per_sweep(fps, self.plan.page_budget)

    def summary(self, read_rate: Optional[float] = None, skip: int = 1) -> dict:
        """Prefill and decode figures from the calls so far (decode: one-token
        calls after the first `skip`, which warm the pages up)."""
        timed = [c for c in self.stats.calls if c.seconds is not None]  # all but the last
        prefill = [c for c in timed if c.tokens > 1]
        decode = [c for c in timed if c.tokens == 1][skip:]
        out = {
            "paged_bytes": self.weights.paged_bytes,
            "page_budget": self.plan.page_budget,
            "memory_budget": self.plan.budget,
            "prefill_tokens": sum(c.tokens for c in prefill),
            "prefill_s": sum(c.seconds for c in prefill),
            "prefill_bytes": sum(c.bytes_read for c in prefill),
            "decode_tokens": len(decode),
            "decode_s": sum(c.seconds for c in decode),
            "decode_bytes": sum(c.bytes_read for c in decode),
            "decode_wait_s": sum(c.wait_s for c in decode),
            "min_bytes_per_token": self.min_bytes_per_token(),
            "peak_rss": self.gov.peak_rss if self.gov else process_rss(),
        }
        out["decode_bytes_per_token"] = out["decode_bytes"] / max(1, len(decode))
        out["decode_s_per_token"] = out["decode_s"] / max(1, len(decode))
        if read_rate:
            out["read_rate"] = read_rate
            out["bound_s_per_token"] = out["min_bytes_per_token"] / read_rate
        return out


# --------------------------------------------------------------- loading --
def resolve_model_path(model: str) -> Path:
    """The local directory of `model`, or ModelNotFound with what to pass."""
    try:
        return model_path_of(model)
    except FileNotFoundError as e:
        raise ModelNotFound(str(e)) from None


def _check_adapter_path(adapter_path) -> Path:
    p = Path(adapter_path).expanduser()
    for f in ("adapter_config.json", "adapters.safetensors"):
        if not (p / f).exists():
            raise ModelNotFound(
                f"--adapter-path {adapter_path}: no {f} there. Pass the directory "
                "mlx-pager lora / mlx_lm.lora wrote (adapter_config.json + adapters.safetensors)"
            )
    return p


def measure_read_rate(weights: PagedWeights, max_bytes: int = 256 << 20) -> float:
    """The pager's own read rate (bytes/s) on the model's pages: whole pages
    read one after another with its I/O threads, chunk size and direct I/O,
    nothing else running. Call before the pages are scheduled."""
    pager = weights.pager
    old = pager.set_readahead(0)
    done, secs = 0, 0.0
    try:
        for pid in weights.page_order:
            b0 = pager.stats()["bytes_read"]
            t = time.perf_counter()
            arrays = pager.acquire(pid)
            secs += time.perf_counter() - t
            pager.release(pid)
            del arrays
            done += pager.stats()["bytes_read"] - b0
            if done >= max_bytes:
                break
        pager.evict_all()
    finally:
        pager.set_readahead(old)
    return done / secs if secs > 0 else float("inf")


def load_paged(
    model_path: str,
    adapter_path: Optional[str] = None,
    memory_budget=None,
    ssd_cache_dir: Optional[str] = None,
    *,
    max_kv_tokens: int = DEFAULT_KV_TOKENS,
    prefill_step_size: int = 2048,
    store: str = "auto",
    policy: str = "optimal",
    readahead: Optional[int] = None,
    readahead_mode: str = "conservative",
    io_threads: int = 4,
    direct_io: bool = True,
    page_parts: Optional[int] = 1,
    tokenizer_config: Optional[dict] = None,
    trust_remote_code: bool = False,
    measure_read: bool = False,
    page_budget: Optional[int] = None,
    progress=None,
):
    """Loads `model_path` (a local mlx-lm model directory or hub id) for
    generation within `memory_budget` (e.g. "8GB"; default 80% of RAM or of
    the memory cgroup's limit, the lesser), with the adapters in
    `adapter_path` applied as mlx_lm.load applies them.

    Returns (PagedModel, TokenizerWrapper), for mlx_lm.generate /
    stream_generate. `max_kv_tokens` is the KV cache reserved up front (it
    grows on demand, shrinking the page budget); prompts are processed in
    chunks of at most `prefill_step_size` tokens, fewer if the budget needs
    it (``paged.prefill_chunk``). `readahead` defaults to the number of
    blocks. With `measure_read`, ``paged.read_rate`` is the pager's measured
    read rate (bytes/s), for the bound on decode time. `page_budget` (bytes;
    benchmarks and tests) replaces `memory_budget` by the plan's fixed part
    plus exactly that much for pages. `page_parts`: pages per block
    (PagedWeights; None: large blocks in parts by size); generation binds
    each block whole."""
    from mlx_lm.tuner.utils import load_adapters
    from mlx_lm.utils import load_model

    heap.serve_large_by_mmap()
    budget = budget_or_default(memory_budget)
    if memory_budget is not None:
        check_budget_fits(budget)
    path = resolve_model_path(str(model_path))
    if adapter_path is not None:
        adapter_path = _check_adapter_path(adapter_path)
    model, config = load_model(path, lazy=True, trust_remote_code=trust_remote_code)
    check_blocks_unpatched(model)
    check_pageable(model, generation=True)
    check_backend_ops(model)
    tokenizer = load_tokenizer(
        path,
        dict(tokenizer_config or {}, trust_remote_code=trust_remote_code),
        eos_token_ids=config.get("eos_token_id", None),
    )
    model.freeze()
    L = len(BlockList(model).blocks())
    weights = PagedWeights(
        model,
        path,
        budget_bytes=1 << 62,
        ssd_cache_dir=ssd_cache_dir,
        store=store,
        pager_options=dict(
            policy=policy,
            readahead=L if readahead is None else readahead,
            io_threads=io_threads,
            direct_io=direct_io,
            readahead_mode=readahead_mode,
        ),
        progress=progress,
        page_parts=page_parts,
    )
    # `readahead` counts blocks; the pager counts pages.
    weights.pager.set_readahead((L if readahead is None else readahead) * weights.pages_per_block)
    # The process before the adapters are read: the plan counts them apart
    # (measured after, they were counted twice: 211 MB of a MoE's adapters
    # raised the least budget named from 1.08 to 1.29 GB).
    baseline = process_rss()
    if adapter_path is not None:
        load_adapters(model, str(adapter_path))  # mlx-lm's own: LoRA/DoRA layers + weights
    model.eval()
    adapters = [v for _, v in tree_flatten(model.trainable_parameters())]
    mx.eval(adapters)
    act = next(
        (
            s.placeholder.dtype
            for s in weights.slots[weights.resident_id]
            if mx.issubdtype(s.placeholder.dtype, mx.floating)
        ),
        mx.float32,
    )
    max_page = weights.max_block_charge
    plan = MemoryPlan(
        budget=budget,
        baseline=baseline,
        resident=weights.page_charge_bound(weights.resident_id),
        trainable=sum(a.nbytes for a in adapters),
        activations=0,
        # MLX's buffer cache keeps one freed page frame for the next read.
        slack=plan_slack(),
        max_page=max_page,
        given=memory_budget is not None,
    )
    paged = PagedModel(model, weights, plan, config, act.size, prefill_step_size, max_kv_tokens, page_budget)
    paged.read_rate = measure_read_rate(weights) if measure_read else None
    weights.pin_resident()
    weights.pager.set_schedule(weights.page_order, True)
    return paged, tokenizer
