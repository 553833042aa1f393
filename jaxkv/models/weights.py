"""`params_fingerprint`: a digest of a model's weights, for block namespaces that must tell
checkpoints apart."""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["params_fingerprint"]


def params_fingerprint(params) -> str:
    """A SHA-256 hex digest of a pytree of weights: every leaf's key path, dtype, shape and
    raw bytes, in the pytree's canonical order (dict keys sorted).

    Two sets of weights get the same fingerprint only when they are the same values, bit for
    bit, at the same paths; so it tells KV computed with one set from KV computed with
    another, which the model's config alone cannot (a fine-tune has its base's config).
    Leaves on an accelerator are copied to the host one at a time and dropped once hashed, so
    the host holds about one leaf at a time. The cost is one pass of SHA-256 over the
    weights' bytes.

    Args:
        params: a pytree whose leaves are arrays (jax or numpy) or numbers.

    Returns:
        64 hex digits.

    Raises:
        TypeError: a leaf that is not numeric data (an object array), naming its path.
        ValueError: a jax array this process cannot read whole (sharded across processes);
            give the engine a `namespace` instead.

    Example:
        >>> import jax.numpy as jnp
        >>> a = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
        >>> params_fingerprint(a) == params_fingerprint({"b": jnp.zeros(3), "w": jnp.ones((2, 3))})
        True
        >>> params_fingerprint(a) == params_fingerprint({**a, "w": a["w"] * 1.5})
        False
    """
    digest = hashlib.sha256(b"jaxkv.models.params_fingerprint/1")
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        where = f"params{jax.tree_util.keystr(path)}"
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            raise ValueError(
                f"{where}: expected an array this process holds whole, got one sharded across "
                "processes; pass Engine(namespace=...) naming the weights instead"
            )
        host = _host_copy(leaf)
        if host.dtype.kind not in "biufcV" or host.dtype.hasobject:
            raise TypeError(f"{where}: expected numeric array data, got dtype {host.dtype}")
        if host.dtype.byteorder == ">":
            host = host.astype(host.dtype.newbyteorder("<"))
        # Length-prefixed header: no two (path, dtype, shape) can run into each other.
        header = repr((where, host.dtype.name, host.shape)).encode()
        digest.update(len(header).to_bytes(8, "little") + header)
        digest.update(np.ascontiguousarray(host).reshape(-1).view(np.uint8).data)
    return digest.hexdigest()


def _host_copy(leaf) -> np.ndarray:
    """`leaf` as a numpy array, kept nowhere else. `np.asarray` of an array on an accelerator
    caches the host copy on the array for the array's life, which over every leaf would keep
    a host copy of the whole model; the copy is taken from a temporary (one leaf more on the
    device for a moment), so it goes when the caller drops it. CPU arrays are read in place.
    """
    if isinstance(leaf, jax.Array) and any(d.platform != "cpu" for d in leaf.devices()):
        leaf = jnp.copy(leaf)
    return np.asarray(leaf)
