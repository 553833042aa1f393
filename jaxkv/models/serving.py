"""A small serving loop over jaxkv: continuous batching, paged KV, prefix reuse.

The loop is what a JAX serving stack does around its model, cut to the parts that touch the
cache:

* slots come from a `PagedAllocator` (`alloc_extend` for prompts, `alloc_decode` for each new
  token);
* each request owns a row of a `ReqToTokenPool`; the step reads its context through that row;
* the step (`Decoder.step`) is compiled per bucket of (batch, new tokens, context) with the
  pool donated, so writes are in place and decode does not retrace as requests come and go;
* a `RadixCache` keeps the KV of earlier requests on the device, as SGLang's scheduler does:
  a prompt is matched in it first and its row points at the shared slots (no copy), locked
  while the request runs; after its prefill the prompt's pages join the tree, and when the
  request finishes so do its generated tokens' (the slots the tree held already go back to
  the allocator); when the allocator is short, the tree evicts its least recently used
  prefixes (writing them to the store first, when there is one);
* with a store, every prompt's full blocks are offloaded with `KVConnector.store_async` after
  its prefill, and a prompt whose prefix the device no longer holds loads the stored blocks
  after its device match (`RadixCache.load_back`) and prefills only the rest.

Example:
    >>> from jaxkv.models import Decoder, DecoderConfig
    >>> model = Decoder(DecoderConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
    ...                               head_dim=8, mlp_dim=32))
    >>> engine = Engine(model, model.init_params(), pool_size=256, max_batch=2, max_context=128)
    >>> [r.tokens.shape for r in engine.generate([Request(np.arange(40), 4)])]
    [(4,)]
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jaxkv import PagedAllocator, RadixCache, ReqToTokenPool
from jaxkv.connector import BlockStore, KVConnector
from jaxkv.errors import ConsumedPoolError
from jaxkv.models.decoder import Decoder
from jaxkv.models.requests import _NO_SLOTS, Request, Result, _checked, _Live
from jaxkv.models.steps import CompiledSteps, _batch_bucket, bucket, steps_for
from jaxkv.models.weights import params_fingerprint

__all__ = ["Engine", "Request", "Result", "CompiledSteps", "bucket", "params_fingerprint"]


class Engine:
    """Serves `Request`s with a `Decoder` whose cache lives in one jaxkv pool.

    With `prefix_cache` (the default) the KV of served requests stays on the device in a
    `RadixCache` (`tree_cache`) until the allocator needs the room: a prompt is matched there
    first and reads its cached prefix in place, then loads from the store what the device no
    longer holds, then prefills the rest. A request's tree prefix is locked while it runs.

    Each `generate` is all or nothing per call: every request is checked before anything is
    allocated, and a call that fails anywhere (a request the pool cannot hold, a store that
    raises, a failed step, a tree call) gives back every row, slot and lock it took, so the
    next call is served as by a fresh engine (free plus evictable tokens are as before the
    call; the tree may hold other prefixes, which only changes where KV comes from).

    Args:
        model: the decoder.
        params: its weights, fixed for the engine's life (the default namespace is derived
            from them once, at construction).
        pool_size: tokens the pool holds (a multiple of `page_size`).
        page_size: tokens per page, for the pool, the allocator and the prefix cache.
        dtype: the pool's dtype (bf16, fp8, ...); the model computes in float32.
        max_batch: requests served at once (rows of the request-to-token table).
        max_context: the longest prompt plus new tokens a request may have.
        store: a `BlockStore` to offload prompt blocks to and reuse them from; `None`: no
            store tier.
        block_size: tokens per stored block (default: the connector's); with `prefix_cache`,
            a multiple of `page_size`.
        namespace: the connector namespace, which must identify everything that determines
            the KV: the weights (checkpoint, fine-tune), not only the architecture, e.g.
            `namespace=f"llama3-8b@{checkpoint_sha}"`; two engines of one namespace reuse
            each other's blocks. By default it is derived from the config and
            `params_fingerprint(params)`, so engines with other weights never share a block.
        eos_id: a token that ends a request early (`None`: never).
        prefix_cache: keep served requests' KV on the device in a `RadixCache` and reuse it
            (`True`); `False` frees every request's slots when it finishes, so only the store
            (if any) is reused.

    Raises:
        ValueError: bad sizes (from the pool, the allocator, the connector or the prefix
            cache).
        TypeError, ValueError: weights `params_fingerprint` cannot read, when it derives the
            namespace.
    """

    def __init__(
        self,
        model: Decoder,
        params: dict,
        *,
        pool_size: int = 8192,
        page_size: int = 16,
        dtype: DTypeLike = jnp.bfloat16,
        max_batch: int = 8,
        max_context: int = 2048,
        store: BlockStore | None = None,
        block_size: int | None = None,
        namespace: str | None = None,
        eos_id: int | None = None,
        prefix_cache: bool = True,
    ):
        if not isinstance(prefix_cache, bool):
            raise TypeError(
                f"prefix_cache: expected a bool, got {type(prefix_cache).__name__} {prefix_cache!r}"
            )
        self.model = model
        self.params = params
        self._new_pool = functools.partial(
            model.create_pool, size=pool_size, page_size=page_size, dtype=dtype
        )
        self.pool = self._new_pool()
        self.allocator = PagedAllocator(pool_size, page_size)
        self.req_to_token = ReqToTokenPool(max_batch, max_context)
        self.max_batch = max_batch
        self.max_context = max_context
        self.eos_id = eos_id
        self.connector = None
        if store is not None:
            if namespace is None:
                weights = params_fingerprint(params)[:32]
                namespace = f"jaxkv-models-{model.cfg.fingerprint()}-{weights}"
            self.connector = KVConnector(
                self.pool, store, block_size=block_size, namespace=namespace
            )
        self._prefix_cache = prefix_cache
        self.tree_cache: RadixCache | None = self._new_tree()
        self.steps = steps_for(model)
        self._setup_seconds = 0.0
        self._table_sizes: set[int] = set()
        self.stats: dict[str, float] = dict.fromkeys(
            (
                "prompt_tokens",
                "device_tokens",
                "reused_tokens",
                "prefill_tokens",
                "evicted_tokens",
                "decode_tokens",
                "decode_steps",
                "prefill_seconds",
                "decode_seconds",
            ),
            0,
        )

    @property
    def _tree(self) -> RadixCache:
        """The prefix cache, for the steps taken only when there is one."""
        assert self.tree_cache is not None
        return self.tree_cache

    def _new_tree(self) -> RadixCache | None:
        """An empty prefix cache over the allocator; with a store, the pages it evicts are
        stored first (`write_back`), so what leaves the device can be loaded back."""
        if not self._prefix_cache:
            return None
        return RadixCache(self.allocator, connector=self.connector, write_policy="write_back")

    # ---- time ---------------------------------------------------------------------------

    def _clock(self) -> float:
        """Wall time with XLA compilation taken out, so first-of-a-shape steps time fairly."""
        return time.perf_counter() - self.steps.compile_seconds - self._setup_seconds

    def _write_table(self, row: int, start: int, slots: np.ndarray) -> None:
        """`req_to_token[row, start:start + len(slots)] = slots`.

        `ReqToTokenPool.write` compiles once per power-of-two length; the first write of each
        length is made first into the padding row 0 (zeros over zeros, so row 0 stays all
        padding) and kept out of the clock.
        """
        size = 1 << max(0, len(slots) - 1).bit_length()
        if size not in self._table_sizes:
            t0 = time.perf_counter()
            self.req_to_token = self.req_to_token.write(0, 0, np.zeros(len(slots), np.int32))
            jax.block_until_ready(self.req_to_token.req_to_token)
            self._setup_seconds += time.perf_counter() - t0
            self._table_sizes.add(size)
        self.req_to_token = self.req_to_token.write(row, start, slots)

    # ---- the loop -----------------------------------------------------------------------

    def generate(
        self, requests: Sequence[Request], *, on_token: Callable[[int], None] | None = None
    ) -> list[Result]:
        """Serves `requests` to completion; results in request order.

        Requests are admitted at their `arrival` iteration while the batch has room; each
        iteration prefills the newly admitted requests together, then runs one decode step
        for every running request. `on_token(n)` is called with the number of tokens each
        step produced (for progress bars).

        All or nothing: every request is checked before anything is allocated, and on any
        error every row, slot and prefix-cache lock taken is given back (a pool a failed step
        had donated is replaced by an empty one, and the prefix cache, whose KV was in it,
        by an empty one too), so the engine serves the next call as a fresh one would.
        Blocks already offloaded for prompts this call computed stay in the store, and
        prefixes it cached stay in the prefix cache (they are correct KV).

        Raises:
            TypeError: a request is not a `Request`, its prompt is not integer token ids
                (floats and bools are refused, never rounded) or its `max_new_tokens` or
                `arrival` is not an int; the message names `requests[i].field`.
            ValueError: a prompt that is not 1-D, is empty or holds ids outside the
                vocabulary, `max_new_tokens < 1`, `arrival < 0`, or a request longer than
                `max_context`.
            RuntimeError: the pool cannot hold a request even with nothing else running, or
                runs out of pages during decode (this loop does not preempt).
        """
        vocab = self.model.cfg.vocab_size
        requests = [_checked(i, r, vocab, self.max_context) for i, r in enumerate(requests)]
        waiting = collections.deque(sorted(range(len(requests)), key=lambda i: requests[i].arrival))
        arrived: dict[int, float] = {}
        running: list[_Live] = []
        done: dict[int, _Live] = {}
        it = 0
        try:
            while waiting or running:
                if not running:
                    it = max(it, requests[waiting[0]].arrival)
                now = self._clock()
                for i in waiting:
                    if requests[i].arrival > it:
                        break
                    arrived.setdefault(i, now)
                admit: list[int] = []
                while (
                    waiting
                    and requests[waiting[0]].arrival <= it
                    and len(running) + len(admit) < self.max_batch
                ):
                    admit.append(waiting.popleft())
                if admit:
                    new = self._prefill([(i, requests[i], arrived[i]) for i in admit], waiting)
                    if not new and not running:
                        raise RuntimeError(
                            f"pool too small: {self.allocator.available_size()} free tokens cannot "
                            f"hold request {admit[0]} even with nothing running; raise pool_size"
                        )
                    running += new
                    if on_token:
                        on_token(len(new))
                running = self._retire(running, done)
                if running:
                    self._decode(running)
                    if on_token:
                        on_token(len(running))
                    running = self._retire(running, done)
                it += 1
        except BaseException:
            # Whatever failed (a store, a step, a tree call, a request the pool cannot hold
            # mid-decode, an interrupt): give back what every running request holds. A
            # request that finished before the failure holds nothing (`_release` is exact).
            for live in running:
                self._release(live)
            self._replace_spent_buffers()
            raise
        if self.connector is not None:
            self.connector.flush()
        return [
            Result(
                tokens=np.asarray(done[i].tokens, np.int32),
                logits=np.stack(done[i].logits),
                ttft_s=done[i].ttft,
                reused_tokens=done[i].reused,
                device_tokens=done[i].device,
                computed_tokens=len(done[i].req.prompt) - done[i].start,
            )
            for i in range(len(requests))
        ]

    def _release(self, live: _Live) -> None:
        """Gives back everything `live` holds: its own slots, its locks on the prefix cache
        and its row. Each is marked given back as soon as it is, so a second call gives back
        only what a failed first one did not."""
        if live.owned.size:
            self.allocator.free(live.owned)
            live.owned = _NO_SLOTS
        while live.locks:
            self._tree.dec_lock_ref(live.locks[-1])
            live.locks.pop()
        if live.row >= 0:
            self.req_to_token.free(live.row)
            live.row = -1

    def _replace_spent_buffers(self) -> None:
        """After a failed call: a step or load that failed after its inputs were donated
        leaves the engine's pool (or table) deleted. Neither holds anything still needed
        (every request's slots and row were given back, and stored blocks live in the
        store), so an empty one of the same shape takes its place. The prefix cache's KV
        was in the lost pool, so it is emptied too: with no request holding a slot, the
        allocator holds only the tree's, and both start afresh."""
        pool = self.pool
        if pool.consumed or any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(pool)):
            self.pool = self._new_pool()
            if self.tree_cache is not None:
                self.allocator.clear()
                self.tree_cache = self._new_tree()
        try:
            table = self.req_to_token.req_to_token
        except ConsumedPoolError:
            table = None
        if table is None:
            # No row is held between calls, so fresh bookkeeping (all rows free) is the same.
            self.req_to_token = ReqToTokenPool(self.max_batch, self.max_context)

    def _retire(self, running: list[_Live], done: dict) -> list[_Live]:
        keep = []
        for live in running:
            last = live.tokens[-1]
            if len(live.tokens) >= live.req.max_new_tokens or last == self.eos_id:
                self._finish(live)
                done[live.index] = live
            else:
                keep.append(live)
        return keep

    def _finish(self, live: _Live) -> None:
        """Caches a finished request's tokens with K/V in the prefix cache and gives back the
        rest, as SGLang's `cache_finished_req`: the tree takes the pages it did not hold;
        the request frees its copies of those it did, and its partial last page."""
        if self.tree_cache is not None:
            n = live.seq_len
            matched = self._tree.insert(live.kv_tokens(), live.slots[:n])
            self._took(live, matched, n // self.allocator.page_size * self.allocator.page_size)
        self._release(live)

    def _took(self, live: _Live, matched: int, aligned: int) -> None:
        """Records that an `insert` of `live`'s first `aligned` tokens took its slots
        `[matched, aligned)` (the tree held the first `matched` tokens already): the request
        now holds its copies `[cached, matched)` and everything from `aligned` on."""
        live.owned = np.concatenate([live.slots[live.cached : matched], live.slots[aligned:]])

    # ---- the prefix cache ---------------------------------------------------------------

    def _lock(self, live: _Live, node) -> None:
        self._tree.inc_lock_ref(node)
        live.locks.append(node)

    def _relock(self, live: _Live, node) -> None:
        """Moves `live`'s locks to `node` (a handle of a longer prefix of its tokens): the
        new lock is taken before the old ones go, so the prefix is never unprotected."""
        old = list(live.locks)
        self._lock(live, node)
        for handle in old:
            self._tree.dec_lock_ref(handle)
            live.locks.remove(handle)

    def _match(self, live: _Live) -> None:
        """Finds `live`'s prompt in the prefix cache and locks it, then loads from the store
        the blocks after the device match that it holds (`load_back`, which caches them).

        The last prompt token is left out of the match: its logits start the generation,
        so it is always computed.
        """
        tree = self._tree
        head = live.req.prompt[:-1]
        match = tree.match_prefix(head)
        self._lock(live, match.node)
        live.slots, live.cached = match.slots, len(match.slots)
        live.device = live.cached
        if match.stored_tokens:
            # The pool is consumed by the load even when the call fails after it.
            self.pool, longer = tree.load_back(self.pool, head, match)
            if longer.node is not match.node:
                self._relock(live, longer.node)
                live.slots, live.cached = longer.slots, len(longer.slots)
                live.reused = live.cached - live.device

    def _make_room(self, tokens: int) -> None:
        """Evicts from the prefix cache until `tokens` tokens are free, or all it can."""
        short = tokens - self.allocator.available_size()
        if short > 0 and self.tree_cache is not None and self.tree_cache.evictable_size():
            self.stats["evicted_tokens"] += self.tree_cache.evict(short, pool=self.pool)

    def _cache_prompt(self, live: _Live) -> None:
        """After its prefill, puts `live`'s prompt pages into the prefix cache, so requests
        arriving while it runs find them on the device (SGLang's `cache_unfinished_req`).

        The tree takes the pages it does not hold; for those it held already (another
        request cached them since this one was matched), the row is pointed at the tree's
        slots and this request's copies are freed. The lock moves to the longer prefix.
        """
        page = self.allocator.page_size
        prompt = live.req.prompt
        aligned = len(prompt) // page * page
        if aligned <= live.cached:
            return
        tree = self._tree
        matched = tree.insert(prompt[:aligned], live.slots[:aligned])
        self._took(live, matched, aligned)
        match = tree.match_prefix(prompt[:aligned])
        self._relock(live, match.node)
        copies = live.slots[live.cached : matched]
        if copies.size:
            self._write_table(live.row, live.cached, match.slots[live.cached : matched])
        live.slots = np.concatenate([match.slots, live.slots[aligned:]])
        live.cached = aligned
        live.owned = live.slots[aligned:]
        if copies.size:
            self.allocator.free(copies)

    # ---- prefill ------------------------------------------------------------------------

    def _reuse(self, live: _Live) -> None:
        """Without a prefix cache: loads the longest stored prefix of `live`'s prompt into
        fresh slots.

        Sets `live.slots` and `live.owned` to the slots taken (whole blocks) as soon as they
        are taken, so a failed load gives them back with the row, and `live.reused` to the
        tokens loaded; at least the last prompt token is always left to compute, since its
        logits start the generation.
        """
        if self.connector is None:
            return
        prompt = live.req.prompt
        bs = self.connector.block_size
        hit = min(self.connector.lookup(prompt), (len(prompt) - 1) // bs * bs)
        if hit == 0:
            return
        slots = self.allocator.alloc_extend([0], [hit], [-1])
        if slots is None:
            return
        live.slots = live.owned = slots
        self.pool, live.reused = self.connector.load(self.pool, prompt[:hit], slots)

    def _admit(self, index: int, req: Request, arrived_at: float) -> _Live | None:
        """Takes a row and the prompt's slots (its cached prefix matched, its stored prefix
        loaded) and writes them into the table; `None` (nothing held) when the pool has no
        room for them even after evicting. All or nothing: a failure gives back what was
        taken before it is raised."""
        rows = self.req_to_token.alloc(1)
        if rows is None:
            # `generate` admits no more requests than free rows, so someone else holds one.
            raise RuntimeError(
                f"req_to_token: expected a free row for request {index}, got none of "
                f"{self.max_batch} (rows taken outside generate?)"
            )
        live = _Live(index, req, rows[0], _NO_SLOTS, len(req.prompt), arrived_at=arrived_at)
        try:
            if self.tree_cache is not None:
                self._match(live)
            else:
                self._reuse(live)
            pre, n, page = live.slots, len(req.prompt), self.allocator.page_size
            self._make_room((-(-n // page) - -(-len(pre) // page)) * page)
            more = self.allocator.alloc_extend([len(pre)], [n], [pre[-1] if len(pre) else -1])
            if more is None:
                self._release(live)
                return None
            live.owned = np.concatenate([live.owned, more])
            live.slots = np.concatenate([pre, more])
            self._write_table(live.row, 0, live.slots)
        except BaseException:
            self._release(live)
            raise
        return live

    def _prefill(self, admitted, waiting: collections.deque) -> list[_Live]:
        """Prefills `admitted` `(index, request, arrival time)` together; requests whose
        slots do not fit go back to the front of `waiting`. On a failure every admitted
        request's row, slots and locks are given back (they are not running yet: nobody
        else would)."""
        t0 = self._clock()
        lives, deferred = [], []
        try:
            for index, req, arrived_at in admitted:
                live = self._admit(index, req, arrived_at)
                if live is None:
                    deferred.append(index)
                else:
                    lives.append(live)
            if not lives:
                waiting.extendleft(reversed(deferred))
                return []
            extend = [len(lv.req.prompt) - lv.start for lv in lives]
            b, t = _batch_bucket(len(lives), self.max_batch), bucket(max(extend))
            ctx = min(bucket(max(lv.budget for lv in lives)), self.max_context)
            tokens = np.zeros((b, t), np.int32)
            loc = np.full((b, t), -1, np.int32)
            start, n_new, rows = np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros(b, np.int32)
            for i, lv in enumerate(lives):
                tokens[i, : extend[i]] = lv.req.prompt[lv.start :]
                loc[i, : extend[i]] = lv.slots[lv.start : len(lv.req.prompt)]
                start[i], n_new[i], rows[i] = lv.start, extend[i], lv.row
            logits, self.pool = self.steps(
                self.params, self.pool, self.req_to_token.req_to_token, rows, tokens, start, n_new,
                loc, ctx=ctx,
            )  # fmt: skip
            logits = np.asarray(logits)
            now = self._clock()
            for i, lv in enumerate(lives):
                self._emit(lv, logits[i])
                lv.ttft = now - lv.arrived_at
            for lv in lives:
                if self.tree_cache is not None:
                    self._cache_prompt(lv)
                if self.connector is not None:
                    n = len(lv.req.prompt)
                    self.connector.store_async(self.pool, lv.req.prompt, lv.slots[:n])
        except BaseException:
            for lv in lives:
                self._release(lv)
            raise
        waiting.extendleft(reversed(deferred))
        self.stats["prefill_seconds"] += now - t0
        self.stats["prompt_tokens"] += sum(len(lv.req.prompt) for lv in lives)
        self.stats["device_tokens"] += sum(lv.device for lv in lives)
        self.stats["reused_tokens"] += sum(lv.reused for lv in lives)
        self.stats["prefill_tokens"] += sum(extend)
        return lives

    def _emit(self, live: _Live, logits: np.ndarray) -> None:
        live.logits.append(logits)
        live.tokens.append(int(np.argmax(logits)))

    # ---- decode -------------------------------------------------------------------------

    def _decode(self, running: list[_Live]) -> None:
        t0 = self._clock()
        seq = np.array([lv.seq_len + 1 for lv in running])
        last = np.array([lv.slots[lv.seq_len - 1] for lv in running])
        new = self.allocator.alloc_decode(seq, last)
        if new is None and self.tree_cache is not None:
            page = self.allocator.page_size
            self._make_room(page * int(np.sum((seq - 1) % page == 0)))  # new pages wanted
            new = self.allocator.alloc_decode(seq, last)
        if new is None:
            raise RuntimeError(
                f"pool too small: no page left for {len(running)} decoding requests "
                "(this loop does not preempt); raise pool_size"
            )
        for i, lv in enumerate(running):
            # Held by its request from here on, so a failure below gives it back.
            lv.slots = np.append(lv.slots, new[i])
            lv.owned = np.append(lv.owned, new[i])
        b = _batch_bucket(len(running), self.max_batch)
        ctx = min(bucket(max(lv.budget for lv in running)), self.max_context)
        tokens = np.zeros((b, 1), np.int32)
        loc = np.full((b, 1), -1, np.int32)
        start, n_new, rows = np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros(b, np.int32)
        for i, lv in enumerate(running):
            self._write_table(lv.row, lv.seq_len, new[i : i + 1])
            tokens[i, 0], loc[i, 0] = lv.tokens[-1], new[i]
            start[i], n_new[i], rows[i] = lv.seq_len, 1, lv.row
        logits, self.pool = self.steps(
            self.params, self.pool, self.req_to_token.req_to_token, rows, tokens, start, n_new,
            loc, ctx=ctx,
        )  # fmt: skip
        logits = np.asarray(logits)
        for i, lv in enumerate(running):
            lv.seq_len += 1
            self._emit(lv, logits[i])
        self.stats["decode_seconds"] += self._clock() - t0
        self.stats["decode_tokens"] += len(running)
        self.stats["decode_steps"] += 1

    def close(self) -> None:
        """Waits for pending offloads and stops the connector's writer."""
        if self.connector is not None:
            self.connector.close()
