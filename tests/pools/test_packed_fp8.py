"""NSA pools of an fp8 dtype: SGLang's packed fp8 latent row (DeepSeek V3.2, FlashMLA's layout).

A row is `kv_lora_rank + 4 * (kv_lora_rank // 128) + 2 * qk_rope_head_dim` bytes: fp8-e4m3
codes of the latent in tiles of 128 values, one float32 scale per tile (amax / 448), then the
rope as bfloat16. The numpy reference (helpers.py `pack_latent_ref` / `unpack_latent_ref`) is
written from that description; one tile is also worked out by hand below.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from absl.testing import parameterized
from helpers import host, pack_latent_ref, packed_width, unpack_latent_ref
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import jaxkv
from jaxkv import testing
from jaxkv.connector import HostStore, KVConnector

FP8 = [jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)]
fp8_dtypes = pytest.mark.parametrize("dtype", FP8, ids=lambda d: d.name)


def _pool(dtype, *, kv_lora_rank=128, qk_rope_head_dim=2, size=8, page_size=4, layer_num=2):
    return jaxkv.NSAPool.create(
        size=size,
        page_size=page_size,
        dtype=dtype,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=qk_rope_head_dim,
        index_head_dim=8,
        layer_num=layer_num,
    )


def _latent(rng, t, rank, rope, spread=4.0):
    """Random latent rows `(t, 1, rank + rope)` float32, each 128-value tile on its own scale."""
    tiles = rank // 128
    mags = 10.0 ** rng.uniform(-4, 4, (t, 1, tiles, 1))
    nope = (rng.standard_normal((t, 1, tiles, 128)) * mags).reshape(t, 1, rank)
    return np.concatenate([nope, rng.standard_normal((t, 1, rope)) * spread], -1).astype(np.float32)


# ---- layout -----------------------------------------------------------------------------------


@fp8_dtypes
def test_deepseek_shape_packs_656_byte_rows(dtype):
    pool = _pool(dtype, kv_lora_rank=512, qk_rope_head_dim=64, size=64, page_size=64, layer_num=1)
    rows = pool.size + pool.page_size
    chex.assert_shape(pool.kv_buffer[0], (rows, 1, 656))
    chex.assert_type(pool.kv_buffer[0], np.uint8)
    assert pool.store_dtype == np.uint8 and pool.dtype == dtype
    assert pool.get_kv_size_bytes() == rows * 656 + rows * (8 + 4)

    rng = np.random.default_rng(0)
    x = _latent(rng, 5, 512, 64)
    loc = np.array([3, 64, 1, 127, 70])
    pool = pool.set_kv(0, loc, x, None)
    got = host(pool.kv_buffer[0])[loc, 0]
    np.testing.assert_array_equal(got, pack_latent_ref(x[:, 0, :512], x[:, 0, 512:]))

    # The byte ranges mean what the layout says: codes, four float32 scales, the bf16 rope.
    tiles = x[:, 0, :512].reshape(5, 4, 128)
    scales = np.ascontiguousarray(got[:, 512:528]).view("<f4")
    np.testing.assert_array_equal(scales, np.max(np.abs(tiles), -1) / np.float32(448))
    rope = np.ascontiguousarray(got[:, 528:]).view(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(rope, x[:, 0, 512:].astype(ml_dtypes.bfloat16))
    codes = got[:, :512].view(ml_dtypes.float8_e4m3fn).astype(np.float32).reshape(5, 4, 128)
    err = np.abs(codes * scales[..., None] - tiles)
    # e4m3: 3 mantissa bits (half-ulp 2**-4 relative); subnormals step by 2**-9 * scale.
    assert np.all(err <= np.abs(tiles) * (2**-4 + 1e-6) + scales[..., None] * 2**-10)


def test_one_tile_worked_by_hand():
    """amax 896 gives scale 2.0; codes are x * 0.5 rounded to nearest even in e4m3."""
    pool = _pool(jnp.float8_e4m3fn)
    x = np.zeros((1, 1, 130), np.float32)
    x[0, 0, :5] = [896.0, 3.0, -1.0, 2.125, 2.375]  # 448, 1.5, -0.5, 1.0625 (tie), 1.1875 (tie)
    x[0, 0, 128:] = [1.5, -2.0]
    pool = pool.set_kv(0, np.array([5]), x, None)
    row = np.asarray(pool.kv_buffer[0])[5, 0]
    assert list(row[:5]) == [0x7E, 0x3C, 0xB0, 0x38, 0x3A]  # 448, 1.5, -0.5, 1.0, 1.25
    assert not np.any(row[5:128])
    assert list(row[128:132]) == [0x00, 0x00, 0x00, 0x40]  # float32 2.0, little-endian
    assert list(row[132:136]) == [0xC0, 0x3F, 0x00, 0xC0]  # bfloat16 1.5 and -2.0
    read = np.asarray(pool.get_key_buffer(0))[5, 0]
    np.testing.assert_array_equal(read[:5], [896.0, 3.0, -1.0, 2.0, 2.5])
    np.testing.assert_array_equal(read[128:], [1.5, -2.0])


def test_codes_multiply_by_the_reciprocal_of_the_scale():
    """SGLang's writer takes x * (1 / scale), not x / scale. For this pair the two differ: the
    product is exactly 152.0, a tie that rounds to even (160), the quotient just below (144)."""
    amax = np.float32(float.fromhex("0x1.804b3cp+8"))  # 384.29388
    x = np.float32(float.fromhex("0x1.04c556p+7"))  # 130.38542
    scale = amax / np.float32(448)
    assert x * (np.float32(1) / scale) == 152.0 and x / scale < 152.0
    tile = np.zeros((1, 1, 130), np.float32)
    tile[0, 0, :2] = [amax, x]
    pool = _pool(jnp.float8_e4m3fn).set_kv(0, np.array([1]), tile, None)
    row = np.asarray(pool.kv_buffer[0])[1, 0]
    assert list(row[:2]) == [0x7E, 0x72]  # e4m3 448 and 160
    assert np.asarray(pool.get_key_buffer(0))[1, 0, 1] == np.float32(160) * scale


@fp8_dtypes
@pytest.mark.parametrize("rank", [6, 64, 130, 200, 384 + 64])
def test_kv_lora_rank_must_be_a_multiple_of_128(dtype, rank):
    with pytest.raises(ValueError) as err:
        _pool(dtype, kv_lora_rank=rank)
    msg = str(err.value)
    assert "kv_lora_rank" in msg and "128" in msg and str(rank) in msg


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_wider_dtypes_keep_plain_rows_of_any_rank(dtype):
    pool = _pool(dtype, kv_lora_rank=6)
    chex.assert_shape(pool.kv_buffer[0], (12, 1, 8))


@fp8_dtypes
@pytest.mark.parametrize("rank", [128, 256, 512])
def test_multiples_of_128_are_accepted(dtype, rank):
    pool = _pool(dtype, kv_lora_rank=rank, qk_rope_head_dim=64)
    chex.assert_shape(pool.kv_buffer[0], (12, 1, packed_width(rank, 64)))


# ---- writes -----------------------------------------------------------------------------------


@fp8_dtypes
def test_zero_tile_keeps_its_signed_zeros(dtype):
    pool = _pool(dtype, kv_lora_rank=256)
    x = np.zeros((1, 1, 258), np.float32)
    x[0, 0, :128:2] = -0.0
    x[0, 0, 128:256] = np.linspace(-3, 3, 128)  # the other tile is not zero
    pool = pool.set_kv(0, np.array([2]), x, None)
    row = np.asarray(pool.kv_buffer[0])[2, 0]
    np.testing.assert_array_equal(row[:128:2], 0x80)  # e4m3 -0.0, never NaN
    np.testing.assert_array_equal(row[1:128:2], 0x00)
    assert np.ascontiguousarray(row[256:260]).view("<f4")[0] == 0.0
    read = np.asarray(pool.get_key_buffer(0))[2, 0, :128]
    testing.assert_bits_equal(read, x[0, 0, :128])
    np.testing.assert_array_equal(row, pack_latent_ref(x[0, 0, :256], x[0, 0, 256:]))


@fp8_dtypes
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_finite_extremes_never_become_nan_or_inf(dtype):
    pool = _pool(dtype)
    f32 = np.finfo(np.float32)
    x = np.zeros((3, 1, 130), np.float32)
    x[0, 0, :] = f32.max
    x[1, 0, :] = -f32.max
    x[2, 0, :] = f32.smallest_subnormal
    pool = pool.set_kv(0, np.array([1, 2, 3]), x, None)
    read = np.asarray(pool.get_key_buffer(0))[1:4]
    assert np.all(np.isfinite(read))
    bf16_max = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
    np.testing.assert_array_equal(read[:2, 0, 128:], [[bf16_max] * 2, [-bf16_max] * 2])
    big = np.float64(1e300) * np.ones((1, 1, 130))  # finite float64, inf once in float32
    pool = pool.set_kv(0, np.array([4]), big, None)
    assert np.all(np.isfinite(np.asarray(pool.get_key_buffer(0))[4]))


@fp8_dtypes
def test_k_scale_is_not_applied_to_packed_rows(dtype):
    """SGLang's packed writer takes no scale: every tile carries its own."""
    rng = np.random.default_rng(1)
    x = _latent(rng, 3, 128, 2)
    loc = np.array([1, 5, 9])
    plain = _pool(dtype).set_kv(0, loc, x, None)
    scaled = _pool(dtype).set_kv(0, loc, x, None, k_scale=4.0, v_scale=2.0)
    chex.assert_trees_all_equal(scaled.kv_buffer, plain.kv_buffer)
    scaled = _pool(dtype).set_k(0, loc, x, k_scale=jnp.float32(0.5))
    chex.assert_trees_all_equal(scaled.kv_buffer, plain.kv_buffer)
    with pytest.raises(ValueError, match="k_scale"):
        _pool(dtype).set_k(0, loc, x, k_scale=np.ones(2))


