"""A small serving loop over jaxkv: continuous batching, paged KV, prefix reuse.

The loop is what a JAX serving stack does around its model, cut to the parts that touch the
cache:

* slots come from a `PagedAllocator` (`alloc_extend` for prompts, `alloc_decode` for each new
  token) and go back with `free` when a request finishes;
* each request owns a row of a `ReqToTokenPool`; the step reads its context through that row;
* the step (`Decoder.step`) is compiled per bucket of (batch, new tokens, context) with the
  pool donated, so writes are in place and decode does not retrace as requests come and go;
* with a store, every prompt's full blocks are offloaded with `KVConnector.store_async` after
  its prefill, and a later prompt that starts the same way `lookup`s and `load`s those blocks
  into fresh slots and prefills only the rest.

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
import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jaxkv import PagedAllocator, ReqToTokenPool
from jaxkv.connector import BlockStore, KVConnector
from jaxkv.models.decoder import Decoder

__all__ = ["Engine", "Request", "Result", "CompiledSteps", "bucket"]


def bucket(n: int, *, minimum: int = 16, step: int = 256) -> int:
    """The padded size for `n`: a power of two up to `step`, then a multiple of `step`.

    Powers of two keep short shapes few; past `step` they would waste up to half the work, so
    long shapes grow in steps instead.
    """
    if n <= step:
        return max(minimum, 1 << max(0, n - 1).bit_length())
    return -(-n // step) * step


@dataclasses.dataclass
class Request:
    """A prompt to serve.

    Args:
        prompt: token ids `(n,)`, `n >= 1`.
        max_new_tokens: tokens to generate (fewer if the engine's `eos_id` comes first).
        arrival: the loop iteration at which the request arrives (0: at once); requests that
            arrive together are prefilled together.
    """

    prompt: np.ndarray
    max_new_tokens: int
    arrival: int = 0


@dataclasses.dataclass
class Result:
    """What one request got.

    Attributes:
        tokens: generated token ids `(n,)`.
        logits: float32 `(n, vocab)`, the logits each token was chosen from (greedy).
        ttft_s: seconds from arrival to the first token, XLA compilation excluded.
        reused_tokens: prompt tokens loaded from the store instead of computed.
    """

    tokens: np.ndarray
    logits: np.ndarray
    ttft_s: float
    reused_tokens: int


class CompiledSteps:
    """`Decoder.step` compiled ahead of time per shape, with the pool donated.

    Compiling explicitly (rather than on first call) keeps compilation out of every timed
    region and makes it countable: `traces` counts how often the step was traced, per kind
    ("prefill" or "decode"), and `compile_seconds` sums the time spent compiling each shape
    and running it once on padding.
    """

    def __init__(self, model: Decoder):
        self.model = model
        self.traces: collections.Counter[str] = collections.Counter()
        self.compile_seconds = 0.0
        self._compiled: dict = {}

        def step(params, pool, table, rows, tokens, start, n_new, loc, *, ctx):
            self.traces["decode" if tokens.shape[1] == 1 else "prefill"] += 1
            return model.step(params, pool, table, rows, tokens, start, n_new, loc, ctx=ctx)

        self._jit = jax.jit(step, donate_argnums=1, static_argnames="ctx")

    def __call__(self, params, pool, table, rows, tokens, start, n_new, loc, *, ctx: int):
        args = (params, pool, table, rows, tokens, start, n_new, loc)
        key = (jax.tree_util.tree_structure(pool), table.shape, tokens.shape, ctx)
        exe = self._compiled.get(key)
        if exe is None:
            t0 = time.perf_counter()
            exe = self._jit.lower(*args, ctx=ctx).compile()
            # XLA:CPU finishes setting an executable up on its first run (0.1-0.2 s for a
            # step here). Run it once on an all-padding batch: every write goes to slot -1
            # and is dropped, so the donated pool comes back unchanged.
            idle = [np.zeros_like(a) for a in (rows, tokens, start, n_new)]
            _, pool = exe(params, pool, table, *idle, np.full_like(loc, -1))
            jax.block_until_ready(pool)
            self.compile_seconds += time.perf_counter() - t0
            self._compiled[key] = exe
        return exe(params, pool, table, rows, tokens, start, n_new, loc)

    def __len__(self) -> int:
        return len(self._compiled)

    def shapes(self) -> list[tuple]:
        """`(tokens shape (B, T), context)` of every compiled step; T == 1 is decode."""
        return [(key[2], key[3]) for key in self._compiled]


_STEPS: dict = {}


def steps_for(model: Decoder) -> CompiledSteps:
    """The process-wide `CompiledSteps` of models with `model`'s config (engines share it)."""
    if model.cfg not in _STEPS:
        _STEPS[model.cfg] = CompiledSteps(model)
    return _STEPS[model.cfg]


@dataclasses.dataclass
class _Live:
    """A request being served."""

    index: int
    req: Request
    row: int
    slots: np.ndarray  # every slot the request holds, in token order
    seq_len: int = 0  # tokens whose K/V are in the pool
    reused: int = 0
    arrived_at: float = 0.0
    ttft: float = 0.0
    tokens: list = dataclasses.field(default_factory=list)
    logits: list = dataclasses.field(default_factory=list)

    @property
    def budget(self) -> int:
        """The most tokens this request will ever hold in the cache."""
        return len(self.req.prompt) + self.req.max_new_tokens - 1


class Engine:
    """Serves `Request`s with a `Decoder` whose cache lives in one jaxkv pool.

    Args:
        model: the decoder.
        params: its weights.
        pool_size: tokens the pool holds (a multiple of `page_size`).
        page_size: tokens per page, for the pool and the allocator.
        dtype: the pool's dtype (bf16, fp8, ...); the model computes in float32.
        max_batch: requests served at once (rows of the request-to-token table).
        max_context: the longest prompt plus new tokens a request may have.
        store: a `BlockStore` to offload prompt blocks to and reuse them from; `None` turns
            prefix reuse off.
        block_size: tokens per stored block (default: the connector's).
        namespace: the connector namespace; by default derived from the model's config, so
            different models never share blocks.
        eos_id: a token that ends a request early (`None`: never).

    Raises:
        ValueError: bad sizes (from the pool, the allocator or the connector).
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
    ):
        self.model = model
        self.params = params
        self.pool = model.create_pool(size=pool_size, page_size=page_size, dtype=dtype)
        self.allocator = PagedAllocator(pool_size, page_size)
        self.req_to_token = ReqToTokenPool(max_batch, max_context)
        self.max_batch = max_batch
        self.max_context = max_context
        self.eos_id = eos_id
        self.connector = None
        if store is not None:
            namespace = namespace or f"jaxkv-models-{model.cfg.fingerprint()}"
            self.connector = KVConnector(
                self.pool, store, block_size=block_size, namespace=namespace
            )
        self.steps = steps_for(model)
        self._setup_seconds = 0.0
        self._table_sizes: set[int] = set()
        self.stats = dict.fromkeys(
            (
                "prompt_tokens",
                "reused_tokens",
                "prefill_tokens",
                "decode_tokens",
                "decode_steps",
                "prefill_seconds",
                "decode_seconds",
            ),
            0,
        )

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

        Raises:
            ValueError: a request is empty, asks for no tokens or exceeds `max_context`.
            RuntimeError: the pool cannot hold a request even with nothing else running.
        """
        for i, r in enumerate(requests):
            n = len(r.prompt)
            if n < 1 or r.max_new_tokens < 1:
                raise ValueError(
                    f"requests[{i}]: expected a non-empty prompt and max_new_tokens >= 1, got "
                    f"{n} prompt tokens and max_new_tokens={r.max_new_tokens}"
                )
            if n + r.max_new_tokens - 1 > self.max_context:
                raise ValueError(
                    f"requests[{i}]: prompt ({n}) + max_new_tokens ({r.max_new_tokens}) - 1 "
                    f"exceeds max_context={self.max_context}"
                )
            vocab = self.model.cfg.vocab_size
            if np.any((np.asarray(r.prompt) < 0) | (np.asarray(r.prompt) >= vocab)):
                raise ValueError(f"requests[{i}]: expected token ids in [0, {vocab}) in prompt")
        requests = [
            dataclasses.replace(r, prompt=np.asarray(r.prompt, np.int32).reshape(-1))
            for r in requests
        ]
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
                admit = []
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
            # A request the pool cannot hold mid-decode (or an interrupt): give every running
            # request's slots and row back, so the engine stays usable.
            for live in running:
                self.allocator.free(live.slots)
                self.req_to_token.free(live.row)
            raise
        if self.connector is not None:
            self.connector.flush()
        return [
            Result(
                tokens=np.asarray(done[i].tokens, np.int32),
                logits=np.stack(done[i].logits),
                ttft_s=done[i].ttft,
                reused_tokens=done[i].reused,
            )
            for i in range(len(requests))
        ]

    def _retire(self, running: list[_Live], done: dict) -> list[_Live]:
        keep = []
        for live in running:
            last = live.tokens[-1]
            if len(live.tokens) >= live.req.max_new_tokens or last == self.eos_id:
                self.allocator.free(live.slots)
                self.req_to_token.free(live.row)
                done[live.index] = live
            else:
                keep.append(live)
        return keep

    # ---- prefill ------------------------------------------------------------------------

    def _reuse(self, prompt: np.ndarray) -> tuple[np.ndarray, int]:
        """Loads the longest stored prefix of `prompt` into fresh slots.

        Returns the slots taken (whole blocks) and how many tokens were loaded into them; at
        least the last prompt token is always left to compute, since its logits start the
        generation.
        """
        empty = np.zeros(0, np.int64)
        if self.connector is None:
            return empty, 0
        bs = self.connector.block_size
        hit = min(self.connector.lookup(prompt), (len(prompt) - 1) // bs * bs)
        if hit == 0:
            return empty, 0
        slots = self.allocator.alloc_extend([0], [hit], [-1])
        if slots is None:
            return empty, 0
        self.pool, n = self.connector.load(self.pool, prompt[:hit], slots)
        return slots, n

    def _prefill(self, admitted, waiting: collections.deque) -> list[_Live]:
        """Prefills `admitted` `(index, request, arrival time)` together; requests whose
        slots do not fit go back to the front of `waiting`."""
        t0 = self._clock()
        lives, deferred = [], []
        for index, req, arrived_at in admitted:
            row = self.req_to_token.alloc(1)[0]
            pre, reused = self._reuse(req.prompt)
            more = self.allocator.alloc_extend(
                [len(pre)], [len(req.prompt)], [pre[-1] if len(pre) else -1]
            )
            if more is None:
                self.allocator.free(pre)
                self.req_to_token.free(row)
                deferred.append(index)
                continue
            slots = np.concatenate([pre, more])
            self._write_table(row, 0, slots)
            lives.append(_Live(index, req, row, slots, len(req.prompt), reused, arrived_at))
        waiting.extendleft(reversed(deferred))
        if not lives:
            return []
        try:
            extend = [len(lv.req.prompt) - lv.reused for lv in lives]
            b, t = _batch_bucket(len(lives), self.max_batch), bucket(max(extend))
            ctx = min(bucket(max(lv.budget for lv in lives)), self.max_context)
            tokens = np.zeros((b, t), np.int32)
            loc = np.full((b, t), -1, np.int32)
            start, n_new, rows = np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros(b, np.int32)
            for i, lv in enumerate(lives):
                tokens[i, : extend[i]] = lv.req.prompt[lv.reused :]
                loc[i, : extend[i]] = lv.slots[lv.reused : len(lv.req.prompt)]
                start[i], n_new[i], rows[i] = lv.reused, extend[i], lv.row
            logits, self.pool = self.steps(
                self.params, self.pool, self.req_to_token.req_to_token, rows, tokens, start, n_new,
                loc, ctx=ctx,
            )  # fmt: skip
            logits = np.asarray(logits)
            now = self._clock()
            for i, lv in enumerate(lives):
                self._emit(lv, logits[i])
                lv.ttft = now - lv.arrived_at
            if self.connector is not None:
                for lv in lives:
                    n = len(lv.req.prompt)
                    self.connector.store_async(self.pool, lv.req.prompt, lv.slots[:n])
        except BaseException:
            for lv in lives:  # not running yet: nobody else would give their slots back
                self.allocator.free(lv.slots)
                self.req_to_token.free(lv.row)
            raise
        self.stats["prefill_seconds"] += now - t0
        self.stats["prompt_tokens"] += sum(len(lv.req.prompt) for lv in lives)
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
        if new is None:
            raise RuntimeError(
                f"pool too small: no page left for {len(running)} decoding requests "
                "(this loop does not preempt); raise pool_size"
            )
        b = _batch_bucket(len(running), self.max_batch)
        ctx = min(bucket(max(lv.budget for lv in running)), self.max_context)
        tokens = np.zeros((b, 1), np.int32)
        loc = np.full((b, 1), -1, np.int32)
        start, n_new, rows = np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros(b, np.int32)
        for i, lv in enumerate(running):
            self._write_table(lv.row, lv.seq_len, new[i : i + 1])
            lv.slots = np.append(lv.slots, new[i])
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


def _batch_bucket(n: int, max_batch: int) -> int:
    return min(1 << max(0, n - 1).bit_length(), max_batch)
