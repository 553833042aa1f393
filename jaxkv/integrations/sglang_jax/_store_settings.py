"""What the L3 tier under sglang-jax's HiCache is built from: its settings, from the
environment (`StoreSettings.from_env`, inherited by every process sglang-jax spawns), the store
specs (`open_store`) and the namespace derived from the server's arguments (`namespace_of`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

from jaxkv.connector import (
    BlockStore,
    DiskStore,
    HostStore,
    MooncakeStore,
    RedisStore,
    TieredStore,
)
from jaxkv.connector.mooncake import url_args as mooncake_args

ENV_STORE = "JAXKV_SGLANG_JAX_STORE"
ENV_NAMESPACE = "JAXKV_SGLANG_JAX_NAMESPACE"
ENV_WAIT_MS = "JAXKV_SGLANG_JAX_WAIT_MS"
ENV_PREFETCH_MB = "JAXKV_SGLANG_JAX_PREFETCH_MB"
ENV_HOST_POOL = "JAXKV_SGLANG_JAX_HOST_POOL"
# The most one scheduling round waits for prefetches (a hard bound: within it, a match waits
# while blocks land and stops when the store stalls, see `_store_sides.ReadAhead.wait`).
WAIT_S = 1.0
PREFETCH_BYTES = 256 << 20
# The longest wait per scheduling round: a day. Waits are finite numbers of seconds, and the
# bound keeps them far inside what `threading.Event.wait` takes (~9.2e9 s).
MAX_WAIT_S = 86_400.0


def _memory_bytes() -> int:
    # Host memory beyond the machine's can never be held: a larger buffer or store is a typo.
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):  # a system that does not say: 1 PiB
        return 1 << 50


#: The most host memory a setting may name (`host:BYTES`, `prefetch_bytes`): this machine's
#: physical memory.
MEMORY_BYTES = _memory_bytes()
# The text docs/sglang_jax.md quotes; `open_store`'s docstring names every form it takes
# (redis+cluster:// and mooncake:// too).
_SPEC_HELP = (
    "expected a store spec: disk:PATH, host:BYTES, a redis://, rediss://, unix:// or "
    "redis+cluster:// URL, mooncake://HOST:PORT?metadata=URL, or several of them "
    "comma-separated, fastest first (a TieredStore)"
)
_REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")
_MOONCAKE = "mooncake://"
# What a mooncake:// URL's query may name: MooncakeStore's keywords, text or a byte count.
# Server arguments that name the weights (and the KV cache's dtype) a tree's KV comes from.
_WEIGHTS_ARGS = ("model_path", "revision", "dtype", "quantization", "kv_cache_dtype")

# ---- settings -----------------------------------------------------------------------------


def spec_parts(spec: object) -> list[tuple[str, str]]:
    """`spec` (see `open_store`) as (kind, argument) pairs, checked, with the spaces around
    each part, its kind and its argument removed; opens nothing."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"store: {_SPEC_HELP}, got {spec!r}")
    parts = []
    for part in (p.strip() for p in spec.split(",")):
        kind, _, arg = (s.strip() for s in part.partition(":"))
        where = "" if part == spec else f" in {spec!r}"
        if part.startswith(_REDIS_SCHEMES):
            parts.append(("redis", part))
        elif part.startswith(_MOONCAKE):
            mooncake_args(part, where)
            parts.append(("mooncake", part))
        elif kind == "disk" and arg:
            parts.append(("disk", arg))
        elif kind == "host" and arg.isascii() and arg.isdigit() and int(arg) > 0:
            if int(arg) > MEMORY_BYTES:
                raise ValueError(
                    f"store: expected host:BYTES of at most {MEMORY_BYTES} (this machine's "
                    f"memory), got {part!r}{where}"
                )
            parts.append(("host", arg))
        else:
            raise ValueError(f"store: {_SPEC_HELP}, got {part!r}{where}")
    return parts


def _open_mooncake(part: str) -> MooncakeStore:
    master, kwargs = mooncake_args(part)
    return MooncakeStore(master, **kwargs)