@fp8_dtypes
def test_set_mla_kv_and_set_kv_store_the_same_rows(dtype):
    rng = np.random.default_rng(2)
    x = _latent(rng, 4, 256, 2)
    nope, rope = x[..., :256], x[..., 256:].astype(ml_dtypes.bfloat16)  # parts keep their dtypes
    loc = np.array([0, 11, 4, 7])
    a = _pool(dtype, kv_lora_rank=256).set_mla_kv(1, loc, nope, rope)
    b = _pool(dtype, kv_lora_rank=256).set_kv(1, loc, np.concatenate([nope, rope], -1), None)
    chex.assert_trees_all_equal(a.kv_buffer, b.kv_buffer)
    np.testing.assert_array_equal(host(a.kv_buffer[1])[loc], pack_latent_ref(nope, rope))


# ---- writes and reads, eager and jitted ------------------------------------------------------


class TestPackedRowsEagerAndJitted(chex.TestCase):
    """Packed rows are written and read alike eagerly and under `jax.jit` (`chex.variants` runs
    each test both ways)."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.product(dtype=FP8, setter=("set_kv", "set_k"))
    def test_raw_packed_rows_are_stored_as_they_are(self, dtype, setter):
        pool = _pool(dtype)
        rng = np.random.default_rng(3)
        raw = rng.integers(0, 256, (4, 1, packed_width(128, 2)), dtype=np.uint8)  # NaNs too
        loc = np.array([2, 9, 3, 6])

        def write(pool, loc, raw):
            args = (raw, None) if setter == "set_kv" else (raw,)
            return getattr(pool, setter)(1, loc, *args, k_scale=3.0)

        pool = self.variant(write)(pool, loc, raw)
        np.testing.assert_array_equal(host(pool.kv_buffer[1])[loc], raw)
        got = host(pool.get_key_buffer(1))[loc]
        testing.assert_bits_equal(got, unpack_latent_ref(raw, 128))

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*((d.name, d) for d in FP8))
    def test_readers_dequantise_to_float32(self, dtype):
        pool = _pool(dtype, kv_lora_rank=256, qk_rope_head_dim=4)
        rng = np.random.default_rng(4)
        x = _latent(rng, 3, 256, 4)
        loc = np.array([7, 1, 10])
        pool = pool.set_kv(1, loc, x, None)
        want = unpack_latent_ref(host(pool.kv_buffer[1]), 256)

        def reads(pool, loc):
            return (
                pool.get_key_buffer(1),
                pool.get_value_buffer(1),
                pool.get_kv_buffer(1),
                pool.get_mla_kv(1, loc),
            )

        key, value, kv_pair, (nope, rope) = self.variant(reads)(pool, loc)
        chex.assert_type([key, value, nope, rope], np.float32)
        chex.assert_shape(key, (12, 1, 260))
        testing.assert_bits_equal(key, want)
        testing.assert_bits_equal(value, want[..., :256])
        chex.assert_trees_all_equal(kv_pair, (key, value))
        testing.assert_bits_equal(nope, want[loc, :, :256])
        testing.assert_bits_equal(rope, want[loc, :, 256:])
        nope, rope = pool.get_mla_kv(1, np.array([-1, 12]))  # out of range: zeros
        assert not np.any(host(nope)) and not np.any(host(rope))


@fp8_dtypes
def test_raw_rows_of_another_width_raise_naming_cache_k(dtype):
    pool = _pool(dtype)
    width = packed_width(128, 2)
    before = host(pool.kv_buffer[0])
    bad = np.zeros((3, 1, 130), np.uint8)  # the value width, not the packed width
    with pytest.raises(ValueError) as err:
        pool.set_k(0, np.array([1, 2, 3]), bad)
    msg = str(err.value)
    assert "cache_k" in msg and str((3, 1, width)) in msg and str((3, 1, 130)) in msg
    np.testing.assert_array_equal(host(pool.kv_buffer[0]), before)


@fp8_dtypes
@pytest.mark.parametrize("raw_part", ["k_nope", "k_rope"])
def test_set_mla_kv_rejects_raw_parts(dtype, raw_part):
    pool = _pool(dtype)
    parts = {"k_nope": np.ones((2, 1, 128), np.float32), "k_rope": np.ones((2, 1, 2), np.float32)}
    parts[raw_part] = parts[raw_part].astype(np.uint8)
    with pytest.raises(ValueError, match=raw_part):
        pool.set_mla_kv(0, np.array([1, 2]), parts["k_nope"], parts["k_rope"])
    assert not np.any(host(pool.kv_buffer[0]))


# ---- property: round trips through the readers, eager and jitted ------------------------------

T = 3
# Examples per test: the active hypothesis profile's (conftest: "lean" by default).
SETTINGS = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
_FLOATS = st.floats(width=32, allow_nan=False, allow_infinity=False)


@st.composite
def _rows(draw):
    """Latent rows `(T, 1, 256 + 2)`: per tile either arbitrary finite floats (subnormals and
    extremes included) or values on one random scale, so typical tiles are well covered too."""
    tiles = []
    for _ in range(T * 2):
        if draw(st.booleans()):
            tiles.append(draw(hnp.arrays(np.float32, 128, elements=_FLOATS)))
        else:
            exp = draw(st.integers(-40, 40))
            unit = draw(hnp.arrays(np.float32, 128, elements=st.floats(-1, 1, width=32)))
            tiles.append(unit * np.float32(2.0**exp))
    nope = np.stack(tiles).reshape(T, 1, 256)
    rope = draw(hnp.arrays(np.float32, (T, 1, 2), elements=_FLOATS))
    return np.concatenate([nope, rope], -1)


@functools.partial(jax.jit, static_argnames=("mla",), donate_argnums=0)
def _jit_write(pool, loc, x, *, mla):
    if mla:
        return pool.set_mla_kv(0, loc, x[..., :256], x[..., 256:])
    return pool.set_kv(0, loc, x, None)


@jax.jit
def _jit_get_mla_kv(pool, loc):
    return pool.get_mla_kv(0, loc)


@SETTINGS
@given(
    x=_rows(),
    mla=st.booleans(),
    in_dtype=st.sampled_from(["float32", "bfloat16"]),
    dtype=st.sampled_from(FP8),
)
def test_round_trips_through_the_readers_match_the_reference(x, mla, in_dtype, dtype):
    if in_dtype == "bfloat16":  # inputs finite in their own dtype
        x = np.clip(x, -3e38, 3e38).astype(ml_dtypes.bfloat16)
    loc = np.array([3, 8, 1])
    stored = pack_latent_ref(x[..., :256], x[..., 256:])
    want = unpack_latent_ref(stored, 256)
    eager = _pool(dtype, kv_lora_rank=256, layer_num=1)
    if mla:
        eager = eager.set_mla_kv(0, loc, x[..., :256], x[..., 256:])
    else:
        eager = eager.set_kv(0, loc, x, None)
    jitted = _jit_write(_pool(dtype, kv_lora_rank=256, layer_num=1), loc, x, mla=mla)
    for pool in (eager, jitted):
        np.testing.assert_array_equal(host(pool.kv_buffer[0])[loc], stored)
        testing.assert_bits_equal(host(pool.get_key_buffer(0))[loc], want)
        nope, rope = _jit_get_mla_kv(pool, loc)
        testing.assert_bits_equal(nope, want[..., :256])
        testing.assert_bits_equal(rope, want[..., 256:])
        assert np.all(np.isfinite(want)), "finite in, finite out"


# ---- connector --------------------------------------------------------------------------------


@fp8_dtypes
def test_connector_round_trip_into_a_host_store_is_bit_exact(dtype):
    def make():
        return _pool(
            dtype, kv_lora_rank=512, qk_rope_head_dim=64, size=128, page_size=64, layer_num=2
        )

    rng = np.random.default_rng(5)
    src = make()
    slots = np.arange(64, 128)
    for layer in range(2):
        src = src.set_kv(layer, slots, _latent(rng, 64, 512, 64), None)
        src = src.set_index_k(layer, slots, rng.standard_normal((64, 8)))
    conn = KVConnector(src, HostStore(1 << 20))
    exported = conn.export_blocks(src, slots)
    chex.assert_shape(exported["kv"], (1, 2, 64, 1, 656))
    assert exported["kv"].dtype == np.uint8
    tokens = rng.integers(0, 1000, 64)
    assert conn.store(src, tokens, slots) == 1
    dst, n = conn.load(make(), tokens, np.arange(128, 192))
    assert n == 64
    for layer in range(2):
        np.testing.assert_array_equal(
            host(dst.kv_buffer[layer])[128:192], host(src.kv_buffer[layer])[64:128]
        )
        chex.assert_trees_all_equal(
            dst.get_mla_kv(layer, np.arange(128, 192)), src.get_mla_kv(layer, slots)
        )
        chex.assert_trees_all_equal(
            dst.get_index_k(layer, np.arange(128, 192)), src.get_index_k(layer, slots)
        )
