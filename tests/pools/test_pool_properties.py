"""Property tests: random update sequences against a plain numpy model of the pool.

Every pool kind and dtype (NSA with an fp8 dtype: packed fp8 latent rows, kv_lora_rank 128).
Each example draws a few updates (random slots, out-of-range and
`-1` entries among them, random values in random input dtypes, optional scales), applies them
to one pool eagerly and to another through a donating `jax.jit` step, and after every update
compares both pools' raw buffers bit for bit with the model: numpy arrays of store-dtype rows,
written with the numpy reference encoder (helpers.py) under the same drop rule.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    encode_ref,
    index_pages_ref,
    latent_rows_ref,
    make_pool,
    mla_rows_ref,
    quantize_index_ref,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jaxkv import testing

T = 4  # tokens per update; fixed so each (update kind, dtype) compiles once
START_LAYER = 1  # global layer ids 1 and 2
OPS = {
    "mha": ("set_kv", "set_k"),
    "konly": ("set_k",),
    "mla": ("set_kv", "set_mla_kv"),
    "nsa": ("set_kv", "set_mla_kv", "set_index_k"),
}
# Examples per test: the active hypothesis profile's (conftest: "lean" by default).
SETTINGS = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FLOATS = st.floats(width=32, allow_nan=False, allow_infinity=False)
SCALES = st.one_of(
    st.floats(min_value=2**-14, max_value=2**14, width=32),
    st.sampled_from([0.37, 3.0, 1e-30, 1e30]),
)


@dataclasses.dataclass
class Update:
    name: str
    layer_id: int
    loc: np.ndarray  # int64, may hold slots that do not fit in int32
    args: tuple  # value arrays (None for MLA/NSA cache_v)
    scales: dict

    def jit_loc(self) -> np.ndarray:
        """`loc` as int32 for the jitted path: entries beyond int32 become -1 (also dropped)."""
        narrow = (self.loc >= np.iinfo(np.int32).min) & (self.loc <= np.iinfo(np.int32).max)
        return np.where(narrow, self.loc, -1).astype(np.int32)


def _out_of_range(rows: int) -> list[int]:
    return [-1, -2, -rows, -(2**31), rows, rows + 1, 2**31 - 1, 2**32 + 5, 2**32, -(2**40)]


@st.composite
def _locs(draw, rows: int) -> np.ndarray:
    n_valid = draw(st.integers(0, T))
    valid = draw(
        st.lists(st.integers(0, rows - 1), min_size=n_valid, max_size=n_valid, unique=True)
    )
    bad = draw(
        st.lists(st.sampled_from(_out_of_range(rows)), min_size=T - n_valid, max_size=T - n_valid)
    )
    return np.array(draw(st.permutations(valid + bad)), np.int64)


def _values(draw, shape, in_dtype) -> np.ndarray:
    """Random finite float32 values (subnormals, zeros, extremes), then cast to `in_dtype`."""
    x = draw(hnp.arrays(np.float32, shape, elements=FLOATS))
    if in_dtype != np.float32:
        limit = np.float32(jnp.finfo(in_dtype).max)  # keep inputs finite in their own dtype
        x = np.clip(x, -limit, limit).astype(in_dtype)
    return x


@st.composite
def _updates(draw, pool, kind: str) -> list[Update]:
    rows = pool.size + pool.page_size
    other = jnp.dtype(jnp.bfloat16 if pool.dtype == jnp.float32 else jnp.float32)
    updates = []
    for _ in range(draw(st.integers(1, 4))):
        name = draw(st.sampled_from(OPS[kind]))
        layer_id = draw(st.sampled_from([START_LAYER, START_LAYER + 1]))
        loc = draw(_locs(rows))
        in_dtype = draw(st.sampled_from([pool.dtype, other]))
        scales = {}
        if name == "set_index_k":
            args = (_values(draw, (T, pool.index_head_dim), in_dtype),)
        elif name == "set_mla_kv":
            args = (
                _values(draw, (T, 1, pool.kv_lora_rank), in_dtype),
                _values(draw, (T, 1, pool.qk_rope_head_dim), in_dtype),
            )
        else:
            k_shape = (
                (T, pool.head_num, pool.head_dim)
                if kind in ("mha", "konly")
                else (T, 1, pool.kv_lora_rank + pool.qk_rope_head_dim)
            )
            k = _values(draw, k_shape, in_dtype)
            # K and V scales are both given or both not (fewer programs to compile).
            scaled = draw(st.booleans())
            scales["k_scale"] = draw(SCALES) if scaled else None
            if name == "set_k":
                args = (k,)
            elif kind == "mha":
                args = (k, _values(draw, (T, pool.head_num, pool.v_head_dim), in_dtype))
                scales["v_scale"] = draw(SCALES) if scaled else None
            else:
                args = (k, None)
        scales = {key: None if s is None else np.float32(s) for key, s in scales.items()}
        updates.append(Update(name, layer_id, loc, args, scales))
    return updates


class PoolModel:
    """The pool as numpy: one store-dtype array per buffer and layer, per-slot NSA records."""

    def __init__(self, pool):
        self.pool = pool  # its static description only: sizes, dtype, kind
        self.dtype = pool.dtype
        self.page_size = pool.page_size
        self.rows = pool.size + pool.page_size
        self.buffers = {
            name: [np.zeros(b.shape, pool.store_dtype) for b in getattr(pool, name)]
            for name in ("k_buffer", "v_buffer", "kv_buffer")
            if hasattr(pool, name)
        }
        if hasattr(pool, "index_k_with_scale_buffer"):
            records = (self.rows, pool.index_head_dim + 4)
            self.index_records = [np.zeros(records, np.uint8) for _ in range(pool.layer_num)]

    def _encoded(self, u: Update) -> dict[str, np.ndarray]:
        enc = functools.partial(encode_ref, dtype=self.dtype)
        if u.name == "set_index_k":
            return {"index": quantize_index_ref(u.args[0])}
        if u.name == "set_mla_kv":
            return {"kv_buffer": mla_rows_ref(self.pool, *u.args)}
        if "kv_buffer" in self.buffers:  # MLA/NSA latent rows (NSA fp8: packed)
            return {"kv_buffer": latent_rows_ref(self.pool, u.args[0], u.scales["k_scale"])}
        out = {"k_buffer": enc(u.args[0], scale=u.scales["k_scale"])}
        if u.name == "set_kv" and "v_buffer" in self.buffers:
            out["v_buffer"] = enc(u.args[1], scale=u.scales["v_scale"])
        return out

    def apply(self, u: Update) -> None:
        li = u.layer_id - START_LAYER
        keep = (u.loc >= 0) & (u.loc < self.rows)  # the drop rule: no wrapping, ever
        for name, rows in self._encoded(u).items():
            target = self.index_records[li] if name == "index" else self.buffers[name][li]
            target[u.loc[keep]] = rows[keep]

    def check(self, pool, path: str) -> None:
        for name, layers in self.buffers.items():
            for li, expected in enumerate(layers):
                where = f"{path} {name}[{li}]"
                testing.assert_bits_equal({where: getattr(pool, name)[li]}, {where: expected})
        for li, records in enumerate(getattr(self, "index_records", [])):
            where, expected = f"{path} index[{li}]", index_pages_ref(records, self.page_size)
            got = pool.index_k_with_scale_buffer[li]
            testing.assert_bits_equal({where: got}, {where: expected})


@functools.partial(jax.jit, static_argnames=("name", "layer_id"), donate_argnums=0)
def _jit_step(pool, loc, args, scales, *, name, layer_id):
    return getattr(pool, name)(layer_id, loc, *args, **scales)


# Every dtype through MHA (the encode path of each dtype, scaled and not, on two buffers), every
# kind in bfloat16 (each layout), and fp8 latent rows plain (MLA) and packed (NSA). The other
# kind x dtype pairs run the same encoder on the same layouts (compiling each pair's programs
# is most of this test's time); tests/pools/test_pools.py and test_packed_fp8.py check every pair
# with explicit cases.
PAIRS = [("mha", d) for d in ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")]
PAIRS += [("konly", "bfloat16"), ("mla", "bfloat16"), ("nsa", "bfloat16")]
PAIRS += [("mla", "float8_e4m3fn"), ("nsa", "float8_e4m3fn")]


@pytest.mark.parametrize(
    "pool_kind,pool_dtype",
    [(k, jnp.dtype(d)) for k, d in PAIRS],
    ids=[f"{k}-{d}" for k, d in PAIRS],
)
@SETTINGS
@given(data=st.data())
def test_updates_match_the_numpy_model_eager_and_jitted(pool_kind, pool_dtype, data):
    eager = make_pool(pool_kind, pool_dtype, start_layer=START_LAYER)
    jitted = make_pool(pool_kind, pool_dtype, start_layer=START_LAYER)
    model = PoolModel(eager)
    for i, u in enumerate(data.draw(_updates(eager, pool_kind), label="updates")):
        model.apply(u)
        eager = getattr(eager, u.name)(u.layer_id, u.loc, *u.args, **u.scales)
        model.check(eager, f"eager update {i} ({u.name})")
        jitted = _jit_step(jitted, u.jit_loc(), u.args, u.scales, name=u.name, layer_id=u.layer_id)
        model.check(jitted, f"jitted update {i} ({u.name})")