def open_store(spec: str) -> BlockStore:
    """The store `spec` names.

    Args:
        spec: `disk:PATH` (a `DiskStore` in that folder), `host:BYTES` (a `HostStore` of that
            capacity, this process's alone, ASCII digits, at most `MEMORY_BYTES`), a
            `redis://`, `rediss://`, `unix://` or `redis+cluster://` URL (a `RedisStore`; a
            cluster's extra startup nodes as `?nodes=HOST:PORT;HOST:PORT`), a
            `mooncake://HOST:PORT?metadata=URL` URL (a `MooncakeStore`, see
            `jaxkv.connector.mooncake.url_args`), or several of them comma-separated,
            fastest first (a `TieredStore` of them). Spaces around a part, its kind and
            its argument are ignored: `disk: /cache` is the folder `/cache`.

    Returns:
        The store, opened.

    Raises:
        ValueError: a spec that names none of these (or a store's own argument error).

    Example:
        >>> type(open_store("host:1048576")).__name__
        'HostStore'
        >>> [type(s).__name__ for s in open_store("host:1048576,disk:blocks").tiers]
        ['HostStore', 'DiskStore']
    """
    opened: dict[str, Callable[[str], BlockStore]] = {
        "disk": DiskStore,
        "host": lambda arg: HostStore(int(arg)),
        "redis": RedisStore,
        "mooncake": _open_mooncake,
    }
    stores = [opened[kind](arg) for kind, arg in spec_parts(spec)]
    return stores[0] if len(stores) == 1 else TieredStore(*stores)


def namespace_of(server_args: object) -> str:
    """The connector namespace of a server: the arguments that name its weights and KV dtype.

    Blocks are only shared between servers whose namespace is equal, so it must change when
    the weights do. A checkpoint rewritten in place under the same `model_path` keeps this
    name: set `JAXKV_SGLANG_JAX_NAMESPACE` (`StoreSettings.namespace`) to one naming the
    weights themselves (a checkpoint hash) in that case.

    Args:
        server_args: sglang-jax's `ServerArgs` (or any object with its attribute names).

    Returns:
        `"sglang-jax:model_path=...,revision=...,dtype=...,quantization=...,kv_cache_dtype=..."`.

    Example:
        >>> from types import SimpleNamespace
        >>> namespace_of(SimpleNamespace(model_path="Qwen/Qwen3-8B", revision=None,
        ...     dtype="bfloat16", quantization=None, kv_cache_dtype="auto"))
        'sglang-jax:model_path=Qwen/Qwen3-8B,revision=None,dtype=bfloat16,quantization=None,kv_cache_dtype=auto'
    """
    return "sglang-jax:" + ",".join(
        f"{name}={getattr(server_args, name, None)}" for name in _WEIGHTS_ARGS
    )


