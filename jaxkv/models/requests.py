"""What the serving engine serves and holds per request: `Request`, `Result`, and the state
of a request being served.

`Request` and `Result` are the engine's public inputs and outputs (also importable from
`jaxkv.models` and `jaxkv.models.serving`). A request is checked whole before the engine
allocates anything for it; while it runs, its row, slots and prefix-cache locks are kept exact,
so that a failed call gives back exactly what it holds.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxkv._checks import is_int

__all__ = ["Request", "Result"]


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

    The prompt's tokens are counted once each, by where their KV came from:
    `device_tokens + reused_tokens + computed_tokens == len(prompt)`.

    Attributes:
        tokens: generated token ids `(n,)`.
        logits: float32 `(n, vocab)`, the logits each token was chosen from (greedy).
        ttft_s: seconds from arrival to the first token, XLA compilation excluded.
        reused_tokens: prompt tokens loaded from the store instead of computed (store hits).
        device_tokens: prompt tokens found in the engine's prefix cache on the device (device
            hits: read in place, neither loaded nor computed).
        computed_tokens: prompt tokens prefilled (misses); at least the last prompt token,
            whose logits start the generation.
    """

    tokens: np.ndarray
    logits: np.ndarray
    ttft_s: float
    reused_tokens: int
    device_tokens: int = 0
    computed_tokens: int = 0


_NO_SLOTS = np.zeros(0, np.int64)


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


@dataclasses.dataclass
class _Live:
    """A request being served, and what it holds, kept exact after every call that changes it
    so that `Engine._release` gives back exactly that whenever a call fails.

    `slots` is the request's row: the slot of each of its tokens with K/V, in token order.
    Its first `cached` slots are the prefix cache's, protected by the handles in `locks`; of
    the rest, the request holds `owned` (every slot it must free, which is not always a tail
    of `slots`: see `Engine._cache_prompt`). `row` is -1 once given back.
    """

    index: int
    req: Request
    row: int
    slots: np.ndarray
    seq_len: int = 0  # tokens whose K/V are in the pool
    owned: np.ndarray = dataclasses.field(default_factory=lambda: _NO_SLOTS)
    locks: list = dataclasses.field(default_factory=list)
    cached: int = 0
    device: int = 0  # prompt tokens found on the device
    reused: int = 0  # prompt tokens loaded from the store
    arrived_at: float = 0.0
    ttft: float = 0.0
    tokens: list = dataclasses.field(default_factory=list)
    logits: list = dataclasses.field(default_factory=list)

    @property
    def budget(self) -> int:
        """The most tokens this request will ever hold in the cache."""
        return len(self.req.prompt) + self.req.max_new_tokens - 1

    @property
    def start(self) -> int:
        """Prompt tokens whose K/V were in the pool before its prefill (device + store)."""
        return self.device + self.reused

    def kv_tokens(self) -> np.ndarray:
        """The token ids of its `seq_len` tokens with K/V: the prompt, then every generated
        token but the last (which no step has read yet)."""
        prompt = self.req.prompt
        extra = np.asarray(self.tokens[: self.seq_len - len(prompt)], np.int32)
        return np.concatenate([prompt, extra])
