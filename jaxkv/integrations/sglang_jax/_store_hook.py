"""The hook that puts the L3 tier (`storage.StoreRadixCache`) and jaxkv's host pool under
sglang-jax's scheduler: `install` wraps sglang-jax's tree factory, in this process, with the
settings `StoreSettings` holds; `uninstall` puts it back; `installed` says what is in place.
`storage` re-exports all three.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxkv.integrations.sglang_jax._store_settings import (
    ENV_STORE,
    StoreSettings,
    namespace_of,
    open_store,
)


def _store_tree(tree: Any, server_args: Any, settings: StoreSettings) -> Any:
    """`tree`, as sglang-jax's factory built it, rebuilt as a `StoreRadixCache`."""
    from sgl_jax.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    hicache = getattr(server_args, "hicache_storage", "disable")
    if hicache != "none":
        raise ValueError(
            f"--hicache-storage: expected none with {ENV_STORE} set (jaxkv's store sits "
            f"under HiCache's host memory), got {hicache}"
        )
    if type(tree) is not UnifiedRadixCache:
        raise ValueError(
            "tree cache: expected sglang-jax's UnifiedRadixCache (full attention), got "
            f"{type(tree).__name__}"
        )
    from jaxkv.integrations.sglang_jax.storage import radix_cache_class

    return radix_cache_class().from_tree(
        tree,
        store=open_store(settings.store),
        namespace=settings.namespace or namespace_of(server_args),
        wait_s=settings.wait_s,
        prefetch_bytes=settings.prefetch_bytes,
    )


class _Factory:
    """sglang-jax's `default_radix_cache_factory`, wrapped: the tree it builds is rebuilt as a
    `StoreRadixCache` over the store `settings` names."""

    def __init__(self, original: Callable[[Any], Any], settings: StoreSettings):
        self.original = original
        self.settings = settings

    def __call__(self, ctx: Any) -> Any:
        return _store_tree(self.original(ctx), ctx.server_args, self.settings)


def _registry() -> Any:
    from sgl_jax.srt.mem_cache import registry

    return registry


def install(settings: StoreSettings | None = None) -> None:
    """Makes sglang-jax build `StoreRadixCache` trees, in this process.

    Replaces `default_radix_cache_factory` in sglang-jax's `sgl_jax.srt.mem_cache.registry`
    (the module attribute its `create_tree_cache` calls, which `init_hicache` then equips) by
    a wrapper that rebuilds the tree it returns over the store `settings` names. Installing
    again replaces the settings. sglang-jax's scheduler runs in a process of its own: run the
    server with `python -m jaxkv.integrations.sglang_jax.serve`, which installs the hook in
    every process it spawns, or call this at the top level of the main module (outside
    `if __name__ == "__main__":`) of a program that starts sglang-jax's `Engine`.

    Args:
        settings: None reads them from the environment (`StoreSettings.from_env`).

    Raises:
        ValueError: settings missing from, or malformed in, the environment.
        TypeError: `settings` that are not `StoreSettings`.
        ImportError: sglang-jax cannot be imported.
    """
    settings = StoreSettings.from_env() if settings is None else settings
    if not isinstance(settings, StoreSettings):
        raise TypeError(f"settings: expected StoreSettings or None, got {type(settings).__name__}")
    registry = _registry()
    current = registry.default_radix_cache_factory
    original = current.original if isinstance(current, _Factory) else current
    _set_host_pool(settings.host_pool)
    registry.default_radix_cache_factory = _Factory(original, settings)


def _set_host_pool(jaxkv_pool: bool) -> None:
    """Puts jaxkv's host pool class in sglang-jax's `host_kv_pool` module in place of its own
    (`init_hicache` imports the class from there each time it builds a cache), or puts its
    own back. The class replaced is kept on jaxkv's (`replaced`), as the tree factory keeps
    the factory it wraps: the hook's state lives in what it patched, nowhere else."""
    from sgl_jax.srt.mem_cache import host_kv_pool

    from jaxkv.integrations.sglang_jax import LRUHostKVPool

    current = host_kv_pool.LRUHostKVPool
    if jaxkv_pool and current is not LRUHostKVPool:
        LRUHostKVPool.replaced = current
        host_kv_pool.LRUHostKVPool = LRUHostKVPool
    elif not jaxkv_pool and current is LRUHostKVPool:
        host_kv_pool.LRUHostKVPool = LRUHostKVPool.replaced


def uninstall() -> None:
    """Puts sglang-jax's own tree factory back (nothing when `install` did not run)."""
    registry = _registry()
    current = registry.default_radix_cache_factory
    if isinstance(current, _Factory):
        registry.default_radix_cache_factory = current.original
    _set_host_pool(False)


def installed() -> StoreSettings | None:
    """The settings the hook is installed with in this process, or None."""
    current = _registry().default_radix_cache_factory
    return current.settings if isinstance(current, _Factory) else None
