"""Write-back strategies: how blocks staged on the host reach a pool's buffers.

`view_of(pool, layout)` pairs a pool with its `Layout` (from `layout.describe`, the one place a
pool is described) as a `PoolView`: jaxkv pools are
written with one donated scatter and come back as a new pool (`PoolBase.with_buffers`); other
frameworks' SGLang-shaped objects are written in place where jaxkv can (host memory, torch
tensors on an accelerator) and have their jax buffers swapped otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np

from jaxkv._kernels import warn_if_copied
from jaxkv._pool_base import PoolBase
from jaxkv.connector import _foreign
from jaxkv.connector._block_kernels import block_starts, scatter_donated, write_slots
from jaxkv.connector.layout import BufferSpec, Layout, layers_of
from jaxkv.connector.transfer import Staging
from jaxkv.errors import ConsumedPoolError


def _device_array(x) -> jax.Array:
    """A jax view of a foreign device buffer (zero-copy through DLPack); jax arrays, on any
    device, are used as they are and never exported to numpy."""
    if isinstance(x, jax.Array):
        return x
    if hasattr(x, "__dlpack__"):
        return jax.dlpack.from_dlpack(x)
    raise TypeError(f"expected an array supporting DLPack, got {type(x).__name__}")


class PoolView:
    """A pool's layout plus access to its per-layer buffers for block transfers."""

    def __init__(self, pool, layout: Layout):
        self.pool = pool
        self.layout = layout

    def buffers(self, part: BufferSpec) -> list:
        """The part's layer buffers as the pool holds them."""
        layers = layers_of(self.pool, part.attr)
        assert layers is not None  # the layout was described from them
        return layers

    def replace_buffers(self, changes: Mapping[str, Sequence[jax.Array]]):
        """The pool with the buffers of each attribute in `changes` replaced (the old ones
        were donated); returns it."""
        raise NotImplementedError

    def check_replaceable(self) -> None:
        """`TypeError` unless `replace_buffers` can set every part's buffers: called before
        buffers are donated, when a refusal would leave deleted arrays behind."""

    def host_layers(self, part: BufferSpec) -> list | None:
        """The part's layer buffers when jaxkv moves them outside XLA, else None: numpy views
        of host memory, or raw-bit torch views of torch tensors on an accelerator (both are
        read with `_foreign.read_blocks` into host arrays and written in place)."""
        views = [_foreign.direct_view(b) for b in self.buffers(part)]
        return views if all(v is not None for v in views) else None

    def arrays(
        self, parts: Sequence[BufferSpec] | None = None
    ) -> tuple[tuple[jax.Array, ...], ...]:
        """Per part (default: all), the layer buffers as jax arrays."""
        parts = self.layout.parts if parts is None else parts
        return tuple(tuple(_device_array(b) for b in self.buffers(p)) for p in parts)

    def write(
        self, slots: np.ndarray, staging: Sequence[Staging], block_size: int, windows: bool = True
    ):
        """Writes `staging` (one `Staging` per part) at `slots`; returns the pool. `windows`
        False scatters row by row even where blocks are runs of slots (see `write_arrays`).

        `staging` holds one layer-major host array per part, `(layer_num, n_blocks, block_size,
        *row)`: each layer's slice is contiguous, so it reaches the device as its own zero-copy
        array and the scatter reads it directly (slicing a block-major array inside the jitted
        call makes XLA copy every layer's rows into fresh temporaries first).
        """
        raise NotImplementedError


class _JaxkvView(PoolView):
    def host_layers(self, part):
        return None

    def arrays(self, parts=None):
        parts = self.layout.parts if parts is None else parts
        return tuple(
            tuple(self.pool.layer_buffer(p.attr, i) for i in range(self.layout.layer_num))
            for p in parts
        )

    def write(self, slots, staging, block_size, windows=True):
        new = write_arrays(self.arrays(), self.layout.parts, slots, staging, block_size, windows)
        return self.replace_buffers({p.attr: bufs for p, bufs in zip(self.layout.parts, new)})

    def replace_buffers(self, changes):
        pool = self.pool.with_buffers(**changes)
        self.pool.mark_consumed()  # its buffers went to `pool`, as an eager update's do
        return pool


def write_arrays(
    arrays, parts: Sequence[BufferSpec], slots, staging, block_size: int, windows: bool = True
):
    """Scatters `staging` (one `Staging` per part) at `slots` into `arrays` (per part, per
    layer, donated) in one jitted call; returns the new arrays. Staging of more blocks than
    `slots` names (padded to a `bucket`) has its extra blocks dropped. Blocks that are runs of
    slots move as windows of rows unless `windows` is False (the other compiled variant, which
    `precompile` also runs)."""
    codecs = tuple(p.codec for p in parts)
    staged = tuple(st.on_device(arrays[0][0]) for st in staging)
    bound = max(int(np.prod(bufs[0].shape[: p.codec.token_axes])) for bufs, p in zip(arrays, parts))
    slots = write_slots(slots, block_size, int(staged[0][0].shape[0]), bound)
    starts = block_starts(slots, block_size) if windows else None
    new = scatter_donated(arrays, slots.astype(np.int32), starts, staged, codecs)
    warn_if_copied([b for bufs in arrays for b in bufs])
    if any(st.reused for st in staging):
        jax.block_until_ready(new)  # the staging memory is reused once this returns
    # Staging nobody reuses (a segment sent back whole): the caller's next step is queued
    # behind the scatter instead of waiting for it on the host.
    return new