def _env_number(
    env: Mapping[str, str], name: str, default: float, *, positive: bool, most: float, unit: str
) -> float:
    """The number in `env[name]` (ASCII: `float`'s syntax), checked to lie in `[0, most]`
    (`(0, most]` when `positive`); `default` when unset or blank."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    low = "above 0" if positive else "from 0"
    expected = f"a number of {unit} {low} to {most:.15g}"
    try:
        value = float(raw) if raw.isascii() else math.nan
    except ValueError:
        value = math.nan
    if not 0 <= value <= most or (positive and value == 0):  # NaN fails every compare
        raise ValueError(f"{name}: expected {expected}, got {raw!r}")
    return value


@dataclasses.dataclass(frozen=True)
class StoreSettings:
    """What `install` builds each tree's store tier from.

    Attributes:
        store: the store, as a spec for `open_store`; opened by the process that builds the
            tree (sglang-jax's scheduler).
        namespace: the connector's namespace; None derives it from the server's arguments
            (`namespace_of`).
        wait_s: the most one scheduling round waits for prefetches from the store, in
            seconds, from 0 to `MAX_WAIT_S` (a day): a hard bound. Within it a match waits
            while blocks keep landing, and stops once its prefetch ended or the store landed
            nothing for 0.5 s (then later matches wait for nothing until it lands a block).
        prefetch_bytes: host memory for blocks read ahead from the store, an int from 1 to
            `MEMORY_BYTES` (this machine's memory).
        host_pool: put HiCache's host tier (L2) on jaxkv's host memory too (the default):
            `install` makes sglang-jax's `init_hicache` build
            `jaxkv.integrations.sglang_jax.LRUHostKVPool`; False keeps sglang-jax's own.

    Raises:
        ValueError: a malformed `store` spec, a `wait_s` or `prefetch_bytes` out of range.
        TypeError: a `namespace` that is neither a str nor None.
    """

    store: str
    namespace: str | None = None
    wait_s: float = WAIT_S
    prefetch_bytes: int = PREFETCH_BYTES
    host_pool: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.host_pool, bool):
            raise TypeError(f"host_pool: expected a bool, got {type(self.host_pool).__name__}")
        spec_parts(self.store)
        if self.namespace is not None and not isinstance(self.namespace, str):
            raise TypeError(
                f"namespace: expected a str or None, got {type(self.namespace).__name__}"
            )
        check_tier_args(self.wait_s, self.prefetch_bytes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> StoreSettings:
        """The settings the environment gives (inherited by every process sglang-jax starts):

        - `JAXKV_SGLANG_JAX_STORE` (required): the store spec (`open_store`).
        - `JAXKV_SGLANG_JAX_NAMESPACE`: the namespace (default: from the server's arguments).
        - `JAXKV_SGLANG_JAX_WAIT_MS`: the most one scheduling round waits for prefetches, in
          ms (default 1000; at most 86400000, a day); see `wait_s`.
        - `JAXKV_SGLANG_JAX_PREFETCH_MB`: host memory for prefetched blocks, in MiB (256; at
          most this machine's memory).
        - `JAXKV_SGLANG_JAX_HOST_POOL`: `jaxkv` (the default) puts HiCache's host tier on
          jaxkv's `LRUHostKVPool` too; `sglang-jax` keeps sglang-jax's own.

        Args:
            environ: the variables; None reads `os.environ`.

        Raises:
            ValueError: no store spec, or a malformed value (the message names the variable).
        """
        env = os.environ if environ is None else environ
        store = env.get(ENV_STORE, "")
        if not store.strip():
            got = "nothing (unset)" if ENV_STORE not in env else repr(store)
            raise ValueError(f"{ENV_STORE}: {_SPEC_HELP}, got {got}")
        try:
            spec_parts(store)
        except ValueError as err:
            raise ValueError(f"{ENV_STORE}: {str(err).removeprefix('store: ')}") from None
        wait_ms = _env_number(
            env, ENV_WAIT_MS, WAIT_S * 1e3, positive=False, most=MAX_WAIT_S * 1e3, unit="ms"
        )
        mib = _env_number(
            env,
            ENV_PREFETCH_MB,
            PREFETCH_BYTES / (1 << 20),
            positive=True,
            most=MEMORY_BYTES / (1 << 20),
            unit="MiB",
        )
        host_pool = env.get(ENV_HOST_POOL, "jaxkv")
        if host_pool not in ("jaxkv", "sglang-jax"):
            raise ValueError(
                f"{ENV_HOST_POOL}: expected 'jaxkv' or 'sglang-jax', got {host_pool!r}"
            )
        return cls(
            store=store,
            namespace=env.get(ENV_NAMESPACE) or None,
            wait_s=wait_ms / 1e3,
            prefetch_bytes=min(max(1, int(mib * (1 << 20))), MEMORY_BYTES),
            host_pool=host_pool == "jaxkv",
        )


def check_tier_args(
    wait_s: object, prefetch_bytes: object, *, tree: Any = None, store: object = None
) -> None:
    """Checks the arguments of a tier (`StoreSettings`'s, and `StoreTier`'s `tree` and
    `store` when given). Raises `ValueError` or `TypeError` naming the argument."""
    if (
        isinstance(wait_s, bool)
        or not isinstance(wait_s, (int, float))
        or not 0 <= wait_s <= MAX_WAIT_S  # NaN fails every compare
    ):
        raise ValueError(
            f"wait_s: expected a number of seconds from 0 to {MAX_WAIT_S:.0f} (a day), "
            f"got {wait_s!r}"
        )
    if (
        not isinstance(prefetch_bytes, int)
        or isinstance(prefetch_bytes, bool)
        or not 1 <= prefetch_bytes <= MEMORY_BYTES
    ):
        raise ValueError(
            f"prefetch_bytes: expected an int from 1 to {MEMORY_BYTES} (this machine's "
            f"memory), got {prefetch_bytes!r}"
        )
    if store is not None and not isinstance(store, BlockStore):
        raise TypeError(f"store: expected a BlockStore, got {type(store).__name__}")
    if tree is None:
        return
    if len(tree.tree_components) != 1 or tree.supports_recurrent():
        raise ValueError(
            "tree_components: expected the FULL component alone (recurrent state is not "
            f"stored), got {tree.tree_components}"
        )
    if tree.is_eagle:
        raise ValueError(
            "is_eagle: expected False (EAGLE's bigram keys name token pairs, not the "
            "tokens the store's keys hash), got True"
        )
