"""Buffers owned by other frameworks: dtype names, raw-bit views, and row moves outside XLA.

The connector moves a foreign pool's blocks as raw bits, each buffer with its own framework:

* host memory (numpy arrays, torch CPU tensors, anything exporting DLPack from the CPU) is viewed
  with numpy, zero-copy, and written in place;
* torch tensors on an accelerator are gathered and scattered with torch's own indexing, in place;
* jax arrays stay with XLA (the connector's device kernels gather and scatter them there).

Host memory of another framework never enters XLA: imported through DLPack, an XLA worker thread
could drop the last reference and run the producer's deleter during interpreter shutdown, which
aborted the process. torch is imported only when a buffer already is a torch tensor, so torch
stays an optional companion, never a dependency.

DLPack and numpy carry no bfloat16 or float8 (`np.from_dlpack` refuses a bf16 torch tensor), so
16- and 8-bit floats cross as the integers of their width, through the array's own `view`.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import _dtypes

# DLPack device type of host memory (kDLCPU).
_DLPACK_CPU = 1


def is_torch(x) -> bool:
    """Whether `x` is a torch object (tensor, dtype), told without importing torch."""
    return type(x).__module__.partition(".")[0] == "torch"


def _torch():
    # Present whenever a torch object reached us; importing it again costs a dict lookup.
    return sys.modules.get("torch") or __import__("torch")


def dtype_name(dtype) -> str:
    """The jnp name of a numpy, jax or torch dtype, a scalar type, or a string.

    `torch.float8_e4m3fn`, `jnp.float8_e4m3fn`, `np.dtype("float8_e4m3fn")` and
    `"float8_e4m3fn"` all give `"float8_e4m3fn"`. A name jnp does not know (a torch-only
    format) is kept as it is: it still tells layouts apart.
    """
    if isinstance(dtype, str) or is_torch(dtype):
        name = str(dtype).removeprefix("torch.")
    else:
        name = None
    try:
        return jnp.dtype(name if name is not None else dtype).name
    except TypeError:
        if name is None:
            raise
        return name


def buffer_dtype(x) -> np.dtype:
    """The jnp dtype of a buffer of any framework (torch's bf16 and fp8 included)."""
    try:
        return jnp.dtype(dtype_name(x.dtype))
    except TypeError as err:
        raise TypeError(f"expected a buffer of a numeric dtype, got {x.dtype}") from err


def kind(x) -> str:
    """How jaxkv moves `x`: "jax" (through XLA), "host" (numpy view), "torch" (torch on an
    accelerator), "device" (another framework's accelerator buffer, read through XLA)."""
    if isinstance(x, jax.Array):
        return "jax"
    if isinstance(x, np.ndarray):
        return "host"
    if is_torch(x):
        return "host" if x.device.type == "cpu" else "torch"
    if hasattr(x, "__dlpack__") and x.__dlpack_device__()[0] == _DLPACK_CPU:
        return "host"
    return "device"


def _torch_int(itemsize: int):
    """The torch integer dtype of a width, for moving raw bits (index_put on torch's unsigned
    16- and 32-bit types is not implemented on every device)."""
    torch = _torch()
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]


