"""A hostile fuzzer over every public pool call, against a numpy model.

Every example makes one call (`create`, a setter, or a reader) on a small pool of a random kind
and dtype, either well formed or with one argument spoiled: slots that are None, floats, 2-D,
huge, negative or of every integer type; layer ids out of range or of the wrong type; values of
the wrong rank, width, length or type, with NaN and inf inside; scales that are zero, negative,
non-finite, text or arrays. The call must either

* return the right result (the numpy model of the pool: stored rows written with helpers.py's
  reference encoders, out-of-range slots dropped), and, if it donated, leave the input pool
  consumed; or
* raise `ValueError`, `TypeError` or `IndexError` whose message names the spoiled argument, with
  the input pool unconsumed, readable and bit for bit as before.

The pools are shared (one prefilled pool per kind and dtype, copied per example), token counts
fixed, so compiled calls are reused and the whole file stays a few seconds.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    ALL_DTYPES,
    SETTERS,
    decode_ref,
    encode_ref,
    host,
    is_packed,
    key_row_shape,
    latent_read_ref,
    latent_rows_ref,
    make_pool,
    mla_rows_ref,
    quantize_index_ref,
    small,
)
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import jaxkv

T = 3  # tokens per call: fixed so compiled calls are shared between examples
SETTINGS = settings(
    max_examples=6 * settings.default.max_examples,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
EXPECTED_ERRORS = (ValueError, TypeError, IndexError)
SPECIALS = np.array([np.inf, -np.inf, np.nan, 1e30, -1e30, 0.0, -0.0], np.float32)
INT_TYPES = (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)


@functools.cache
def _base(kind: str, dtype) -> jaxkv.MHAPool:
    """A pool of `kind` and `dtype` with random data in every row of both layers (kept
    unconsumed: examples work on copies)."""
    rng = np.random.default_rng(0)
    pool = make_pool(kind, dtype)
    loc = np.arange(pool.rows)
    for layer in range(pool.layer_num):
        done = set()
        for name, writes in SETTERS[kind].items():
            if not done.issuperset(writes):
                args = _values(pool, name, len(loc), rng, specials=False)
                pool = getattr(pool, name)(layer, loc, *args, donate=False)
                done.update(writes)
    return pool


def _copy(pool):
    return jax.tree.map(jnp.copy, pool)


def _values(pool, name, t, rng, *, specials=True):
    """Random values for setter `name` over `t` tokens, with NaN, inf and huge entries sprinkled
    in when `specials`."""

    def draw(shape):
        x = (rng.standard_normal(shape) * 4).astype(np.float32)
        if specials and x.size:
            hits = rng.random(x.shape) < 0.1
            x[hits] = rng.choice(SPECIALS, int(hits.sum()))
        return x

    if name == "set_index_k":
        return (draw((t, pool.index_head_dim)),)
    if name == "set_mla_kv":
        return (draw((t, 1, pool.kv_lora_rank)), draw((t, 1, pool.qk_rope_head_dim)))
    k = draw((t, *key_row_shape(pool)))
    if name == "set_k":
        return (k,)
    return (k, draw((t, pool.head_num, pool.v_head_dim)) if hasattr(pool, "v_buffer") else None)


# ---- the numpy model -------------------------------------------------------------------------


def _index_records(buf: np.ndarray, page: int, dim: int) -> np.ndarray:
    """SGLang's index pages `(pages, page * (dim + 4))` -> per-slot records `(rows, dim + 4)`."""
    pages = buf.shape[0]
    keys = buf[:, : page * dim].reshape(pages * page, dim)
    scales = buf[:, page * dim :].reshape(pages * page, 4)
    return np.concatenate([keys, scales], axis=-1)


def _dequant_index(records: np.ndarray, dim: int) -> np.ndarray:
    keys = decode_ref(records[:, :dim], jnp.float8_e4m3fn)
    return keys * np.ascontiguousarray(records[:, dim:]).view("<f4")


