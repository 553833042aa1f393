"""jaxkv under sglang-jax (SGLang's JAX server).

- `LRUHostKVPool`: the host tier of sglang-jax's HiCache on jaxkv's host memory, a drop-in
  subclass of sglang-jax's `HostKVPool` (docs/sglang_jax.md, "HiCache's host pool on jaxkv").

sglang-jax is never a dependency of jaxkv. Importing this package (or any module in it) imports
nothing of it; reading `LRUHostKVPool` imports sglang-jax's `sgl_jax.srt.mem_cache.host_kv_pool`,
whose ABC the class subclasses, and raises `ImportError` (saying so) when sglang-jax cannot be
imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxkv.integrations.sglang_jax._host_pool import HiCacheHostPool as LRUHostKVPool

__all__ = ["LRUHostKVPool"]


def __getattr__(name: str) -> Any:
    if name == "LRUHostKVPool":
        from jaxkv.integrations.sglang_jax._host_pool import lru_host_kv_pool

        cls = globals()[name] = lru_host_kv_pool()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