def _np_int(itemsize: int) -> np.dtype:
    return np.dtype({1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[itemsize])


def direct_view(x):
    """`x` as jaxkv reads and writes it outside XLA, sharing its memory, or None (jax arrays,
    other frameworks' accelerator buffers).

    Host buffers become numpy arrays of their raw bits; torch tensors on an accelerator become
    torch views of their raw bits as integers of the same width.
    """
    k = kind(x)
    if k == "host":
        if isinstance(x, np.ndarray):
            return x
        if is_torch(x):
            x = x.detach()  # DLPack refuses tensors that require grad; detach shares memory
            bits = _dtypes.bits_dtype(buffer_dtype(x))
            return np.from_dlpack(x.view(_torch_int(bits.itemsize))).view(bits)
        return np.from_dlpack(x)
    if k == "torch":
        return x.detach().view(_torch_int(x.element_size()))
    return None


def writable_problem(layer, codec) -> str | None:
    """Why rows cannot be written into `layer` (a `direct_view`) in place, or None."""
    if isinstance(layer, np.ndarray):
        if not layer.flags.writeable:
            return "a read-only host array"
        contiguous = layer.flags.c_contiguous
    else:
        contiguous = layer.is_contiguous()
    if not codec.token_major and not contiguous:
        return "a non-contiguous index buffer (its pages are addressed as one flat run)"
    if codec.token_axes > 1 and not contiguous:
        return "a non-contiguous paged buffer (its pages are addressed as flattened token rows)"
    return None


def _token_rows(layer, codec, slots: np.ndarray):
    """`(rows, index)`: a `direct_view` as token rows (sharing its memory) and the row of
    each of `slots`."""
    if codec.token_axes == 1:
        return layer, slots
    return codec.as_rows(layer), codec.row_index(slots, layer.shape[0])


def _index_positions(codec, slots: np.ndarray, n_pages: int) -> tuple[np.ndarray, np.ndarray]:
    keys, scales = codec.flat_index(jnp.asarray(slots, jnp.int32), n_pages)
    return np.array(keys), np.array(scales)  # writable copies: torch.from_numpy shares them


def read_rows(layer, codec, slots: np.ndarray, bits: np.dtype) -> np.ndarray:
    """Host copy of the entries at `slots`, `(T, *row)` in `bits`, of one `direct_view`."""
    if isinstance(layer, np.ndarray):
        buf = layer.view(bits) if layer.dtype != bits else layer
        if not codec.token_major:
            keys, scales = _index_positions(codec, slots, buf.shape[0])
            flat = buf.reshape(-1)
            return np.concatenate([flat[keys], flat[scales]], axis=-1)
        rows, index = _token_rows(buf, codec, slots)
        return rows[index]
    return _torch_rows(layer, codec, slots).cpu().numpy().view(bits)


def _torch_rows(layer, codec, slots: np.ndarray):
    """The entries at `slots` of a torch `direct_view`, gathered on its own device."""
    torch = _torch()
    dev = layer.device
    if not codec.token_major:
        keys, scales = _index_positions(codec, slots, layer.shape[0])
        flat = layer.reshape(-1)
        return torch.cat(
            [flat[torch.from_numpy(keys).to(dev)], flat[torch.from_numpy(scales).to(dev)]], -1
        )
    rows, index = _token_rows(layer, codec, slots)
    return rows[torch.from_numpy(index.astype(np.int64)).to(dev)]


def save_rows(layer, codec, slots: np.ndarray):
    """A copy of the entries at `slots` of one `direct_view`, kept where the layer lives (host
    rows for numpy views, a device tensor for torch), that `write_rows` puts back."""
    if isinstance(layer, np.ndarray):
        return read_rows(layer, codec, slots, layer.dtype)
    return _torch_rows(layer, codec, slots)


def write_rows(layer, codec, slots: np.ndarray, rows) -> None:
    """Writes raw-bit `rows (T, *row)` at `slots` into one `direct_view`, in place (`rows` a
    numpy array, or for torch layers what `save_rows` kept)."""
    if isinstance(layer, np.ndarray):
        rows = rows.view(layer.dtype) if rows.dtype != layer.dtype else rows
        if not codec.token_major:
            keys, scales = _index_positions(codec, slots, layer.shape[0])
            flat = layer.reshape(-1)  # a view: writability checks require C-contiguity
            flat[keys], flat[scales] = codec.split(rows)
        else:
            view, index = _token_rows(layer, codec, slots)
            view[index] = rows  # a view of `layer`: writable_problem refused copies
        return
    torch = _torch()
    dev = layer.device
    if is_torch(rows):
        src = rows
    else:
        src = torch.from_numpy(np.ascontiguousarray(rows).view(_np_int(rows.dtype.itemsize)))
        src = src.to(dev)
    if not codec.token_major:
        keys, scales = _index_positions(codec, slots, layer.shape[0])
        flat = layer.view(-1)
        key_bytes, scale_bytes = codec.split(src)
        flat[torch.from_numpy(keys).to(dev)] = key_bytes
        flat[torch.from_numpy(scales).to(dev)] = scale_bytes
    else:
        view, index = _token_rows(layer, codec, slots)
        view[torch.from_numpy(index.astype(np.int64)).to(dev)] = src


def read_blocks(layers: list, codec, slots: np.ndarray, block_size: int, row_shape, bits):
    """Block-major host copy `(n_blocks, layer_num, block_size, *row_shape)` in `bits` of the
    entries at `slots` of `direct_view` layer buffers."""
    n_blocks = len(slots) // block_size
    out = np.empty((n_blocks, len(layers), block_size, *row_shape), bits)
    for li, buf in enumerate(layers):
        out[:, li] = read_rows(buf, codec, slots, bits).reshape(n_blocks, block_size, *row_shape)
    return out
