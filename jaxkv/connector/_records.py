"""Block records and their self-describing byte form, shared by every store.

A record is one block of one pool layout: per part, an array `(layer_num, block_size, *row)` of
raw bits, plus the block key, the layout fingerprint and a fingerprint of the block's own token
ids. Its byte form, which any byte-oriented store (disk, remote) keeps as one value:

    magic "JAXKVBLK" | version u32 | header length u32 | header (JSON) | payload | crc32 u32

The header names the key, layout, token fingerprint and each part's dtype, shape and byte
range; the CRC covers everything before it. `decode` checks every field against the bytes it
was given and raises `CorruptRecordError` on any mismatch: a damaged or truncated record is never
served.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import zlib
from collections.abc import Mapping

import numpy as np

MAGIC = b"JAXKVBLK"
VERSION = 1
_PREFIX = struct.Struct("<8sII")
_CRC = struct.Struct("<I")


class CorruptRecordError(ValueError):
    """Stored bytes that are not an intact record of the expected key."""


class Segment:
    """Host memory that one device-to-host transfer produced and handed over for good.

    Per part, a block-major array `(n_blocks, layer_num, block_size, *row)`: `host[name]` is a
    read-only numpy view of `arrays[name]`, the transfer's own output (a jax array in pinned
    host memory on accelerators). Nothing writes it after the transfer, so a store may keep
    blocks of it instead of copying them, and a load may send it back to the device as it is.

    Attributes:
        arrays: per part, the jax array the transfer produced (kept opaque here).
        host: per part, a read-only numpy view of the same memory.
        nbytes: bytes of all parts.
        blocks: blocks per part (`n_blocks`).
    """

    __slots__ = ("arrays", "host", "nbytes", "blocks", "_block_0")

    def __init__(self, arrays: Mapping[str, object], host: Mapping[str, np.ndarray]):
        self.arrays = dict(arrays)
        self.host = dict(host)
        self.nbytes = sum(int(a.nbytes) for a in self.host.values())
        self.blocks = int(next(iter(self.host.values())).shape[0]) if self.host else 0
        # Per part: block 0's address, the step between blocks, a block's shape, strides and
        # dtype; what `holds` compares a record's arrays with, without making views.
        self._block_0 = {
            name: (address(a), a.strides[0], a.shape[1:], a.strides[1:], a.dtype)
            for name, a in self.host.items()
        }

    def holds(self, parts: Mapping[str, np.ndarray], index: int) -> bool:
        """Whether `parts` are exactly block `index` of this segment (same memory, shapes,
        strides and dtypes, and the same part names)."""
        if not 0 <= index < self.blocks or parts.keys() != self._block_0.keys():
            return False
        for name, arr in parts.items():
            start, step, shape, strides, dtype = self._block_0[name]
            if (
                arr.shape != shape
                or arr.strides != strides
                or arr.dtype != dtype
                or address(arr) != start + index * step
            ):
                return False
        return True


def address(arr: np.ndarray) -> int:
    """Where `arr`'s data starts in memory."""
    return arr.__array_interface__["data"][0]


@dataclasses.dataclass(frozen=True)
class BlockRecord:
    """One stored block: `parts[name]` has shape `(layer_num, block_size, *row)`.

    `source`, when set, is `(segment, index)`: the parts are block `index` of `segment`, memory
    nobody writes again (see `Segment`). Records without one are only valid while the call that
    received them runs, unless their producer says otherwise.
    """

    key: str
    layout: str
    tokens: str
    parts: Mapping[str, np.ndarray]
    source: tuple[Segment, int] | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.parts.values())

    def to_bytes(self) -> bytes:
        """The record's byte form, as the remote and disk stores keep it (checksummed)."""
        return encode(self)

    def __getstate__(self):
        # A copy's parts are other memory: it does not inherit `is_block_of`'s memo.
        return {k: v for k, v in self.__dict__.items() if k != "_block_parts"}


