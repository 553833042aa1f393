"""`MooncakeStore`: blocks in Mooncake's distributed store, shared by every serving host of a
cluster.

Mooncake keeps objects in segments of host memory that its clients mount (a serving process
may mount one, `segment_bytes`; a standalone holder such as the wheel's `mooncake_client`
mounts one and serves it), and a master (`mooncake_master`) places and finds them. Each block
is one object: the same self-describing, checksummed record as a disk file (see
`jaxkv.connector._records`), under `<key_prefix><block key>`.

Every batch is one call of the client: `batch_is_exist` for lookups, `batch_get_into` for
loads, `batch_is_exist` then `batch_put_from` for stores, `batch_remove` for discards. Records
move through host memory registered with the client once (`buffer_bytes`, see
`_mooncake_buffers`): a store writes each record's byte form there and the client sends it
from there; a load has the client write the objects there, and the records it returns are
views of that memory, verified in place (checksum, key, part sizes), never copied. A batch
larger than that memory, or arriving while readers still hold what it would reuse, moves
through memory of its own.

Faults never reach the serving loop: the master gone, slow or restarted, a segment's holder
gone (its objects cannot be read until the master drops them, about 10 s after its last
heartbeat), every segment full: each is a miss or a dropped write, counted in `stats()`. Each
call is waited for at most `timeout_s` (see `_mooncake_client`), and a failed call opens a
circuit breaker, as `RedisStore`'s. A record that fails verification, or one whose segment
did not answer, is removed, so the next store of the block writes it again.
"""

from __future__ import annotations

import concurrent.futures
import operator
import threading
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

from jaxkv._checks import bool_arg, int_arg, text_arg
from jaxkv.connector import _records
from jaxkv.connector._mooncake_buffers import (
    Arena,
    Layout,
    encoded_size,
    header,
    round_up,
    write,
)
from jaxkv.connector._mooncake_client import (
    INSTALL,
    INVALID_PARAMS,
    NO_SEGMENT,
    NO_SPACE,
    NOT_FOUND,
    NOT_READY,
    TRANSFER_FAIL,
    Connection,
    MooncakeError,
    check_reachable,
    code_name,
    metadata_address,
)
from jaxkv.connector._records import BlockRecord
from jaxkv.connector._redis_cluster import server_fault
from jaxkv.connector.remote import Breaker, seconds_arg
from jaxkv.connector.stores import BatchStore, StoreResult

T = TypeVar("T")

# Counters this store adds to `BlockStore`'s (as `RedisStore`'s).
_COUNTERS = ("round_trips", "dropped", "unavailable", "breaker_trips")
PROTOCOLS = ("tcp", "rdma")
BUFFER_BYTES = 64 << 20
SMALLEST_SEGMENT = 16 << 20
# The breaker's waits (as `RedisStore`'s defaults).
_RETRY_AFTER_S, _MAX_RETRY_AFTER_S = 1.0, 30.0


def _address(name: str, value: object) -> str:
    """`HOST:PORT` checked; else `ValueError` naming `name`."""
    text = text_arg(name, value)
    host, _, port = text.rpartition(":")
    if not host or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name}: expected HOST:PORT, got {value!r}")
    return text