def _model(pool) -> dict[str, list[np.ndarray]]:
    """Per buffer and layer, what the pool holds as float32 values per slot: row buffers decoded
    from their logical dtype (packed rows dequantised), index buffers dequantised per token."""
    out = {}
    for spec in pool.buffer_specs():
        layers = []
        for buf in pool.buffers(spec.attr):
            bits = host(buf)
            if spec.attr == "index_k_with_scale_buffer":
                records = _index_records(bits, pool.page_size, pool.index_head_dim)
                layers.append(_dequant_index(records, pool.index_head_dim))
            elif spec.attr == "kv_buffer":
                layers.append(latent_read_ref(pool, bits))
            else:
                layers.append(decode_ref(bits, pool.dtype))
        out[spec.attr] = layers
    return out


def _expected(pool, before, name, layer_id, loc, args, scales):
    """The model after setter `name` wrote `args` at `loc` of global layer `layer_id`."""
    want = {k: [a.copy() for a in v] for k, v in before.items()}
    li = int(layer_id) - pool.start_layer
    slots = np.array([int(s) for s in np.asarray(loc, object).reshape(-1)], object)
    keep = [t for t, s in enumerate(slots) if 0 <= s < pool.rows]
    rows = np.array([slots[t] for t in keep], np.int64)
    if name == "set_index_k":
        keys = _dequant_index(quantize_index_ref(args[0]), pool.index_head_dim)
        want["index_k_with_scale_buffer"][li][rows] = keys[keep]
    elif name == "set_mla_kv":
        bits = mla_rows_ref(pool, *args)
        want["kv_buffer"][li][rows] = latent_read_ref(pool, bits)[keep]
    elif hasattr(pool, "kv_buffer"):
        bits = latent_rows_ref(pool, args[0], scales.get("k_scale"))
        want["kv_buffer"][li][rows] = latent_read_ref(pool, bits)[keep]
    else:
        for buf, value, scale in (
            ("k_buffer", args[0], "k_scale"),
            ("v_buffer", args[-1], "v_scale"),
        ):
            if buf == "v_buffer" and name == "set_k":
                continue
            bits = encode_ref(value, pool.dtype, scales.get(scale))
            want[buf][li][rows] = decode_ref(bits, pool.dtype)[keep]
    return want


def _assert_model(got, want):
    for name in want:
        for g, w in zip(got[name], want[name]):
            np.testing.assert_array_equal(g, w, err_msg=name)


# ---- spoilers --------------------------------------------------------------------------------


def _spoil_loc(draw, rows):
    """(loc, expected error or None, argument named)."""
    kind = draw(st.sampled_from(["none", "float", "2d", "str", "huge", "negative", "int", "list"]))
    if kind == "none":
        return None, TypeError, "loc"
    if kind == "float":
        return np.array([1.0, 2.0, 3.0]), TypeError, "loc"
    if kind == "2d":
        return np.array([[1, 2, 3]]), ValueError, "loc"
    if kind == "str":
        return "123", TypeError, "loc"
    if kind == "huge":  # dropped, never wrapped
        return [2**70, 2**40 + 1, rows], None, None
    if kind == "negative":
        return np.array([-1, -rows, 1]), None, None
    if kind == "int":
        dt = draw(st.sampled_from(INT_TYPES))
        return np.array([1, rows - 1, 2], dt), None, None
    return [3, 1, 2], None, None


def _spoil_layer(draw, pool):
    kind = draw(st.sampled_from(["below", "above", "str", "float", "numpy"]))
    if kind == "below":
        return pool.start_layer - 1, IndexError
    if kind == "above":
        return pool.start_layer + pool.layer_num, IndexError
    if kind == "str":
        return "0", IndexError
    if kind == "float":
        return 0.0, IndexError
    return np.int32(pool.start_layer + 1), None


def _spoil_value(draw, args, arg_names, rng):
    """Spoils one value argument: (args, error, argument named)."""
    i = draw(st.sampled_from([j for j, a in enumerate(args) if a is not None]))
    x = args[i]
    kind = draw(st.sampled_from(["rank", "width", "length", "bool", "complex", "text"]))
    spoiled = {
        "rank": lambda: x[..., None],
        "width": lambda: np.concatenate([x, x[..., :1]], axis=-1),
        "length": lambda: x[:-1],
        "bool": lambda: x > 0,
        "complex": lambda: x.astype(np.complex64),
        "text": lambda: np.full(x.shape, "a"),
    }[kind]()
    error = TypeError if kind in ("bool", "complex", "text") else ValueError
    args = list(args)
    args[i] = spoiled
    return tuple(args), error, arg_names[i]


