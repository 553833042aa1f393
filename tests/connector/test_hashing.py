"""Block keys: `block_hashes`, chained as vLLM and SGLang chain theirs.

Keys are chained over full blocks only, identical across processes, and rooted in the
namespace, the pool's layout fingerprint and the tenant salt, so that no two of those ever
share a key.
"""

from __future__ import annotations

import itertools
import json
import time

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_mha_pool, run_python

from jaxkv import KOnlyPool, MHAPool, MLAPool, NSAPool
from jaxkv.connector import HostStore, KVConnector

TOKENS = np.random.default_rng(0).integers(0, 100_000, 80)  # 5 blocks of 16


def _mha(**kw):
    args = dict(size=64, page_size=1, dtype=jnp.bfloat16, head_num=2, head_dim=4, layer_num=2)
    return MHAPool.create(**{**args, **kw})


def _conn(pool=None, **kw):
    return KVConnector(_mha() if pool is None else pool, HostStore(1 << 20), **kw)


def test_one_hex_key_per_full_block():
    conn = _conn()
    keys = conn.block_hashes(TOKENS)
    assert len(keys) == 5
    for key in keys:
        assert isinstance(key, str) and len(key) == 64
        int(key, 16)
        assert key == key.lower()
    assert len(set(keys)) == 5
    assert conn.block_hashes([]) == []
    assert conn.block_hashes(TOKENS[:15]) == []


@pytest.mark.parametrize("tail", (1, 7, 15))
def test_partial_tail_is_never_hashed(tail):
    conn = _conn()
    assert conn.block_hashes(TOKENS[: 32 + tail]) == conn.block_hashes(TOKENS[:32])


def test_token_id_containers_agree():
    conn = _conn()
    want = conn.block_hashes(TOKENS)
    for ids in (
        TOKENS.tolist(),
        TOKENS.astype(np.int32),
        TOKENS.astype(np.uint32),
        tuple(TOKENS.tolist()),
        jnp.asarray(TOKENS, jnp.int32),
    ):
        assert conn.block_hashes(ids) == want


def test_keys_are_chained():
    conn = _conn()
    base = conn.block_hashes(TOKENS)
    early = TOKENS.copy()
    early[3] += 1  # inside block 0: every key changes
    changed = conn.block_hashes(early)
    assert all(a != b for a, b in zip(base, changed, strict=True))
    late = TOKENS.copy()
    late[2 * 16 + 5] += 1  # inside block 2: blocks 0-1 keep their keys
    changed = conn.block_hashes(late)
    assert changed[:2] == base[:2]
    assert all(a != b for a, b in zip(base[2:], changed[2:], strict=True))
    # Same block contents at another position are another key (the prefix differs).
    shifted = np.concatenate([TOKENS[16:32], TOKENS[16:32]])
    assert conn.block_hashes(shifted)[1] != conn.block_hashes(TOKENS)[1]
    assert len(set(conn.block_hashes(shifted))) == 2


_SUBPROCESS = """
import json, sys
import jax.numpy as jnp, numpy as np
from jaxkv import MHAPool, NSAPool
from jaxkv.connector import HostStore, KVConnector
tokens = json.loads(sys.argv[1])
mha = MHAPool.create(size=64, page_size=1, dtype=jnp.bfloat16, head_num=2, head_dim=4, layer_num=2)
nsa = NSAPool.create(size=64, page_size=16, kv_lora_rank=6, qk_rope_head_dim=2, layer_num=2,
                     index_head_dim=8, start_layer=3)
out = [KVConnector(mha, HostStore(1 << 20)).block_hashes(tokens),
       KVConnector(mha, HostStore(1 << 20), namespace="m").block_hashes(tokens, salt="t"),
       KVConnector(nsa, HostStore(1 << 20)).block_hashes(tokens)]
print(json.dumps(out))
"""


def test_keys_do_not_depend_on_what_was_hashed_before():
    """The connector reuses its last chain for a prefix of the same tokens under the same
    namespace, layout and salt (a lookup, then a load of the found prefix); every other
    sequence of calls gets the keys a fresh connector computes."""
    pool = MHAPool.create(size=64, head_num=1, head_dim=8, layer_num=1)
    conn = KVConnector(pool, HostStore(1 << 20), block_size=4)
    tokens = np.arange(40)
    calls = [
        (tokens, None),
        (tokens[:20], None),  # a prefix: reused
        (tokens[:22], None),  # a prefix with a partial tail
        (tokens[:20], "tenant"),  # another salt: another root
        (tokens[:20] + 1, None),  # other tokens
        (np.arange(80), None),  # longer than the last chain
        (tokens[:3], None),  # no full block
    ]
    for ids, salt in calls:
        fresh = KVConnector(pool, HostStore(1 << 20), block_size=4)
        assert conn.block_hashes(ids, salt=salt) == fresh.block_hashes(ids, salt=salt)


