"""Device kernels of block transfers: gather whole blocks of every layer into block-major
staging, scatter staging back, pick blocks of a staged segment. Each runs as one jitted call
over every layer and part.

`starts` is not None when every block's slots are one contiguous run (the usual case: a block
is a page, or a run of pages): then each (block, layer) of a token-major buffer moves as one
window of block_size rows, which XLA:CPU copies at memcpy speed, instead of row by row. Buffers
whose codec is not token-major (NSA index records live inside pages) always go token by token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import _dtypes


def _window_dnums(row_ndim: int, gather: bool):
    window = tuple(range(1, row_ndim + 2))
    if gather:
        return jax.lax.GatherDimensionNumbers(
            offset_dims=window, collapsed_slice_dims=(), start_index_map=(0,)
        )
    return jax.lax.ScatterDimensionNumbers(
        update_window_dims=window, inserted_window_dims=(), scatter_dims_to_operand_dims=(0,)
    )


def _windows(codec, starts) -> bool:
    """Whether blocks move as windows of rows: each block one run of slots, and slots the
    buffer's (flattened) rows, so a run of slots is a run of rows."""
    return starts is not None and codec.token_major and codec.rows_are_slots


def _read_blocks(codec, buf, slots, starts, block_size):
    """(n_blocks, block_size, *row) bits of one layer buffer."""
    if _windows(codec, starts):
        rows = codec.as_rows(buf)
        return jax.lax.gather(
            rows,
            starts[:, None],
            _window_dnums(rows.ndim - 1, True),
            slice_sizes=(block_size, *rows.shape[1:]),
            mode="fill",
            fill_value=0,
        )
    rows = codec.read(buf, slots)
    return rows.reshape(-1, block_size, *rows.shape[1:])


def _write_blocks(codec, buf, slots, starts, blocks):
    if _windows(codec, starts):
        rows = codec.as_rows(buf)
        new = jax.lax.scatter(
            rows,
            starts[:, None],
            blocks,
            _window_dnums(rows.ndim - 1, False),
            indices_are_sorted=False,
            unique_indices=False,
            mode="drop",
        )
        return new.reshape(buf.shape)
    return codec.load(buf, slots, blocks.reshape(-1, *blocks.shape[2:]))


# Blocks move as raw bits, never as floats: XLA:CPU quiets or canonicalises NaN payloads when it
# gathers or scatters bf16 and fp8 values, and a foreign pool may keep its buffers in those dtypes.


def _gather(arrays, slots, starts, codecs, block_size):
    return tuple(
        jnp.stack(
            [_read_blocks(c, _dtypes.to_bits(b), slots, starts, block_size) for b in bufs], axis=1
        )
        for bufs, c in zip(arrays, codecs)
    )


def _scatter(arrays, slots, starts, staging, codecs):
    return tuple(
        tuple(
            _dtypes.decode(_write_blocks(c, _dtypes.to_bits(b), slots, starts, st[li]), b.dtype)
            for li, b in enumerate(bufs)
        )
        for bufs, c, st in zip(arrays, codecs, staging)
    )


gather_jit = jax.jit(_gather, static_argnums=(3, 4))
scatter_donated = jax.jit(_scatter, static_argnums=(4,), donate_argnums=(0,))


def bucket(n_blocks: int) -> int:
    """The block count a transfer of `n_blocks` runs at: the next power of two. Each count
    is a compile of the gather or scatter (a fifth of a second on a CPU, on a server's
    critical path), so a server compiles a few sizes once instead of one per prompt length;
    the padding blocks are copies of a real block (reads) or dropped (writes)."""
    return 1 << max(0, n_blocks - 1).bit_length()


def read_slots(slots: np.ndarray, block_size: int) -> np.ndarray:
    """`slots` padded to `bucket` blocks with copies of its first block: reads in range,
    whose blocks the caller drops (`[:n_blocks]`)."""
    n = len(slots) // block_size
    if not n or bucket(n) == n:
        return slots
    return np.concatenate([slots, np.tile(slots[:block_size], bucket(n) - n)])


def write_slots(slots: np.ndarray, block_size: int, n_blocks: int, bound: int) -> np.ndarray:
    """`slots` padded to `n_blocks` blocks (the staging's) with runs of slots from `bound`
    on, past every row of the buffers: a scatter drops them."""
    pad = n_blocks * block_size - len(slots)
    if pad <= 0:
        return slots
    return np.concatenate([slots, bound + np.arange(pad, dtype=slots.dtype)])


def block_starts(slots: np.ndarray, block_size: int) -> np.ndarray | None:
    """First slot of each block when every block is one contiguous run of slots, else None."""
    blocks = slots.reshape(-1, block_size)
    if np.array_equal(blocks, blocks[:, :1] + np.arange(block_size)):
        return np.ascontiguousarray(blocks[:, 0]).astype(np.int32)
    return None


def _gather_layers(arrays, slots, starts, codecs, block_size):
    return tuple(
        tuple(_read_blocks(c, _dtypes.to_bits(b), slots, starts, block_size) for b in bufs)
        for bufs, c in zip(arrays, codecs)
    )


gather_layers_jit = jax.jit(_gather_layers, static_argnums=(3, 4))


def _pick_layers(parts, index):
    """Per part, per layer `(n, block_size, *row)`: blocks `index` (None: all, in order)."""
    return tuple(
        tuple((p if index is None else p[index])[:, li] for li in range(p.shape[1])) for p in parts
    )


pick_layers_jit = jax.jit(_pick_layers)
