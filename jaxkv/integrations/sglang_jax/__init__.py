"""jaxkv under sglang-jax (SGLang's JAX server).

- `LRUHostKVPool`: the host tier of sglang-jax's HiCache on jaxkv's host memory, a drop-in
  subclass of sglang-jax's `HostKVPool` (docs/sglang_jax.md, "HiCache's host pool on jaxkv").
- `install`, `uninstall`, `StoreSettings`, `StoreRadixCache`: the persistent tier under
  HiCache, a jaxkv store keyed by each prefix's token chain (the `storage` module; the
  `serve` module runs sglang-jax's server with it installed in every process).

sglang-jax is never a dependency of jaxkv. Importing this package (or any module in it) imports
nothing of it; reading `LRUHostKVPool` imports sglang-jax's `sgl_jax.srt.mem_cache.host_kv_pool`,
whose ABC the class subclasses, and raises `ImportError` (saying so) when sglang-jax cannot be
imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxkv.integrations.sglang_jax._host_pool import HiCacheHostPool as LRUHostKVPool
    from jaxkv.integrations.sglang_jax.storage import StoreRadixCache

from jaxkv.integrations.sglang_jax.storage import StoreSettings, install, uninstall

__all__ = ["LRUHostKVPool", "StoreRadixCache", "StoreSettings", "install", "uninstall"]


def __getattr__(name: str) -> Any:
    if name == "LRUHostKVPool":
        from jaxkv.integrations.sglang_jax._host_pool import lru_host_kv_pool

        cls = globals()[name] = lru_host_kv_pool()
        return cls
    if name == "StoreRadixCache":
        from jaxkv.integrations.sglang_jax.storage import radix_cache_class

        tree = globals()[name] = radix_cache_class()
        return tree
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
