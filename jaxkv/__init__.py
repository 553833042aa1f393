"""jaxkv: the KV-cache memory layer for JAX serving stacks.

KV pools as immutable pytrees with O(tokens) functional updates, SGLang-exact slot and page
allocators, and (in `jaxkv.connector`) a block connector that moves KV blocks between pools and
host, disk, Redis and tiered stores, bit-exact.
"""

from jaxkv._version import __version__
from jaxkv.allocators import PagedAllocator, ReqToTokenPool, TokenAllocator
from jaxkv.errors import ConsumedPoolError, CopyWarning, UnsupportedKVCacheError
from jaxkv.pools import KOnlyPool, MHAPool, MLAPool, NSAPool
from jaxkv.radix_cache import PrefixMatch, RadixCache

# SGLang names, so code ported from SGLang reads the same.
MHATokenToKVPool = MHAPool
MLATokenToKVPool = MLAPool
NSATokenToKVPool = NSAPool
MHATokenToKOnlyPool = KOnlyPool

__all__ = [
    "__version__",
    "MHAPool",
    "MLAPool",
    "NSAPool",
    "KOnlyPool",
    "MHATokenToKVPool",
    "MLATokenToKVPool",
    "NSATokenToKVPool",
    "MHATokenToKOnlyPool",
    "TokenAllocator",
    "PagedAllocator",
    "ReqToTokenPool",
    "RadixCache",
    "PrefixMatch",
    "UnsupportedKVCacheError",
    "ConsumedPoolError",
    "CopyWarning",
]
