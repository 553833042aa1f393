"""Chained SHA-256 block keys, identical across processes and machines.

`h_0 = SHA256("jaxkv-block-v1" | namespace | layout fingerprint | salt)` and
`h_i = SHA256(h_{i-1} | tokens of block i as 4-byte little-endian)`: block i's key covers every
token up to its end, and the root keeps models, layouts and tenants apart (a tenant salt stops
one tenant from probing another's prefixes through cache timing, vLLM's CVE-2025-46570).
A salt is a `str` (hashed as its UTF-8 bytes, so `"t"` and `b"t"` name the same tenant), `bytes`,
or `None` (no salt, distinct from every salt, the empty one included); anything else is refused,
so that no two different values (say `0`, `False` and `""`) can fall onto one tenant's keys.
Python's `hash()` is salted per process and is never used.
"""

from __future__ import annotations

import hashlib
import threading

from jaxkv._checks import text_arg, token_array

_DOMAIN = b"jaxkv-block-v1"


def token_bytes(token_ids) -> bytes:
    """Token ids (by value, see `token_array`) as 4-byte little-endian words; rejects ids
    that do not fit."""
    return token_array(token_ids).astype("<u4", copy=False).tobytes()


def root_hash(namespace: str, layout_fingerprint: str, salt: str | bytes | None) -> bytes:
    h = hashlib.sha256(_DOMAIN)
    for field in (namespace.encode(), layout_fingerprint.encode()):
        h.update(len(field).to_bytes(8, "little"))
        h.update(field)
    if salt is None:
        h.update(b"\xff" * 8)  # distinct from every salt, the empty one included
    else:
        raw = salt_bytes(salt)
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
    return h.digest()


def salt_bytes(salt) -> bytes:
    """The bytes a salt stands for. Only `str` and `bytes` are salts: `bytes(3)` is three zero
    bytes and `bytes(False)` is empty, so accepting ints (or anything `bytes()` takes) would let
    unrelated values share one tenant's keys."""
    if isinstance(salt, str):
        return text_arg("salt", salt).encode()
    if isinstance(salt, bytes):
        return bytes(salt)
    # The type alone: the repr of a huge int is slow or refused outright. A str that UTF-8
    # cannot encode (a lone surrogate) is a ValueError naming the salt.
    raise TypeError(f"salt: expected a str, bytes or None, got {type(salt).__name__}")


def chain(root: bytes, data: bytes, block_size: int) -> list[bytes]:
    """Digests of every full block of `data` (4 bytes per token), chained from `root`."""
    step = 4 * block_size
    mv = memoryview(data)
    out, prev = [], root
    sha = hashlib.sha256
    for start in range(0, len(data) - step + 1, step):
        prev = sha(prev + mv[start : start + step]).digest()
        out.append(prev)
    return out


def block_digest(data: bytes) -> str:
    """Fingerprint of one block's own token bytes, kept in each record for verification."""
    return hashlib.sha256(data).hexdigest()


# Chains kept per connector, one per root (layout fingerprint and salt): a sharded pool has a
# root per shard group, and a few tenants' salts may interleave.
_KEPT_CHAINS = 16


class KeyChains:
    """A connector's recent key chains, the last one per root.

    A serving loop asks `lookup(prompt)` and then `load(prompt[:hit])` (and `store` of the
    same prompt later), whose digests are a prefix of it; a sharded pool's groups each have
    their own root. The root covers the namespace, layout and salt, so equal roots and token
    bytes give the same digests.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[bytes, tuple[bytes, list[bytes]]] = {}

    def digests(
        self, namespace: str, fingerprint: str, salt, data: bytes, block_size: int
    ) -> list[bytes]:
        """The block digests of token bytes `data` (full blocks only)."""
        root = root_hash(namespace, fingerprint, salt)
        last = self._last.get(root)  # one read: another thread may replace it meanwhile
        if last is not None and last[0].startswith(data):
            digests = last[1]
        else:
            digests = chain(root, data, block_size)
            last = (data, digests)
        with self._lock:  # the root becomes the most recently used
            self._last.pop(root, None)
            self._last[root] = last
            while len(self._last) > _KEPT_CHAINS:
                del self._last[next(iter(self._last))]  # the least recently used root's
        return digests[: len(data) // (4 * block_size)]