class MooncakeStore(BatchStore):
    """Blocks in Mooncake's distributed store, reached through its master at `master`.

    Args:
        master: `HOST:PORT` of `mooncake_master` (its RPC port).
        metadata: the metadata server's connection string, e.g. the master's own HTTP one,
            `http://HOST:8080/metadata` (`mooncake_master --enable_http_metadata_server`).
        local_hostname: the address other clients reach this one at (its segment, if any).
        protocol: `"tcp"` (no special hardware) or `"rdma"`.
        device_name: RDMA devices to use, comma-separated (`""`: for TCP, or any device).
        segment_bytes: host memory this process lends to the cluster (a segment it mounts);
            0 (the default) lends none: blocks then live in segments of holders that outlive
            this process (a standalone `mooncake_client`, other servers). Blocks in this
            process's own segment are lost when it exits.
        buffer_bytes: host memory registered with the client, which records are written
            from and read into (one batch up to this size moves through it; larger ones
            through memory of their own).
        timeout_s: the longest one call to the cluster may take before it is a miss or a
            dropped write (each call moves at most `buffer_bytes`).
        key_prefix: put before every block key, to separate caches that share one cluster.

    Raises:
        ImportError: Mooncake's client is not installed (extra `mooncake`).
        TypeError: an argument of the wrong type.
        ValueError: a `master` that is not `HOST:PORT`, an empty `metadata` or
            `local_hostname`, a `protocol` other than `"tcp"` or `"rdma"`, a `segment_bytes`
            neither 0 nor at least 16 MiB, a `buffer_bytes` below 1 MiB, a `timeout_s`
            outside `(0, 86400]`.

    `stats()` adds `round_trips` (client calls for blocks), `dropped` (blocks not stored:
    the cluster failed, was full, or the breaker was open), `unavailable` (calls answered
    without the cluster: not set up yet, or the breaker open) and `breaker_trips`. `blocks`
    and `bytes` are 0: a client cannot count the cluster's objects (the master's metrics
    do). `rejected` counts blocks refused because every segment was full (or none is
    mounted).

    Its methods never raise the cluster's failures, even under a strict `KVConnector`: a
    failed call is counted (`io_errors`), logged, and answered as misses or dropped stores.

    Example:
        >>> store = MooncakeStore("10.0.0.2:50051",
        ...                       metadata="http://10.0.0.2:8080/metadata")  # doctest: +SKIP
    """

    def __init__(
        self,
        master: str,
        *,
        metadata: str,
        local_hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        segment_bytes: int = 0,
        buffer_bytes: int = BUFFER_BYTES,
        timeout_s: float = 1.0,
        key_prefix: str = "jaxkv:",
    ):
        super().__init__()
        self.master = _address("master", master)
        self.metadata = text_arg("metadata", metadata)
        self.local_hostname = text_arg("local_hostname", local_hostname)
        for name, value in (("metadata", metadata), ("local_hostname", local_hostname)):
            if not value.strip():
                raise ValueError(f"{name}: expected a non-empty string, got {value!r}")
        self.protocol = text_arg("protocol", protocol)
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol: expected one of {PROTOCOLS}, got {protocol!r}")
        self.device_name = text_arg("device_name", device_name)
        self.segment_bytes = int_arg("segment_bytes", segment_bytes, low=0)
        if 0 < self.segment_bytes < SMALLEST_SEGMENT:
            raise ValueError(
                f"segment_bytes: expected 0 or at least {SMALLEST_SEGMENT} (16 MiB, Mooncake's "
                f"smallest segment), got {segment_bytes!r}"
            )
        self.buffer_bytes = int_arg(
            "buffer_bytes", buffer_bytes, low=1 << 20, expected="an int >= 1048576 (1 MiB)"
        )
        self.timeout_s = seconds_arg("timeout_s", timeout_s)
        self.key_prefix = text_arg("key_prefix", key_prefix)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as err:
            raise ImportError(INSTALL) from err
        self._counters.update(dict.fromkeys(_COUNTERS, 0))
        # The largest record met so far: how much room a read gives each object before it
        # knows its size.
        self._record_bytes = 0
        self._size_lock = threading.Lock()
        self._helper = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxkv-crc")
        arena = Arena(self.buffer_bytes)

        def connect():
            check_reachable("master", self.master, self.timeout_s)
            where = metadata_address(self.metadata)
            if where is not None:
                check_reachable("metadata server", where, self.timeout_s)
            client = MooncakeDistributedStore()
            code = client.setup(
                self.local_hostname,
                self.metadata,
                self.segment_bytes,
                0,  # the client's own buffer: records move through `arena` instead
                self.protocol,
                self.device_name,
                self.master,
            )
            if code != 0:
                raise MooncakeError(
                    f"setup with master {self.master} and metadata {self.metadata} failed "
                    f"({code_name(code)})"
                )
            code = client.register_buffer(arena.address, arena.nbytes)
            if code != 0:
                client.close()
                raise MooncakeError(f"register_buffer: {code_name(code)}")
            return client

        breaker = Breaker(_RETRY_AFTER_S, _MAX_RETRY_AFTER_S, self._count)
        self._link = Connection(
            connect, arena, self.timeout_s, breaker, self._count, self._failures.note
        )

    def _name(self, key: str) -> str:
        return self.key_prefix + key

    def _size_hint(self, size: int) -> None:
        with self._size_lock:
            self._record_bytes = max(self._record_bytes, size)

    def _exist(self, names: list[str]) -> list[int] | None:
        return self._link.call("lookup", lambda client: client.batch_is_exist(names))

    def _code_failed(self, what: str, code: int, keys: Sequence[str]) -> None:
        """A per-key failure the client reported: counted in `io_errors` and logged."""
        self._count("io_errors")
        self._failures.note(what, MooncakeError(f"{code_name(code)} for key {keys[0]}"))

    # ---- BlockStore ------------------------------------------------------------------------
    # `strict` is checked and otherwise unused: the cluster's failures are answered as misses
    # and dropped writes (see the class), never listed.

    def contains_many(
        self, keys: Sequence[str], *, stop_at_miss: bool = False, strict: bool | None = None
    ) -> StoreResult[list[bool]]:
        """Per key, whether the master knows an object under it (see `BlockStore`: a record
        is verified when it is read)."""
        self._strictness(strict)
        bool_arg("stop_at_miss", stop_at_miss)
        held = [False] * len(keys)
        if not keys:
            return StoreResult(held)
        answer = self._exist([self._name(k) for k in keys])
        if answer is None:
            return StoreResult(held)
        for i, code in enumerate(answer):
            held[i] = code == 1
            if code not in (0, 1):
                self._code_failed("lookup", code, keys[i : i + 1])
            if stop_at_miss and not held[i]:
                break
        return StoreResult(held)

    def get_many(
        self, keys: Sequence[str], *, stop_at_miss: bool = False, strict: bool | None = None
    ) -> StoreResult[list[BlockRecord | None]]:
        self._strictness(strict)
        stop_at_miss = bool_arg("stop_at_miss", stop_at_miss)
        records: list[BlockRecord | None] = [None] * len(keys)
        if keys:
            self._read(keys, records)
        for i, record in enumerate(records):
            if record is None:
                self._count("misses")
                if stop_at_miss:
                    records[i:] = [None] * (len(records) - i)  # read, but not asked for
                    break
            else:
                self._count("hits")
                self._count("blocks_loaded")
                self._count("bytes_loaded", record.nbytes)
        return StoreResult(records)

    def _read(self, keys: Sequence[str], records: list[BlockRecord | None]) -> None:
        """Reads the records of `keys` into `records`: each object gets the room of the
        largest record met so far (its size asked first when none was); objects that did not
        fit are read again once their size is known."""
        names = [self._name(k) for k in keys]
        room = self._record_bytes or self._first_size(names)
        if room is None:
            return
        damaged: list[tuple[int, str]] = []
        larger = self._read_calls(range(len(keys)), lambda i: room, names, keys, records, damaged)
        if larger:
            asked = [names[i] for i in larger]
            sizes = self._link.call("size", lambda client: [client.get_size(n) for n in asked])
            sized = {i: size for i, size in zip(larger, sizes or []) if size > 0}
            self._read_calls(list(sized), sized.__getitem__, names, keys, records, damaged)
        self._remove_damaged([(keys[i], why) for i, why in damaged])

    def _first_size(self, names: list[str]) -> int | None:
        """The size of the first object found, in key order (one call asking key by key);
        None when none is, or the cluster failed."""

        def first(client) -> list[int]:
            sizes = []
            for name in names:
                sizes.append(client.get_size(name))
                if sizes[-1] > 0:
                    break
            return sizes

        found = [n for n in self._link.call("size", first) or [] if n > 0]
        if not found:
            return None
        self._size_hint(found[0])
        return found[0]

    def _calls(self, todo: Sequence[int], size_of: Callable[[int], int]) -> list[list[int]]:
        """`todo` cut into the batches of one client call each: at most `buffer_bytes` (a
        record larger than that alone). One call per batch: here, cutting a 32 MiB batch into
        calls that overlap its checksums with the transfer was slower (each call has a fixed
        cost, and the checksums and the transfer share the cores)."""
        calls: list[list[int]] = []
        used = self.buffer_bytes
        for i in todo:
            size = round_up(size_of(i))
            if used + size > self.buffer_bytes:
                calls.append([])
                used = 0
            calls[-1].append(i)
            used += size
        return calls

    def _read_calls(self, todo, room_of, names, keys, records, damaged) -> list[int]:
        """Reads the keys at `todo`, each into `room_of(i)` bytes, and verifies them. Returns
        the indices whose objects were larger than their room."""
        larger: list[int] = []
        for batch in self._calls(todo, room_of):
            rooms = [room_of(i) for i in batch]
            layout = Layout(rooms)
            region = self._link.arena.take(layout.nbytes)
            view = region.base.data.toreadonly()  # held: the region is not reused under us
            ptrs = [region.address + off for off in layout.offsets]
            asked = [names[i] for i in batch]
            read = operator.methodcaller("batch_get_into", asked, ptrs, rooms)  # bound now
            got = self._link.call("read", read, [region])
            if got is not None:
                larger += self._verify(batch, layout, view, got, keys, records, damaged)
        return larger

    def _verify(self, batch, layout, view, got, keys, records, damaged) -> list[int]:
        """Decodes what one read call brought into `view` (`got`: per key, its size or an
        error code); returns the indices whose objects were larger than their room."""

        def decode(j: int) -> BlockRecord | Exception:
            off, n = layout.offsets[j], got[j]
            try:
                # `decode` reads any buffer: the record's parts are views of `view`.
                return _records.decode(cast(bytes, view[off : off + n]), keys[batch[j]])
            except Exception as err:  # any bytes may come: none that fail are served
                if not server_fault(err):
                    raise
                return err

        arrived = [j for j, n in enumerate(got) if n > 0]
        larger = []
        for j, decoded in zip(arrived, self._both(decode, arrived)):
            if isinstance(decoded, BlockRecord):
                records[batch[j]] = decoded
                self._size_hint(got[j])
            else:
                damaged.append((batch[j], f"failed verification ({decoded})"))
        for i, n in zip(batch, got):
            if n == INVALID_PARAMS:  # the object is larger than the room it was given
                larger.append(i)
            elif n == TRANSFER_FAIL:  # its segment's holder is gone: remove it for a rewrite
                self._code_failed("read", n, [keys[i]])
                damaged.append((i, f"could not be read ({code_name(n)})"))
            elif n <= 0 and n not in (NOT_FOUND, NOT_READY):
                self._code_failed("read", n, [keys[i]])
        return larger

    def _both(self, work: Callable[[int], T], items: Sequence[int]) -> list[T]:
        """`work` of each item, the first half on this thread and the rest on the store's
        helper thread at the same time (checksums and copies run side by side)."""
        half = len(items) // 2
        if not half:
            return [work(i) for i in items]
        rest = self._helper.submit(lambda: [work(i) for i in items[half:]])
        return [work(i) for i in items[:half]] + rest.result()

    def _remove_damaged(self, damaged: list[tuple[str, str]]) -> None:
        """Removes records that failed verification or could not be read (counted in
        `verification_failures`), so that the next store of the block writes it again."""
        if not damaged:
            return
        self._count("verification_failures", len(damaged))
        names = [self._name(key) for key, _ in damaged]
        self._link.call("remove", lambda client: client.batch_remove(names, True))
        for key, why in damaged:
            self._dropped([key], "damaged", why)

    def put_many(
        self, records: Sequence[BlockRecord], *, strict: bool | None = None
    ) -> StoreResult[list[bool]]:
        """Stores the records the cluster does not hold yet (one lookup, then the writes:
        `True` for each record newly stored)."""
        self._strictness(strict)
        stored = [False] * len(records)
        if not records:
            return StoreResult(stored)
        held = self._exist([self._name(r.key) for r in records])
        if held is None:
            self._count("dropped", len(records))
            return StoreResult(stored)
        todo = [i for i, code in enumerate(held) if code != 1]
        heads = {i: header(records[i]) for i in todo}
        sizes = {i: encoded_size(heads[i], records[i]) for i in todo}
        for batch in self._calls(todo, sizes.__getitem__):
            self._write(batch, records, heads, sizes, stored)
        return StoreResult(stored)

    def _write(self, batch, records, heads, sizes, stored) -> None:
        """Writes the byte forms of the records at `batch` into one region and sends them
        with one `batch_put_from`."""
        layout = Layout([sizes[i] for i in batch])
        region = self._link.arena.take(layout.nbytes)

        def write_one(j: int) -> None:
            off, i = layout.offsets[j], batch[j]
            write(records[i], heads[i], region.base[off : off + sizes[i]])

        self._both(write_one, range(len(batch)))
        names = [self._name(records[i].key) for i in batch]
        ptrs = [region.address + off for off in layout.offsets]
        lengths = [sizes[i] for i in batch]
        codes = self._link.call(
            "write", lambda client: client.batch_put_from(names, ptrs, lengths), [region]
        )
        if codes is None:
            self._count("dropped", len(batch))
            return
        for i, code in zip(batch, codes):
            if code == 0:
                stored[i] = True
                self._size_hint(sizes[i])
                self._count("blocks_stored")
                self._count("bytes_stored", records[i].nbytes)
                continue
            if code in (NO_SPACE, NO_SEGMENT):
                self._count("rejected")  # every segment full, or none mounted
            else:
                self._code_failed("write", code, [records[i].key])
            self._count("dropped")

    def discard_many(
        self, keys: Sequence[str], *, strict: bool | None = None
    ) -> StoreResult[list[bool]]:
        """Removes the object under each key (see `BlockStore.discard`), even one read a moment
        ago (Mooncake leases objects to their readers); `False` where there was none or the
        cluster failed (counted in `io_errors`, never raised)."""
        self._strictness(strict)
        removed = [False] * len(keys)
        if not keys:
            return StoreResult(removed)
        names = [self._name(k) for k in keys]
        codes = self._link.call("remove", lambda client: client.batch_remove(names, True))
        for i, code in enumerate(codes or []):
            removed[i] = code == 0
            if code not in (0, NOT_FOUND):
                self._code_failed("remove", code, keys[i : i + 1])
        gone = [k for k, r in zip(keys, removed) if r]
        self._count("discarded", len(gone))
        self._dropped(gone, "discarded")
        return StoreResult(removed)

    def __len__(self) -> int:
        """0: a client cannot count the cluster's objects (see the class)."""
        return 0

    @property
    def ready(self) -> bool:
        """Whether the client is set up (until it is, every call is a miss)."""
        return self._link.ready

    def close(self) -> None:
        """Closes the client (a segment this process mounted is unmounted: its blocks are
        gone)."""
        self._link.close()
        self._helper.shutdown(wait=False)


