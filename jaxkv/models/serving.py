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
import functools
import hashlib
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jaxkv import PagedAllocator, ReqToTokenPool
from jaxkv._checks import is_int
from jaxkv.connector import BlockStore, KVConnector
from jaxkv.errors import ConsumedPoolError
from jaxkv.models.decoder import Decoder

__all__ = ["Engine", "Request", "Result", "CompiledSteps", "bucket", "params_fingerprint"]


def bucket(n: int, *, minimum: int = 16, step: int = 256) -> int:
    """The padded size for `n`: a power of two up to `step`, then a multiple of `step`.

    Powers of two keep short shapes few; past `step` they would waste up to half the work, so
    long shapes grow in steps instead.
    """
    if n <= step:
        return max(minimum, 1 << max(0, n - 1).bit_length())
    return -(-n // step) * step


def params_fingerprint(params) -> str:
    """A SHA-256 hex digest of a pytree of weights: every leaf's key path, dtype, shape and
    raw bytes, in the pytree's canonical order (dict keys sorted).

    Two sets of weights get the same fingerprint only when they are the same values, bit for
    bit, at the same paths; so it tells KV computed with one set from KV computed with
    another, which the model's config alone cannot (a fine-tune has its base's config).
    Leaves on an accelerator are copied to the host one at a time and dropped once hashed, so
    the host holds about one leaf at a time. The cost is one pass of SHA-256 over the
    weights' bytes.

    Args:
        params: a pytree whose leaves are arrays (jax or numpy) or numbers.

    Returns:
        64 hex digits.

    Raises:
        TypeError: a leaf that is not numeric data (an object array), naming its path.
        ValueError: a jax array this process cannot read whole (sharded across processes);
            give the engine a `namespace` instead.

    Example:
        >>> import jax.numpy as jnp
        >>> a = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
        >>> params_fingerprint(a) == params_fingerprint({"b": jnp.zeros(3), "w": jnp.ones((2, 3))})
        True
        >>> params_fingerprint(a) == params_fingerprint({**a, "w": a["w"] * 1.5})
        False
    """
    digest = hashlib.sha256(b"jaxkv.models.params_fingerprint/1")
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        where = f"params{jax.tree_util.keystr(path)}"
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            raise ValueError(
                f"{where}: expected an array this process holds whole, got one sharded across "
                "processes; pass Engine(namespace=...) naming the weights instead"
            )
        host = _host_copy(leaf)
        if host.dtype.kind not in "biufcV" or host.dtype.hasobject:
            raise TypeError(f"{where}: expected numeric array data, got dtype {host.dtype}")
        if host.dtype.byteorder == ">":
            host = host.astype(host.dtype.newbyteorder("<"))
        # Length-prefixed header: no two (path, dtype, shape) can run into each other.
        header = repr((where, host.dtype.name, host.shape)).encode()
        digest.update(len(header).to_bytes(8, "little") + header)
        digest.update(np.ascontiguousarray(host).reshape(-1).view(np.uint8).data)
    return digest.hexdigest()


def _host_copy(leaf) -> np.ndarray:
    """`leaf` as a numpy array, kept nowhere else. `np.asarray` of an array on an accelerator
    caches the host copy on the array for the array's life, which over every leaf would keep
    a host copy of the whole model; the copy is taken from a temporary (one leaf more on the
    device for a moment), so it goes when the caller drops it. CPU arrays are read in place.
    """
    if isinstance(leaf, jax.Array) and any(d.platform != "cpu" for d in leaf.devices()):
        leaf = jnp.copy(leaf)
    return np.asarray(leaf)


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
            # XLA:CPU finishes setting an executable up on its first run, which would land in
            # the first request's time. Run it once on an all-padding batch: every write goes
            # to slot -1 and is dropped, so the donated pool comes back unchanged.
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


def _checked(i: int, r: Request, vocab: int, max_context: int) -> Request:
    """`requests[i]` checked whole, as the engine serves it (an int32 prompt, int sizes), or
    the error naming its field, what was expected and what came. Nothing is converted that
    would change meaning: float or bool token ids are refused, never rounded."""
    where = f"requests[{i}]"
    if not isinstance(r, Request):
        raise TypeError(f"{where}: expected a Request, got {type(r).__name__}")
    try:
        prompt = np.asarray(r.prompt)
    except (TypeError, ValueError) as err:  # ragged nesting
        raise TypeError(f"{where}.prompt: expected a 1-D array of token ids, got {err}") from None
    if prompt.ndim != 1:
        raise ValueError(
            f"{where}.prompt: expected a 1-D array of token ids (n,), got shape {prompt.shape}"
        )
    if prompt.size == 0:
        raise ValueError(f"{where}.prompt: expected at least one token id, got an empty prompt")
    if prompt.dtype.kind not in "iu":
        raise TypeError(f"{where}.prompt: expected integer token ids, got dtype {prompt.dtype}")
    bad = np.flatnonzero((prompt < 0) | (prompt >= vocab))
    if bad.size:
        j = int(bad[0])
        raise ValueError(
            f"{where}.prompt: expected token ids in [0, {vocab}), got {prompt[j]} at index {j}"
        )
    for name, low, wanted in (
        ("max_new_tokens", 1, "a positive int"),
        ("arrival", 0, "an int >= 0"),
    ):
        value = getattr(r, name)
        if not is_int(value):
            raise TypeError(
                f"{where}.{name}: expected {wanted}, got {type(value).__name__} {value!r}"
            )
        if value < low:
            raise ValueError(f"{where}.{name}: expected {wanted}, got {value}")
    n, m = len(prompt), int(r.max_new_tokens)
    if n + m - 1 > max_context:
        raise ValueError(
            f"{where}: expected len(prompt) + max_new_tokens - 1 <= max_context={max_context}, "
            f"got {n} + {m} - 1 = {n + m - 1}"
        )
    return Request(prompt.astype(np.int32), m, int(r.arrival))


_NO_SLOTS = np.zeros(0, np.int64)


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

    Each `generate` is all or nothing per call: every request is checked before anything is
    allocated, and a call that fails anywhere (a request the pool cannot hold, a store that
    raises, a failed step) gives back every row and slot it took, so the next call is served
    as by a fresh engine.

    Args:
        model: the decoder.
        params: its weights, fixed for the engine's life (the default namespace is derived
            from them once, at construction).
        pool_size: tokens the pool holds (a multiple of `page_size`).
        page_size: tokens per page, for the pool and the allocator.
        dtype: the pool's dtype (bf16, fp8, ...); the model computes in float32.
        max_batch: requests served at once (rows of the request-to-token table).
        max_context: the longest prompt plus new tokens a request may have.
        store: a `BlockStore` to offload prompt blocks to and reuse them from; `None` turns
            prefix reuse off.
        block_size: tokens per stored block (default: the connector's).
        namespace: the connector namespace, which must identify everything that determines
            the KV: the weights (checkpoint, fine-tune), not only the architecture, e.g.
            `namespace=f"llama3-8b@{checkpoint_sha}"`; two engines of one namespace reuse
            each other's blocks. By default it is derived from the config and
            `params_fingerprint(params)`, so engines with other weights never share a block.
        eos_id: a token that ends a request early (`None`: never).

    Raises:
        ValueError: bad sizes (from the pool, the allocator or the connector).
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
    ):
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
        self.steps = steps_for(model)
        self._setup_seconds = 0.0
        self._table_sizes: set[int] = set()
        self.stats: dict[str, float] = dict.fromkeys(
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

        All or nothing: every request is checked before anything is allocated, and on any
        error every row and slot taken is given back (a pool a failed step had donated is
        replaced by an empty one), so the engine serves the next call as a fresh one would.
        Blocks already offloaded for prompts this call computed stay in the store (they are
        correct KV).

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
            # Whatever failed (a store, a step, a request the pool cannot hold mid-decode, an
            # interrupt): give every running request's slots and row back.
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
            )
            for i in range(len(requests))
        ]

    def _release(self, live: _Live) -> None:
        """Gives back everything `live` holds: its slots and its row."""
        self.allocator.free(live.slots)
        self.req_to_token.free(live.row)

    def _replace_spent_buffers(self) -> None:
        """After a failed call: a step or load that failed after its inputs were donated
        leaves the engine's pool (or table) deleted. Neither holds anything still needed
        (every request's slots and row were given back, and stored blocks live in the
        store), so an empty one of the same shape takes its place."""
        pool = self.pool
        if pool.consumed or any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(pool)):
            self.pool = self._new_pool()
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
                self._release(live)
                done[live.index] = live
            else:
                keep.append(live)
        return keep

    # ---- prefill ------------------------------------------------------------------------

    def _reuse(self, live: _Live) -> None:
        """Loads the longest stored prefix of `live`'s prompt into fresh slots.

        Sets `live.slots` to the slots taken (whole blocks) as soon as they are taken, so a
        failed load gives them back with the row, and `live.reused` to the tokens loaded;
        at least the last prompt token is always left to compute, since its logits start
        the generation.
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
        live.slots = slots
        self.pool, live.reused = self.connector.load(self.pool, prompt[:hit], slots)

    def _admit(self, index: int, req: Request, arrived_at: float) -> _Live | None:
        """Takes a row and the prompt's slots (its stored prefix loaded into them) and writes
        them into the table; `None` (nothing taken) when the pool has no room for them.
        All or nothing: a failure gives back what was taken before it is raised."""
        rows = self.req_to_token.alloc(1)
        if rows is None:
            # `generate` admits no more requests than free rows, so someone else holds one.
            raise RuntimeError(
                f"req_to_token: expected a free row for request {index}, got none of "
                f"{self.max_batch} (rows taken outside generate?)"
            )
        live = _Live(index, req, rows[0], _NO_SLOTS, len(req.prompt), arrived_at=arrived_at)
        try:
            self._reuse(live)
            pre = live.slots
            more = self.allocator.alloc_extend(
                [len(pre)], [len(req.prompt)], [pre[-1] if len(pre) else -1]
            )
            if more is None:
                self._release(live)
                return None
            live.slots = np.concatenate([pre, more])
            self._write_table(live.row, 0, live.slots)
        except BaseException:
            self._release(live)
            raise
        return live

    def _prefill(self, admitted, waiting: collections.deque) -> list[_Live]:
        """Prefills `admitted` `(index, request, arrival time)` together; requests whose
        slots do not fit go back to the front of `waiting`. On a failure every admitted
        request's row and slots are given back (they are not running yet: nobody else
        would)."""
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
            for lv in lives:
                self._release(lv)
            raise
        waiting.extendleft(reversed(deferred))
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
        for i, lv in enumerate(running):
            # Held by its request from here on, so a failure below gives it back.
            lv.slots = np.append(lv.slots, new[i])
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


def _batch_bucket(n: int, max_batch: int) -> int:
    return min(1 << max(0, n - 1).bit_length(), max_batch)
