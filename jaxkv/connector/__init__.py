"""Block connector: move KV blocks between pools and host, disk, remote (Redis, Mooncake) and
tiered stores.

Blocks are keyed by chained SHA-256 hashes of their token ids, namespaced by model, layout and
an optional tenant salt, and reloaded bit-exact; a record that fails verification is never
loaded.
"""

from jaxkv.connector._connector import KVConnector
from jaxkv.connector._records import BlockRecord, CorruptRecordError
from jaxkv.connector._shards import min_block_count
from jaxkv.connector.disk import DiskStore
from jaxkv.connector.host import HostStore
from jaxkv.connector.layout import BufferLayout, PoolLayout
from jaxkv.connector.mooncake import MooncakeStore
from jaxkv.connector.remote import RedisStore
from jaxkv.connector.stores import BlockStore, StoreResult
from jaxkv.connector.tiered import TieredStore
from jaxkv.errors import UnsupportedKVCacheError

__all__ = [
    "KVConnector",
    "PoolLayout",
    "BufferLayout",
    "HostStore",
    "DiskStore",
    "RedisStore",
    "MooncakeStore",
    "TieredStore",
    "BlockStore",
    "StoreResult",
    "BlockRecord",
    "CorruptRecordError",
    "min_block_count",
    "UnsupportedKVCacheError",
]