# What a mooncake:// URL's query may name: MooncakeStore's keywords, text or a byte count.
_URL_TEXT = ("metadata", "local_hostname", "protocol")
_URL_BYTES = ("segment_bytes", "buffer_bytes")


def url_args(part: str, where: str = "") -> tuple[str, dict[str, Any]]:
    """`MooncakeStore`'s arguments from `mooncake://HOST:PORT?metadata=URL[&local_hostname=...
    &protocol=...&segment_bytes=...&buffer_bytes=...]`: the master, and the query as keywords
    (`metadata` required; the byte counts ASCII digits; values percent-decoded, so a
    metadata URL with a comma or an ampersand is written `%2C`, `%26`). Opens nothing.

    Raises:
        ValueError: naming what is wrong, for a URL of another form.
    """
    expected = "expected mooncake://HOST:PORT?metadata=URL[&KEYWORD=VALUE...]"
    parsed = urllib.parse.urlsplit(part)
    host, _, port = parsed.netloc.rpartition(":")
    if parsed.path not in ("", "/") or not host or not port.isascii() or not port.isdigit():
        raise ValueError(f"store: {expected}, got {part!r}{where}")
    kwargs: dict[str, Any] = {}
    for name, value in urllib.parse.parse_qsl(parsed.query, keep_blank_values=True):
        if name in kwargs:
            raise ValueError(f"store: {expected} naming {name} once, got {part!r}{where}")
        if name in _URL_BYTES and value.isascii() and value.isdigit():
            kwargs[name] = int(value)
        elif name in _URL_TEXT and value:
            kwargs[name] = value
        else:
            known = ", ".join(_URL_TEXT + _URL_BYTES)
            raise ValueError(
                f"store: {expected} (keywords {known}; byte counts in digits), got "
                f"{name}={value!r} in {part!r}{where}"
            )
    if "metadata" not in kwargs:
        raise ValueError(f"store: {expected}, got no metadata in {part!r}{where}")
    return parsed.netloc, kwargs