ARG_NAMES = {
    "set_kv": ("cache_k", "cache_v"),
    "set_k": ("cache_k",),
    "set_mla_kv": ("k_nope", "k_rope"),
    "set_index_k": ("index_k",),
}
BAD_SCALES = [
    (0.0, ValueError),
    (-2.0, ValueError),
    (np.inf, ValueError),
    (np.nan, ValueError),
    ("2", TypeError),
    ([1.0, 2.0], ValueError),
    (True, TypeError),
]


# ---- the fuzzers -----------------------------------------------------------------------------


POOLS = st.tuples(st.sampled_from(sorted(SETTERS)), st.sampled_from(ALL_DTYPES))


@SETTINGS
@given(data=st.data(), which=POOLS)
def test_setters_are_right_or_refuse_and_change_nothing(data, which):
    kind, dtype = which
    draw = data.draw
    base = _base(kind, dtype)
    name = draw(st.sampled_from(sorted(SETTERS[kind])), label="setter")
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="seed"))
    args = _values(base, name, T, rng)  # float32: values in the pool dtype skip the cast
    layer_id = base.start_layer + draw(st.integers(0, base.layer_num - 1))
    loc = rng.permutation(base.rows)[:T]
    scales = {}
    error, named = None, None
    spoil = draw(st.sampled_from(["none", "loc", "layer", "value", "scale"]), label="spoil")
    if spoil == "loc":
        loc, error, named = _spoil_loc(draw, base.rows)
    elif spoil == "layer":
        layer_id, error = _spoil_layer(draw, base)
        named = "layer_id" if error else None
    elif spoil == "value":
        args, error, named = _spoil_value(draw, args, ARG_NAMES[name], rng)
    scale_args = {
        "set_kv": ["k_scale"] + (["v_scale"] if kind == "mha" else []),
        "set_k": ["k_scale"],
    }
    if name in scale_args:
        arg = draw(st.sampled_from(scale_args[name]))
        if spoil == "scale":
            scales[arg], error = draw(st.sampled_from(BAD_SCALES))
            named = arg
        elif draw(st.booleans()) and not is_packed(base):
            scales[arg] = draw(st.sampled_from([0.5, 2.0, 3.0]))
    pool = _copy(base)
    before = _model(pool)
    try:
        new = getattr(pool, name)(layer_id, loc, *args, **scales)
    except EXPECTED_ERRORS as err:
        event(f"{spoil}: {type(err).__name__}")
        assert error is not None and isinstance(err, error), f"unexpected {err!r}"
        assert named in str(err), f"{err!r} does not name {named}"
        assert not pool.consumed
        _assert_model(_model(pool), before)
        return
    assert error is None, f"expected {error.__name__} naming {named}, the call returned"
    event(f"{spoil}: right result")
    assert pool.consumed
    with pytest.raises(jaxkv.ConsumedPoolError):
        pool.get_key_buffer(base.start_layer)
    _assert_model(_model(new), _expected(base, before, name, layer_id, loc, args, scales))