def is_block_of(record: BlockRecord) -> bool:
    """Whether `record` has a source and its parts are exactly that block of the segment.

    A record found to be is remembered with its part arrays: while it holds the same array
    objects, later calls (every load of a stored prefix) compare identities, not addresses.
    """
    if record.source is None:
        return False
    parts = tuple(record.parts.items())
    checked = record.__dict__.get("_block_parts")  # not a field: a frozen record's memo
    if checked is not None and len(checked) == len(parts):
        if all(n == m and a is b for (n, a), (m, b) in zip(checked, parts)):
            return True
    if not record.source[0].holds(record.parts, record.source[1]):
        return False
    record.__dict__["_block_parts"] = parts
    return True


def encode(record: BlockRecord) -> bytes:
    """The record's byte form (see the module docstring)."""
    body = b"".join(
        [head(record)] + [np.ascontiguousarray(a).tobytes() for a in record.parts.values()]
    )
    return body + _CRC.pack(zlib.crc32(body))


def head(record: BlockRecord) -> bytes:
    """The start of the record's byte form: the prefix and the JSON header, which the parts'
    bytes and the CRC32 of all of it follow (a store writing the form in place writes these
    bytes, then the parts)."""
    parts, offset = [], 0
    for name, arr in record.parts.items():
        parts.append([name, arr.dtype.str, list(arr.shape), offset, int(arr.nbytes)])
        offset += int(arr.nbytes)
    header = json.dumps(
        {
            "key": record.key,
            "layout": record.layout,
            "tokens": record.tokens,
            "parts": parts,
            "payload": offset,
        },
        separators=(",", ":"),
    ).encode()
    return _PREFIX.pack(MAGIC, VERSION, len(header)) + header


def decode(data: bytes, key: str) -> BlockRecord:
    """Parses and verifies `data` as the record of `key`; raises `CorruptRecordError`."""
    mv = memoryview(data)
    if len(mv) < _PREFIX.size + _CRC.size:
        raise CorruptRecordError(f"record {key}: {len(mv)} bytes is shorter than any record")
    magic, version, header_len = _PREFIX.unpack_from(mv)
    if magic != MAGIC or version != VERSION:
        raise CorruptRecordError(f"record {key}: bad magic or version {magic!r} v{version}")
    (crc,) = _CRC.unpack_from(mv, len(mv) - _CRC.size)
    if zlib.crc32(mv[: len(mv) - _CRC.size]) != crc:
        raise CorruptRecordError(f"record {key}: checksum mismatch")
    start = _PREFIX.size + header_len
    try:
        header = json.loads(bytes(mv[_PREFIX.size : start]))
        payload = mv[start : len(mv) - _CRC.size]
        if header["key"] != key:
            raise CorruptRecordError(f"record {key}: holds key {header['key']}")
        if header["payload"] != len(payload):
            raise CorruptRecordError(f"record {key}: payload length {len(payload)}")
        parts = {}
        for name, dtype, shape, offset, nbytes in header["parts"]:
            dt = np.dtype(dtype)
            if int(np.prod(shape, dtype=np.int64)) * dt.itemsize != nbytes:
                raise CorruptRecordError(f"record {key}: part {name} size mismatch")
            arr = np.frombuffer(payload[offset : offset + nbytes], dt).reshape(shape)
            parts[name] = arr
        return BlockRecord(header["key"], header["layout"], header["tokens"], parts)
    except (KeyError, TypeError, ValueError) as err:
        if isinstance(err, CorruptRecordError):
            raise
        raise CorruptRecordError(f"record {key}: malformed header ({err})") from err


HEAD_BYTES = 4096  # enough for the header of any layout jaxkv writes


def expected_size(head: bytes) -> int | None:
    """The full length the record starting with `head` declares, or `None` when `head` is not
    the start of a record (or is cut inside its header). A cheap check that a stored record is
    whole without reading its payload; the checksum is verified when it is read."""
    if len(head) < _PREFIX.size:
        return None
    magic, version, header_len = _PREFIX.unpack_from(head)
    start = _PREFIX.size + header_len
    if magic != MAGIC or version != VERSION or len(head) < start:
        return None
    try:
        payload = json.loads(head[_PREFIX.size : start])["payload"]
    except (KeyError, TypeError, ValueError):
        return None
    if not isinstance(payload, int) or payload < 0:
        return None
    return start + payload + _CRC.size