class _ForeignView(PoolView):
    """SGLang-shaped objects. Buffers jaxkv moves itself (host memory, torch tensors on an
    accelerator) are written in place; jax buffers are replaced functionally (the object's
    sequence is swapped for the new arrays, donated ones replaced in place on the device).

    All or nothing: every part and layer is checked first (`_check_writable`); the in-place
    parts are written next, keeping the rows they overwrite so a later failure puts them back;
    every jax part then goes through one donated call, the last step that can fail, and the
    attributes proven settable are swapped.
    """

    def _check_writable(self) -> list:
        """Per part, its `host_layers` (None for jax parts), once every part and layer is known
        to be writable: a load that cannot finish raises before it changes anything."""
        name = type(self.pool).__name__
        direct = []
        for part in self.layout.parts:
            layers = self.buffers(part)
            host = self.host_layers(part)
            direct.append(host)
            if host is not None:
                for li, buf in enumerate(host):
                    problem = _foreign.writable_problem(buf, part.codec)
                    if problem is not None:
                        raise TypeError(
                            f"{part.attr}[{li}]: cannot write into {problem} "
                            f"({type(layers[li]).__name__}); pass writable, contiguous host "
                            "arrays, torch tensors or jax arrays"
                        )
                continue
            if not all(isinstance(b, jax.Array) for b in layers):
                raise TypeError(
                    f"{part.attr}: cannot write into {type(layers[0]).__name__} buffers on a "
                    "device; pass jax arrays, torch tensors, or host arrays numpy can write"
                )
            for li, buf in enumerate(layers):
                if buf.is_deleted():
                    raise ConsumedPoolError(
                        f"{part.attr}[{li}]: {name}'s jax buffer was deleted (donated to an "
                        "earlier call); give the load live buffers"
                    )
            self._check_settable(part.attr, layers)
        return direct

    def _check_settable(self, attr: str, layers) -> None:
        """`TypeError` unless `attr` takes a new sequence of buffers: the functional path swaps
        it after donating the old buffers, when failing would leave deleted arrays behind. The
        probe sets a fresh container like the one the write sets, then puts the original back
        (a pool that is itself the sequence must be a list, whose items are replaced)."""
        if not attr:
            if not isinstance(self.pool, list):
                raise TypeError(
                    f"pool: expected a list of jax buffers to replace in place, got a "
                    f"{type(self.pool).__name__}"
                )
            return
        try:
            setattr(self.pool, attr, _same_container(layers, layers))
            setattr(self.pool, attr, layers)
        except Exception as err:  # read-only property, frozen dataclass, namedtuple, a setter
            raise TypeError(
                f"{attr}: {type(self.pool).__name__} does not let its jax buffers be replaced "
                f"({err})"
            ) from err

    def _set(self, attr: str, layers) -> None:
        if not attr:
            self.pool[:] = layers
            return
        setattr(self.pool, attr, _same_container(getattr(self.pool, attr), layers))

    def check_replaceable(self) -> None:
        for part in self.layout.parts:
            self._check_settable(part.attr, self.buffers(part))

    def replace_buffers(self, changes):
        for attr in changes:
            self._check_settable(attr, layers_of(self.pool, attr))
        for attr, layers in changes.items():
            self._set(attr, layers)
        return self.pool

    def write(self, slots, staging, block_size, windows=True):
        parts = self.layout.parts
        direct = self._check_writable()
        undo = []  # (layer view, codec, rows it held): what a failure puts back
        try:
            for part, st, host in zip(parts, staging, direct):
                for li, buf in enumerate(host or ()):
                    rows = st.layer_rows(li)
                    undo.append((buf, part.codec, _foreign.save_rows(buf, part.codec, slots)))
                    _foreign.write_rows(buf, part.codec, slots, rows.reshape(-1, *rows.shape[2:]))
            jax_parts = [i for i, host in enumerate(direct) if host is None]
            if jax_parts:
                layers = tuple(tuple(self.buffers(parts[i])) for i in jax_parts)
                new = write_arrays(
                    layers,
                    [parts[i] for i in jax_parts],
                    slots,
                    [staging[i] for i in jax_parts],
                    block_size,
                    windows,
                )
        except BaseException:
            for buf, codec, rows in reversed(undo):
                _foreign.write_rows(buf, codec, slots, rows)
            raise
        for i, bufs in zip(jax_parts, new if jax_parts else ()):
            self._set(parts[i].attr, bufs)
        return self.pool


def _same_container(like, layers):
    """`layers` in a sequence of `like`'s kind: a list stays a list, anything else a tuple."""
    return list(layers) if isinstance(like, list) else tuple(layers)


def view_of(pool, layout: Layout) -> PoolView:
    """`pool` with its `layout` (from `layout.describe`) as the view that writes it: a jaxkv
    pool described by itself is written functionally, anything else as a foreign object."""
    if isinstance(pool, PoolBase) and layout.kind == pool.KIND:
        return _JaxkvView(pool, layout)
    return _ForeignView(pool, layout)