@SETTINGS
@given(data=st.data(), which=POOLS)
def test_readers_are_right_or_refuse(data, which):
    kind, dtype = which
    draw = data.draw
    pool = _base(kind, dtype)
    model = _model(pool)
    readers = ["get_key_buffer", "get_value_buffer", "get_kv_buffer"]
    readers += ["get_mla_kv"] if hasattr(pool, "kv_buffer") else []
    readers += ["get_index_k"] if hasattr(pool, "index_k_with_scale_buffer") else []
    name = draw(st.sampled_from(readers))
    layer_id, error, named = pool.start_layer + draw(st.integers(0, pool.layer_num - 1)), None, None
    loc = np.array(draw(st.lists(st.integers(-3, pool.rows + 2), min_size=T, max_size=T)))
    spoil = draw(st.sampled_from(["none", "layer", "loc"]))
    if spoil == "layer":
        layer_id, error = _spoil_layer(draw, pool)
        named = "layer_id" if error else None
    elif spoil == "loc" and name in ("get_mla_kv", "get_index_k"):
        loc, error, named = _spoil_loc(draw, pool.rows)
    args = (layer_id, loc) if name in ("get_mla_kv", "get_index_k") else (layer_id,)
    if kind == "konly" and name != "get_key_buffer":
        with pytest.raises((NotImplementedError, IndexError)):
            getattr(pool, name)(*args)
        return
    try:
        got = getattr(pool, name)(*args)
    except EXPECTED_ERRORS as err:
        event(f"{spoil}: {type(err).__name__}")
        assert error is not None and isinstance(err, error), f"unexpected {err!r}"
        assert named in str(err), f"{err!r} does not name {named}"
        return
    assert error is None, f"expected {error.__name__} naming {named}, the call returned"
    event(f"{spoil}: right result")
    li = int(layer_id) - pool.start_layer
    if name in ("get_mla_kv", "get_index_k"):
        slots = [int(s) for s in np.asarray(loc, object).reshape(-1)]
        inside = np.array([0 <= s < pool.rows for s in slots])
        rows = np.where(inside, [s if 0 <= s < pool.rows else 0 for s in slots], 0)
        buf = "index_k_with_scale_buffer" if name == "get_index_k" else "kv_buffer"
        held = model[buf][li][rows]
        want = np.where(inside.reshape(-1, *[1] * (held.ndim - 1)), held, 0)
        got = np.asarray(got) if name == "get_index_k" else np.concatenate(got, -1)
        np.testing.assert_array_equal(np.asarray(got, np.float32), want)
        return
    if "kv_buffer" in model:
        key = model["kv_buffer"][li]
        value = key[..., : pool.kv_lora_rank]
    else:  # K-only pools have no V (their V readers raise above)
        key, value = model["k_buffer"][li], model.get("v_buffer", [None] * pool.layer_num)[li]
    want = {"get_key_buffer": (key,), "get_value_buffer": (value,), "get_kv_buffer": (key, value)}
    got = got if isinstance(got, tuple) else (got,)
    for g, w in zip(got, want[name], strict=True):
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), w)


CREATE_ARGS = {
    "size": [8, 0, -8, 8.0, "8", np.int64(8), 7],
    "page_size": [1, 4, 0, 2.5, np.int32(4)],
    "dtype": [jnp.bfloat16, "float32", jnp.int8, "nope", np.float64, None],
    "layer_num": [1, 0, "1", np.uint8(2)],
    "start_layer": [0, 3, -1, 1.5],
}


@settings(max_examples=8 * settings.default.max_examples, deadline=None)
@given(data=st.data(), kind=st.sampled_from(sorted(SETTERS)))
def test_create_is_right_or_refuses_naming_the_argument(data, kind):
    cls = type(make_pool(kind))
    args = {**small(kind), "size": 8, "page_size": 4}
    spoiled = data.draw(st.sampled_from(["none", *CREATE_ARGS, "own size"]))
    if spoiled in CREATE_ARGS:
        args[spoiled] = data.draw(st.sampled_from(CREATE_ARGS[spoiled]))
    elif spoiled == "own size":
        own = "head_dim" if kind in ("mha", "konly") else "qk_rope_head_dim"
        spoiled = own
        args[own] = data.draw(st.sampled_from([0, -1, 2.0, "2", None, np.int16(2)]))
    try:
        pool = cls.create(**args)
    except EXPECTED_ERRORS as err:
        event(f"{spoiled}: {type(err).__name__}")
        assert spoiled in str(err) or (spoiled == "page_size" and "size" in str(err)), err
        return
    event(f"{spoiled}: right result")
    for spec in pool.buffer_specs():
        assert len(pool.buffers(spec.attr)) == pool.layer_num
        for buf in pool.buffers(spec.attr):
            assert buf.shape == spec.layer_shape(pool.rows)
            assert not host(buf).any()
    assert pool.size == int(args["size"]) and pool.start_layer == int(args.get("start_layer", 0))