def test_keys_are_stable_across_processes():
    nsa = NSAPool.create(
        size=64,
        page_size=16,
        kv_lora_rank=6,
        qk_rope_head_dim=2,
        layer_num=2,
        index_head_dim=8,
        start_layer=3,
    )
    want = [
        _conn().block_hashes(TOKENS),
        _conn(namespace="m").block_hashes(TOKENS, salt="t"),
        _conn(nsa).block_hashes(TOKENS),
    ]
    env = {"PYTHONHASHSEED": "12345"}
    proc = run_python("-c", _SUBPROCESS, json.dumps(TOKENS.tolist()), env=env, timeout=120)
    assert json.loads(proc.stdout) == want


def _all_disjoint(variants: dict[str, list[str]]) -> None:
    for (na, a), (nb, b) in itertools.combinations(variants.items(), 2):
        assert not set(a) & set(b), f"{na} and {nb} share a key"


def test_namespace_and_salt_separate_keys():
    conn = _conn()
    _all_disjoint(
        {
            "default": conn.block_hashes(TOKENS),
            "salt=''": conn.block_hashes(TOKENS, salt=""),
            "salt='a'": conn.block_hashes(TOKENS, salt="a"),
            "salt='b'": conn.block_hashes(TOKENS, salt="b"),
            "namespace='other'": _conn(namespace="other").block_hashes(TOKENS),
            "namespace='other', salt='a'": _conn(namespace="other").block_hashes(TOKENS, salt="a"),
        }
    )
    assert conn.block_hashes(TOKENS, salt=None) == conn.block_hashes(TOKENS)
    assert conn.block_hashes(TOKENS, salt="a") == conn.block_hashes(TOKENS, salt="a")


def test_layout_separates_keys():
    latent = dict(size=64, page_size=16, kv_lora_rank=6, qk_rope_head_dim=2, layer_num=2)
    variants = {
        "base": _conn(),
        "float16": _conn(_mha(dtype=jnp.float16)),
        "float32": _conn(_mha(dtype=jnp.float32)),
        "float8_e4m3fn": _conn(_mha(dtype=jnp.float8_e4m3fn)),
        "float8_e5m2": _conn(_mha(dtype=jnp.float8_e5m2)),
        "head_num": _conn(_mha(head_num=4)),
        "head_dim": _conn(_mha(head_dim=8)),
        "v_head_dim": _conn(_mha(v_head_dim=2)),
        "layer_num": _conn(_mha(layer_num=3)),
        "start_layer": _conn(_mha(start_layer=2)),
        "block_size": _conn(block_size=8),
        "shard": _conn(shard="tp0of2"),
        "k_only": _conn(KOnlyPool.create(size=64, head_num=2, head_dim=4, layer_num=2)),
        "mla": _conn(MLAPool.create(**latent)),
        "nsa": _conn(NSAPool.create(index_head_dim=8, **latent)),
        "nsa index_head_dim": _conn(NSAPool.create(index_head_dim=16, **latent)),
    }
    _all_disjoint({name: c.block_hashes(TOKENS) for name, c in variants.items()})


def test_pool_size_does_not_change_keys():
    """Same model and layout with a bigger or smaller pool (a restart with another memory
    budget) must find the blocks stored before."""
    assert _conn(_mha(size=64)).block_hashes(TOKENS) == _conn(_mha(size=512)).block_hashes(TOKENS)


# --------------------------------------------------------------------------------------------
# Salts: str, bytes or None, nothing that `bytes()` would turn into zero bytes

SALT_BLOCK = 4


def _salted_conn() -> KVConnector:
    return KVConnector(random_mha_pool(0, size=32), HostStore(1 << 20), block_size=SALT_BLOCK)


@pytest.mark.parametrize("salt", [0, 3, False, True, 1.0, bytearray(b"t"), ["t"], object()])
def test_salts_other_than_str_bytes_or_none_are_refused(salt):
    conn = _salted_conn()
    tokens = np.arange(2 * SALT_BLOCK)
    for call in (conn.block_hashes, conn.lookup):
        with pytest.raises(TypeError, match="salt: expected a str, bytes or None"):
            call(tokens, salt=salt)
    with pytest.raises(TypeError, match="salt"):
        conn.store(random_mha_pool(0, size=32), tokens, np.arange(1, 2 * SALT_BLOCK + 1), salt=salt)
    assert len(conn.backend) == 0


def test_a_huge_int_salt_is_refused_at_once():
    start = time.perf_counter()
    with pytest.raises(TypeError, match="salt"):
        _salted_conn().block_hashes(np.arange(SALT_BLOCK), salt=10**10000)
    assert time.perf_counter() - start < 1.0  # not a 10**10000-byte buffer


def test_salts_keep_tenants_apart_and_text_equals_its_utf8_bytes():
    conn = _salted_conn()
    tokens = np.arange(SALT_BLOCK)
    keys = {
        repr(s): conn.block_hashes(tokens, salt=s)[0] for s in (None, "", "a", "b", b"\0", "\0\0")
    }
    assert len(set(keys.values())) == len(keys)
    assert conn.block_hashes(tokens, salt="tenant-é") == conn.block_hashes(
        tokens, salt="tenant-é".encode()
    )
