"""The package and its pools: one test per documented behaviour."""

from __future__ import annotations

import ast
import copy
import dataclasses
import inspect
import pickle
import re

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from absl.testing import parameterized
from helpers import (
    ALL_DTYPES,
    INDEX_AMAX_FLOOR,
    POOL_CLASSES,
    REPO,
    SETTERS,
    SMALL,
    STORE_DTYPES,
    buffer_names,
    call_setter,
    decode_ref,
    encode_ref,
    fill_all,
    flush_subnormals,
    host,
    index_pages_ref,
    is_packed,
    key_row_shape,
    latent_read_ref,
    latent_rows_ref,
    make_pool,
    mla_rows_ref,
    quantize_index_ref,
    random_values,
    row_buffer_names,
    run_python,
    setter_args,
    small,
    snapshot,
)

import jaxkv
from jaxkv import testing
from jaxkv.connector.layout import describe

FP8 = [jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)]
LATENT_KINDS = ["mla", "nsa"]


def rows_of(pool) -> int:
    return pool.size + pool.page_size


# ---- package -------------------------------------------------------------------------------


def test_version_is_a_string():
    assert isinstance(jaxkv.__version__, str)
    assert jaxkv.__version__


@pytest.mark.parametrize(
    "name",
    [
        "MHAPool",
        "MLAPool",
        "NSAPool",
        "KOnlyPool",
        "TokenAllocator",
        "PagedAllocator",
        "ReqToTokenPool",
        "UnsupportedKVCacheError",
    ],
)
def test_top_level_name(name):
    assert hasattr(jaxkv, name)
    assert name in jaxkv.__all__


@pytest.mark.parametrize(
    "alias, name",
    [
        ("MHATokenToKVPool", "MHAPool"),
        ("MLATokenToKVPool", "MLAPool"),
        ("NSATokenToKVPool", "NSAPool"),
        ("MHATokenToKOnlyPool", "KOnlyPool"),
    ],
)
def test_sglang_alias_is_the_same_object(alias, name):
    assert getattr(jaxkv, alias) is getattr(jaxkv, name)


def test_connector_exports():
    from jaxkv import connector

    for name in ("KVConnector", "HostStore", "DiskStore"):
        assert hasattr(connector, name), name


# Test, bench and optional-extra packages: `import jaxkv` must not need them.
OPTIONAL = {"hypothesis", "pytest", "matplotlib", "redis", "torch", "pandas", "tensorflow"}

_IMPORT_WITH_CORE_DEPS_ONLY = """
import importlib.abc, sys
OPTIONAL = set(sys.argv[1].split(","))

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in OPTIONAL:
            raise ImportError(f"blocked optional dependency {name}")
        return None

sys.meta_path.insert(0, Block())
import jaxkv
import jaxkv.connector
pool = jaxkv.MHAPool.create(size=4, head_num=1, head_dim=2, layer_num=1)
print(type(jaxkv.__version__).__name__, type(pool).__name__, jaxkv.connector.KVConnector.__name__)
"""


@pytest.mark.slow  # a fresh interpreter; read from the source: test_no_module_loaded_by_import_...
def test_import_needs_only_core_dependencies():
    """`import jaxkv` (and `jaxkv.connector`) work with test, bench and optional-extra packages
    unavailable."""
    out = run_python("-c", _IMPORT_WITH_CORE_DEPS_ONLY, ",".join(sorted(OPTIONAL)), timeout=120)
    assert out.stdout.split() == ["str", "MHAPool", "KVConnector"]


def _load_time_imports(body, guarded=False):
    """(module, level, names, guarded) of each import in `body` that runs when the module is
    loaded: not those in functions or under `if TYPE_CHECKING:`; `guarded` when a `try` around
    it catches ImportError (or anything wider)."""
    for node in body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, 0, (), guarded
        elif isinstance(node, ast.ImportFrom):
            yield node.module or "", node.level, tuple(a.name for a in node.names), guarded
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _load_time_imports(node.orelse, guarded)
        elif isinstance(node, ast.Try):
            caught = {ast.unparse(h.type) if h.type else "" for h in node.handlers}
            catches = bool(caught & {"", "ImportError", "ModuleNotFoundError", "Exception"})
            yield from _load_time_imports(node.body, guarded or catches)
            for part in (node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _load_time_imports(part, guarded)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for field in ("body", "orelse", "finalbody"):  # classes, ifs, withs, loops
                yield from _load_time_imports(getattr(node, field, []), guarded)


def _module_file(name: str):
    path = REPO.joinpath(*name.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def test_no_module_loaded_by_import_jaxkv_needs_an_optional_package():
    """The source form of the test above, cheap enough for every run: follows the imports that
    `import jaxkv` and `import jaxkv.connector` execute, through jaxkv's own modules, and finds
    no unguarded import of a test, bench or optional-extra package among them."""
    loaded, todo, offending = set(), ["jaxkv", "jaxkv.connector"], []
    while todo:
        name = todo.pop()
        if name in loaded or _module_file(name) is None:
            continue
        loaded.add(name)
        todo.extend(".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1))
        path = _module_file(name)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for module, level, names, guarded in _load_time_imports(ast.parse(path.read_text()).body):
            if level:
                base = package.rsplit(".", level - 1)[0] if level > 1 else package
                module = f"{base}.{module}" if module else base
            if module.split(".")[0] == "jaxkv":
                todo.append(module)
                todo.extend(f"{module}.{n}" for n in names)  # `from pkg import submodule`
            elif module.split(".")[0] in OPTIONAL and not guarded:
                offending.append(f"{name}: import {module}")
    assert {"jaxkv.pools", "jaxkv.connector.remote", "jaxkv.connector.disk"} <= loaded
    assert offending == []


# ---- create(): keyword-only, validation, defaults -----------------------------------------------


def test_create_is_keyword_only(pool_kind):
    cls = POOL_CLASSES[pool_kind]
    args = SMALL[pool_kind]
    with pytest.raises(TypeError):
        cls.create(args["size"], **{k: v for k, v in args.items() if k != "size"})


_BAD_SIZES = [
    ("mha", {"size": 13}, "size"),  # not a multiple of page_size=2
    ("konly", {"size": 5, "page_size": 4}, "size"),
    ("nsa", {"size": 6}, "size"),  # page_size=4
    ("mha", {"size": 0}, "size"),
    ("mla", {"size": -4}, "size"),
    ("mha", {"page_size": 0}, "page_size"),
    ("nsa", {"page_size": -4}, "page_size"),
    ("mha", {"layer_num": 0}, "layer_num"),
    ("nsa", {"layer_num": -1}, "layer_num"),
    ("mha", {"head_num": 0}, "head_num"),
    ("konly", {"head_num": -2}, "head_num"),
    ("mha", {"head_dim": 0}, "head_dim"),
    ("konly", {"head_dim": -1}, "head_dim"),
    ("mha", {"v_head_dim": 0}, "v_head_dim"),
    ("mla", {"kv_lora_rank": 0}, "kv_lora_rank"),
    ("nsa", {"kv_lora_rank": -6}, "kv_lora_rank"),
    ("mla", {"qk_rope_head_dim": 0}, "qk_rope_head_dim"),
    ("nsa", {"qk_rope_head_dim": -2}, "qk_rope_head_dim"),
    ("nsa", {"index_head_dim": 0}, "index_head_dim"),
]


@pytest.mark.parametrize(
    "kind, override, arg", _BAD_SIZES, ids=[f"{k}-{a}={o[a]}" for k, o, a in _BAD_SIZES]
)
def test_create_rejects_bad_sizes(kind, override, arg):
    with pytest.raises(ValueError, match=arg):
        make_pool(kind, **override)


@pytest.mark.parametrize(
    "bad", [np.int8, jnp.int32, np.float64, np.complex64, "float64", "not-a-dtype", jnp.bool_]
)
def test_create_rejects_unsupported_dtypes(pool_kind, bad):
    with pytest.raises(ValueError):
        make_pool(pool_kind, dtype=bad)


def test_create_accepts_every_supported_dtype_spelling():
    for spelling in (jnp.bfloat16, jnp.dtype(jnp.bfloat16), ml_dtypes.bfloat16, "bfloat16"):
        assert make_pool("mha", dtype=spelling).dtype == jnp.dtype(jnp.bfloat16)


def test_create_defaults():
    mha = jaxkv.MHAPool.create(size=8, head_num=2, head_dim=4, layer_num=1)
    assert (mha.page_size, mha.dtype, mha.v_head_dim, mha.start_layer) == (
        1,
        jnp.dtype(jnp.bfloat16),
        4,
        0,
    )
    konly = jaxkv.KOnlyPool.create(size=8, head_num=2, head_dim=4, layer_num=1)
    assert (konly.page_size, konly.dtype, konly.start_layer) == (1, jnp.dtype(jnp.bfloat16), 0)
    mla = jaxkv.MLAPool.create(size=8, kv_lora_rank=4, qk_rope_head_dim=2, layer_num=1)
    assert (mla.page_size, mla.dtype, mla.start_layer) == (1, jnp.dtype(jnp.bfloat16), 0)
    nsa = jaxkv.NSAPool.create(size=64, kv_lora_rank=4, qk_rope_head_dim=2, layer_num=1)
    assert (nsa.page_size, nsa.index_head_dim, nsa.dtype) == (64, 128, jnp.dtype(jnp.bfloat16))
    chex.assert_shape(nsa.index_k_with_scale_buffer[0], (2, 64 * (128 + 4)))


# ---- attributes and buffers ------------------------------------------------------------------


def test_attributes(pool_kind, pool_dtype):
    pool = make_pool(pool_kind, pool_dtype, start_layer=3)
    expected = {**small(pool_kind, pool_dtype), "start_layer": 3}
    for name, value in expected.items():
        assert getattr(pool, name) == value, name
    assert pool.dtype == pool_dtype
    assert pool.store_dtype == STORE_DTYPES[pool_dtype]


def test_buffer_shapes_and_store_dtypes(pool_kind, pool_dtype):
    pool = make_pool(pool_kind, pool_dtype)
    rows = rows_of(pool)
    store = STORE_DTYPES[pool_dtype]
    if pool_kind in ("mha", "konly"):
        shapes = {"k_buffer": (rows, pool.head_num, pool.head_dim)}
    elif pool_kind == "nsa" and pool_dtype.itemsize == 1:  # packed: fp8 tiles, scales, bf16 rope
        rank, rope = pool.kv_lora_rank, pool.qk_rope_head_dim
        shapes = {"kv_buffer": (rows, 1, rank + 4 * (rank // 128) + 2 * rope)}
    else:
        shapes = {"kv_buffer": (rows, 1, pool.kv_lora_rank + pool.qk_rope_head_dim)}
    if pool_kind == "mha":
        shapes["v_buffer"] = (rows, pool.head_num, pool.v_head_dim)
    for name, shape in shapes.items():
        layers = getattr(pool, name)
        assert isinstance(layers, tuple) and len(layers) == pool.layer_num
        for buf in layers:
            assert isinstance(buf, jax.Array)
            chex.assert_shape(buf, shape)
            chex.assert_type(buf, store)
            assert not np.any(host(buf)), "a new pool is zeroed"


@pytest.mark.parametrize("page_size, index_head_dim", [(4, 8), (2, 16), (64, 128)])
def test_nsa_index_buffer_layout_shape(page_size, index_head_dim):
    pool = make_pool("nsa", size=2 * page_size, page_size=page_size, index_head_dim=index_head_dim)
    pages = (pool.size + page_size) // page_size
    assert len(pool.index_k_with_scale_buffer) == pool.layer_num
    for buf in pool.index_k_with_scale_buffer:
        chex.assert_shape(buf, (pages, page_size * (index_head_dim + 4)))
        chex.assert_type(buf, np.uint8)


def test_attributes_present_tell_the_kind(pool_kind):
    pool = make_pool(pool_kind)
    present = {n for n in ("k_buffer", "v_buffer", "kv_buffer") if hasattr(pool, n)}
    assert (
        present
        == {
            "mha": {"k_buffer", "v_buffer"},
            "konly": {"k_buffer"},
            "mla": {"kv_buffer"},
            "nsa": {"kv_buffer"},
        }[pool_kind]
    )
    assert hasattr(pool, "index_k_with_scale_buffer") == (pool_kind == "nsa")


# ---- pytree ----------------------------------------------------------------------------------


def test_pytree_leaves_are_exactly_the_buffers(pool_kind):
    pool = make_pool(pool_kind)
    leaves = jax.tree_util.tree_leaves(pool)
    buffers = [b for name in buffer_names(pool_kind) for b in getattr(pool, name)]
    assert len(leaves) == len(buffers) == pool.layer_num * len(buffer_names(pool_kind))
    assert {id(x) for x in leaves} == {id(b) for b in buffers}


def test_pytree_metadata_is_static(pool_kind):
    pool = make_pool(pool_kind, jnp.float16, start_layer=2)
    leaves, treedef = jax.tree_util.tree_flatten(pool)
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert type(rebuilt) is type(pool)
    for name in ("size", "page_size", "dtype", "layer_num", "start_layer"):
        assert getattr(rebuilt, name) == getattr(pool, name)
    # Metadata lives in the treedef: equal shapes give equal treedefs, other metadata does not.
    same = make_pool(pool_kind, jnp.float16, start_layer=2)
    assert jax.tree_util.tree_structure(same) == treedef
    assert jax.tree_util.tree_structure(make_pool(pool_kind, jnp.float16)) != treedef
    assert jax.tree_util.tree_structure(make_pool(pool_kind, jnp.bfloat16, start_layer=2)) != (
        treedef
    )


def test_pytree_rebuilt_pool_flattens_to_its_own_buffers(pool_kind):
    """A pool rebuilt from other leaves (a jit output, a tree map) holds and flattens to
    exactly those leaves, under attribute key paths; a pickled copy has the same treedef."""
    pool = make_pool(pool_kind, layer_num=2)
    mapped = jax.tree.map(lambda x: x + 1, pool)
    for name in buffer_names(pool_kind):
        assert [id(b) for b in getattr(mapped, name)] != [id(b) for b in getattr(pool, name)]
    buffers = [b for name in buffer_names(pool_kind) for b in getattr(mapped, name)]
    paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(mapped)[0])
    assert [id(x) for x in leaves] == [id(b) for b in buffers]
    assert [jax.tree_util.keystr(p) for p in paths] == [
        f".{name}[{li}]" for name in buffer_names(pool_kind) for li in range(2)
    ]
    assert not mapped.consumed and mapped.size == pool.size
    treedef = jax.tree_util.tree_structure(pool)
    for copied in (pickle.loads(pickle.dumps(mapped)), copy.deepcopy(mapped), copy.copy(mapped)):
        assert jax.tree_util.tree_structure(copied) == treedef
        testing.assert_bits_equal(jax.tree.leaves(copied)[0], leaves[0])
    assert f"size={pool.size}" in str(treedef)  # its statics print in messages


def test_jit_over_two_equal_pools_traces_once(pool_kind):
    @jax.jit
    @testing.traced_once
    def read_first_rows(pool):
        return pool.get_key_buffer(pool.start_layer)[:2]

    loc = np.array([0, 1])
    a = fill_all(make_pool(pool_kind), pool_kind, 0, loc, np.random.default_rng(0))
    b = fill_all(make_pool(pool_kind), pool_kind, 0, loc, np.random.default_rng(1))
    ra, rb = read_first_rows(a), read_first_rows(b)  # a second trace would raise
    with pytest.raises(AssertionError, match="elements differ"):  # each call read its own pool
        testing.assert_bits_equal(ra, rb)


# ---- one declaration per kind ----------------------------------------------------------------

# The part key each buffer attribute is exported under (the keys of a block record's parts).
PART_KEYS = {
    "k_buffer": "k",
    "v_buffer": "v",
    "kv_buffer": "kv",
    "index_k_with_scale_buffer": "index_k",
}


class _Mirror:
    """Another framework's pool holding the same buffers as host arrays (SGLang's attributes)."""

    def __init__(self, **attrs):
        self.__dict__.update(attrs)


def _mirror(pool) -> _Mirror:
    buffers = {a: [np.asarray(b) for b in getattr(pool, a)] for a in type(pool).BUFFERS}
    sizes = dict(dtype=pool.dtype, page_size=pool.page_size, start_layer=pool.start_layer)
    return _Mirror(**buffers, **sizes)


def assert_one_description(pool) -> None:
    """Every description of `pool`'s buffers agrees: its declared buffer fields, its pytree
    leaves and key paths, its static fields (no arrays), `buffer_specs`, the connector's layout
    and the layout of a foreign object holding the same buffers, and `get_kv_size_bytes`."""
    cls = type(pool)
    declared = cls.BUFFERS
    assert declared, f"{cls.__name__} declares no buffers"
    for f in dataclasses.fields(pool):
        if f.name not in declared:
            value = getattr(pool, f.name)
            arrays = [x for x in jax.tree_util.tree_leaves(value) if isinstance(x, jax.Array)]
            assert not arrays, f"{f.name} holds arrays but is no declared buffer"
            hash(value)  # static metadata is hashable
    paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(pool)[0])
    assert [jax.tree_util.keystr(p) for p in paths] == [
        f".{a}[{li}]" for a in declared for li in range(pool.layer_num)
    ], "the pytree's leaves are the declared buffers, in order"
    assert [id(x) for x in leaves] == [id(b) for a in declared for b in getattr(pool, a)]
    specs = pool.buffer_specs()
    assert tuple(s.attr for s in specs) == declared, "one spec per declared buffer, in order"
    assert len({s.key for s in specs}) == len(specs), "part keys are distinct"
    for s in specs:
        for buf in getattr(pool, s.attr):
            assert buf.shape == s.layer_shape(pool.rows) and buf.dtype == s.bits_dtype, s.attr
    theirs = describe(pool)
    assert theirs.parts == specs, "the connector's parts are the pool's specs"
    foreign = describe(_mirror(pool))
    assert [(p.attr, p.key, p.row_shape, p.bits_dtype) for p in foreign.parts] == [
        (s.attr, s.key, s.row_shape, s.bits_dtype) for s in specs
    ], "a foreign object with the same buffers is described alike"
    assert (foreign.kind, foreign.fingerprint(16)) == (theirs.kind, theirs.fingerprint(16))
    size = pool.get_kv_size_bytes()
    by_key = {s.key: sum(int(b.nbytes) for b in getattr(pool, s.attr)) for s in specs}
    total = sum(size) if isinstance(size, tuple) else size
    assert total == sum(by_key.values()), f"get_kv_size_bytes: {size}, buffers: {by_key}"
    if isinstance(size, tuple):
        assert size == (by_key.get("k", 0), by_key.get("v", 0)), f"{size} for {by_key}"


def test_each_kind_describes_its_buffers_once(pool_kind, pool_dtype):
    pool = make_pool(pool_kind, pool_dtype)
    assert type(pool).BUFFERS == buffer_names(pool_kind)
    assert [s.key for s in pool.buffer_specs()] == [PART_KEYS[a] for a in type(pool).BUFFERS]
    assert_one_description(pool)


def test_a_kind_declared_inconsistently_fails_the_agreement_check():
    class ForgetsTheIndex(jaxkv.NSAPool):
        def get_kv_size_bytes(self):
            return self.part_bytes("kv")

    class Reordered(jaxkv.MHAPool):
        def buffer_specs(self):
            return super().buffer_specs()[::-1]

    class KeepsArraysStatic(jaxkv.MLAPool):
        scales: tuple = ()

    good = make_pool("mha")
    assert_one_description(good)
    hidden = KeepsArraysStatic.create(**small("mla"))
    broken = [
        (ForgetsTheIndex.create(**small("nsa")), "get_kv_size_bytes"),
        (Reordered.create(**small("mha")), "one spec per declared buffer"),
        (dataclasses.replace(hidden, scales=(jnp.ones(3),)), "scales holds arrays"),
    ]
    for pool, why in broken:
        with pytest.raises(AssertionError, match=why):
            assert_one_description(pool)


def test_a_kind_whose_declarations_contradict_themselves_is_refused_when_defined():
    with pytest.raises(TypeError, match=r"distinct part key per buffer, got \['k'\]"):

        class TwoKeys(jaxkv.MHAPool):
            v_buffer: tuple = jaxkv.pools.buffer(key="k", rows=lambda p: p.head_rows(1))

    with pytest.raises(TypeError, match=r"WiderPool.create: .*missing \['extra'\]"):

        class WiderPool(jaxkv.MHAPool):
            extra: int

    class IndexAsRows(jaxkv.NSAPool):
        def index_rows(self):
            return self.latent_rows()

    with pytest.raises(TypeError, match="index_k_with_scale_buffer: expected rows laid out by"):
        IndexAsRows.create(size=64, kv_lora_rank=4, qk_rope_head_dim=2, layer_num=1)


_REQUIRED = inspect.Parameter.empty
_COMMON_HEAD = [("size", _REQUIRED), ("page_size", 1), ("dtype", jnp.bfloat16)]
_COMMON_TAIL = [("start_layer", 0), ("sharding", None)]
_HEADS = [("head_num", _REQUIRED), ("head_dim", _REQUIRED), ("layer_num", _REQUIRED)]
_LATENT = [("kv_lora_rank", _REQUIRED), ("qk_rope_head_dim", _REQUIRED), ("layer_num", _REQUIRED)]
CREATE_SIGNATURES = {
    "mha": _COMMON_HEAD + _HEADS + [("v_head_dim", None)] + _COMMON_TAIL,
    "konly": _COMMON_HEAD + _HEADS + _COMMON_TAIL,
    "mla": _COMMON_HEAD + _LATENT + _COMMON_TAIL,
    "nsa": [("size", _REQUIRED), ("page_size", 64), ("dtype", jnp.bfloat16)]
    + _LATENT
    + [("index_head_dim", 128)]
    + _COMMON_TAIL,
}


def test_create_signatures_are_the_documented_ones(pool_kind):
    """`create` is a plain keyword-only classmethod of each kind, its arguments in the order and
    with the defaults the reference documents (what `help` and type checkers show)."""
    cls = POOL_CLASSES[pool_kind]
    assert isinstance(cls.__dict__["create"], classmethod)
    params = inspect.signature(cls.create).parameters.values()
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params)
    assert [(p.name, p.default) for p in params] == CREATE_SIGNATURES[pool_kind]


_TYPED_CALLS = """
import jax.numpy as jnp
import jaxkv

reveal_type(jaxkv.MHAPool.create(size=8, head_num=1, head_dim=2, layer_num=1))
reveal_type(jaxkv.KOnlyPool.create(size=8, head_num=1, head_dim=2, layer_num=1))
reveal_type(jaxkv.MLAPool.create(size=8, kv_lora_rank=4, qk_rope_head_dim=2, layer_num=1))
reveal_type(jaxkv.NSAPool.create(size=64, kv_lora_rank=4, qk_rope_head_dim=2, layer_num=1))
jaxkv.MHAPool.create(size=8, head_num=1, head_dim=2)
jaxkv.MLAPool.create(8, kv_lora_rank=4, qk_rope_head_dim=2, layer_num=1)
"""


@pytest.mark.slow
def test_type_checkers_see_each_kind_s_create(tmp_path, monkeypatch):
    """mypy reads `create` from the source: each kind's result type, and its documented
    keyword-only arguments (a missing one, or a positional one, is an error)."""
    api = pytest.importorskip("mypy.api")
    monkeypatch.chdir(REPO)  # mypy finds the package under test first
    script = tmp_path / "calls.py"
    script.write_text(_TYPED_CALLS)
    cache = str(tmp_path / "cache")
    out, err, _ = api.run(
        [str(script), "--follow-imports=silent", "--ignore-missing-imports", "--cache-dir", cache]
    )
    assert not err, err
    for kind in ("MHAPool", "KOnlyPool", "MLAPool", "NSAPool"):
        assert f'Revealed type is "jaxkv.pools.{kind}"' in out, out
    assert 'has no attribute "create"' not in out, out
    assert 'Missing named argument "layer_num"' in out, out
    # The positional size: mypy names it by what `**common` then receives twice.
    assert "calls.py:10: error" in out, out


# ---- layer ids -------------------------------------------------------------------------------


def test_layer_ids_are_global(pool_kind):
    pool = make_pool(pool_kind, jnp.float32, start_layer=5)  # layers 5 and 6
    loc = np.array([3])
    new = fill_all(pool, pool_kind, 6, loc, np.random.default_rng(0))
    key = row_buffer_names(pool_kind)[0]
    assert np.any(host(getattr(new, key)[1])[3]), "layer 6 is local index 1"
    assert not np.any(host(getattr(new, key)[0])), "layer 5 untouched"
    chex.assert_trees_all_equal(new.get_key_buffer(6), getattr(new, key)[1])


@pytest.mark.parametrize("bad", [0, 4, 7, -1, 100])
def test_layer_id_out_of_range_raises_index_error_naming_the_range(pool_kind, bad):
    pool = make_pool(pool_kind, start_layer=5)  # valid: 5, 6
    loc = np.array([1])
    calls = [lambda: pool.get_key_buffer(bad)]
    calls += [
        lambda name=name: call_setter(pool, name, bad, loc, np.random.default_rng(0))
        for name in SETTERS[pool_kind]
    ]
    if pool_kind != "konly":
        calls.append(lambda: pool.get_value_buffer(bad))
    if pool_kind in LATENT_KINDS:
        calls.append(lambda: pool.get_mla_kv(bad, loc))
    if pool_kind == "nsa":
        calls.append(lambda: pool.get_index_k(bad, loc))
    for call in calls:
        with pytest.raises(IndexError) as err:
            call()
        # "range(5, 7)", "[5, 7)", "5..6" and the like all name the range.
        assert re.search(r"5\D{1,4}[67]", str(err.value)), str(err.value)


# ---- reads -----------------------------------------------------------------------------------


def _stored_values(rng, pool, shape):
    """Random values already in the pool dtype, so writing them is lossless."""
    return np.clip(rng.standard_normal(shape) * 4, -50, 50).astype(np.float32).astype(pool.dtype)


def test_reads_return_the_logical_dtype(pool_kind, pool_dtype):
    pool = make_pool(pool_kind, pool_dtype)
    rng = np.random.default_rng(0)
    loc = np.array([2, 7, 1])
    k = _stored_values(rng, pool, (3, *key_row_shape(pool)))
    if pool_kind == "mha":
        v = _stored_values(rng, pool, (3, pool.head_num, pool.v_head_dim))
        pool = pool.set_kv(1, loc, k, v)
    else:
        pool = pool.set_k(1, loc, k)
    key = pool.get_key_buffer(1)
    # Packed fp8 NSA rows are read dequantised, as float32; every other pool reads its dtype.
    read_dtype = np.float32 if is_packed(pool) else pool_dtype
    want = k.astype(np.float32)
    if is_packed(pool):  # quantised per tile: the reference says what reads give back
        want = latent_read_ref(pool, latent_rows_ref(pool, k))
    chex.assert_type(key, read_dtype)
    chex.assert_shape(key, (rows_of(pool), *key_row_shape(pool)))
    np.testing.assert_array_equal(host(key)[loc].astype(np.float32), want)
    if pool_kind == "konly":
        return
    value = pool.get_value_buffer(1)
    chex.assert_type(value, read_dtype)
    if pool_kind == "mha":
        chex.assert_shape(value, (rows_of(pool), pool.head_num, pool.v_head_dim))
        np.testing.assert_array_equal(host(value)[loc].astype(np.float32), v.astype(np.float32))
    else:
        chex.assert_shape(value, (rows_of(pool), 1, pool.kv_lora_rank))
        chex.assert_trees_all_equal(value, key[..., : pool.kv_lora_rank])
    chex.assert_trees_all_equal(pool.get_kv_buffer(1), (key, value))


@pytest.mark.parametrize("kind", LATENT_KINDS)
def test_get_mla_kv_returns_rows_at_loc(kind, pool_dtype):
    pool = make_pool(kind, pool_dtype)
    rng = np.random.default_rng(1)
    k_nope = _stored_values(rng, pool, (3, 1, pool.kv_lora_rank))
    k_rope = _stored_values(rng, pool, (3, 1, pool.qk_rope_head_dim))
    pool = pool.set_mla_kv(0, np.array([4, 9, 2]), k_nope, k_rope)
    nope, rope = pool.get_mla_kv(0, np.array([9, 2, 4, 4]))
    chex.assert_shape(nope, (4, 1, pool.kv_lora_rank))
    chex.assert_shape(rope, (4, 1, pool.qk_rope_head_dim))
    read_dtype = pool_dtype
    if is_packed(pool):  # read dequantised, as float32
        read_dtype = np.float32
        rows = latent_read_ref(pool, mla_rows_ref(pool, k_nope, k_rope))
        k_nope, k_rope = rows[..., : pool.kv_lora_rank], rows[..., pool.kv_lora_rank :]
    chex.assert_type([nope, rope], read_dtype)
    order = [1, 2, 0, 0]
    testing.assert_bits_equal(nope, k_nope[order])
    testing.assert_bits_equal(rope, k_rope[order])


def test_get_index_k_dequantises_and_packs_sglang_layout():
    pool = make_pool("nsa", jnp.bfloat16)  # page_size 4, index_head_dim 8, 12 rows
    p, d = pool.page_size, pool.index_head_dim
    rng = np.random.default_rng(2)
    loc = np.array([5, 0, 11, 6])
    x = rng.standard_normal((4, d)).astype(np.float32) * np.array([[1.0], [30.0], [1e-3], [7.0]])
    x = x.astype(np.float32)
    pool = pool.set_index_k(1, loc, x)

    got = pool.get_index_k(1, loc)
    chex.assert_type(got, np.float32)
    chex.assert_shape(got, (4, d))
    amax = np.max(np.abs(x), axis=-1, keepdims=True)
    scale = np.maximum(amax, INDEX_AMAX_FLOOR) / np.float32(448.0)
    # e4m3: 3 mantissa bits (half-ulp 2**-4 relative); subnormals step by 2**-9 * scale.
    err = np.abs(host(got) - x)
    assert np.all(err <= np.abs(x) * (2**-4 + 1e-6) + scale * 2**-10), err

    raw = host(pool.index_k_with_scale_buffer[1])
    expected = np.zeros_like(raw)
    for t, slot in enumerate(loc):
        page, off = divmod(int(slot), p)
        scale_bytes = raw[page, p * d + 4 * off : p * d + 4 * off + 4]
        assert scale_bytes.view("<f4")[0] == scale[t, 0]
        keys = raw[page, off * d : (off + 1) * d].view(ml_dtypes.float8_e4m3fn)
        np.testing.assert_array_equal(
            keys.astype(np.float32) * scale_bytes.view("<f4")[0], host(got)[t]
        )
        expected[page, off * d : (off + 1) * d] = raw[page, off * d : (off + 1) * d]
        expected[page, p * d + 4 * off : p * d + 4 * off + 4] = scale_bytes
    np.testing.assert_array_equal(raw, expected)  # nothing else was written
    assert not np.any(host(pool.index_k_with_scale_buffer[0])), "other layer untouched"


def test_get_index_k_of_any_record_bytes_reads_the_same_bits_on_every_backend():
    """Records with NaN keys of either sign and subnormal, NaN or negative scales (bytes a store
    may hand back) read as code * scale with subnormals as signed zeros and one quiet NaN: x86
    keeps a NaN operand's sign, NVIDIA GPUs return 0x7FFFFFFF, XLA:GPU keeps subnormals."""
    pool = make_pool("nsa")
    d = pool.index_head_dim
    keys = np.random.default_rng(4).integers(0, 256, (rows_of(pool), d), dtype=np.uint8)
    keys[:, :2] = [0x7F, 0xFF]  # e4m3fn NaN, positive and negative
    scales = np.resize(
        np.array([0x00000001, 0x80400000, 0x7FC00001, 0xFFC00000, 0x3F800000, 0x00800000,
                  0xBE000000, 0x01000000], np.uint32),
        rows_of(pool),
    ).view(np.float32)  # fmt: skip
    records = np.concatenate([keys, scales[:, None].view(np.uint8)], axis=-1)
    pages = jnp.asarray(index_pages_ref(records, pool.page_size))
    pool = pool.with_buffers(index_k_with_scale_buffer=[pages] * pool.layer_num)
    loc = np.arange(rows_of(pool))
    got = host(pool.get_index_k(0, loc))
    codes = keys.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        want = flush_subnormals(codes * flush_subnormals(scales)[:, None])
    testing.assert_bits_equal(got, want)


def test_set_index_k_zero_row_stores_zero_keys_and_the_floor_scale():
    pool = make_pool("nsa")
    d = pool.index_head_dim
    pool = pool.set_index_k(0, np.array([1, 3, 7]), np.ones((3, d)))
    pool = pool.set_index_k(0, np.array([3, 7]), np.zeros((2, d)))  # overwrite with zero rows
    floor_scale = np.float32(1e-4) / np.float32(448.0)  # SGLang floors amax at 1e-4
    zero_record = np.concatenate([np.zeros(d, np.uint8), np.float32([floor_scale]).view(np.uint8)])
    records = np.zeros((rows_of(pool), d + 4), np.uint8)
    records[1] = quantize_index_ref(np.ones((1, d)))[0]
    records[[3, 7]] = zero_record
    assert np.array_equal(quantize_index_ref(np.zeros((1, d)))[0], zero_record)
    np.testing.assert_array_equal(
        host(pool.index_k_with_scale_buffer[0]), index_pages_ref(records, pool.page_size)
    )
    np.testing.assert_array_equal(host(pool.get_index_k(0, np.array([3, 7]))), 0.0)


def test_set_index_k_floors_tiny_amax():
    pool = make_pool("nsa")
    d = pool.index_head_dim
    x = np.zeros((2, d), np.float32)
    x[0, 0], x[1, 0] = 1e-5, 2e-4  # below and above the floor
    pool = pool.set_index_k(0, np.array([2, 5]), x)
    raw = host(pool.index_k_with_scale_buffer[0])
    p = pool.page_size
    at = [p * d + 4 * (s % p) for s in (2, 5)]  # each slot's scale bytes in its page
    scales = [raw[s // p, a : a + 4].view("<f4")[0] for s, a in zip((2, 5), at)]
    assert scales[0] == np.float32(1e-4) / np.float32(448.0)
    assert scales[1] == np.float32(2e-4) / np.float32(448.0)


def _expected_bytes(pool, kind) -> int | tuple[int, int]:
    rows, item = rows_of(pool), pool.store_dtype.itemsize
    if kind in ("mha", "konly"):
        k = pool.layer_num * rows * pool.head_num * pool.head_dim * item
        v = pool.layer_num * rows * pool.head_num * pool.v_head_dim * item if kind == "mha" else 0
        return (k, v)
    total = pool.layer_num * rows * (pool.kv_lora_rank + pool.qk_rope_head_dim) * item
    if kind == "nsa" and pool.dtype.itemsize == 1:  # packed: bytes of fp8, scales, bf16 rope
        rank, rope = pool.kv_lora_rank, pool.qk_rope_head_dim
        total = pool.layer_num * rows * (rank + 4 * (rank // 128) + 2 * rope)
    if kind == "nsa":
        total += pool.layer_num * rows * (pool.index_head_dim + 4)
    return total


def test_get_kv_size_bytes_counts_every_byte(pool_kind, pool_dtype):
    pool = make_pool(pool_kind, pool_dtype)
    got = pool.get_kv_size_bytes()
    assert got == _expected_bytes(pool, pool_kind)
    if pool_kind in ("mha", "konly"):
        assert isinstance(got, tuple) and all(isinstance(n, int) for n in got)
        assert sum(got) == sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(pool))
    else:
        assert isinstance(got, int)
        assert got == sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(pool))


# ---- K-only ----------------------------------------------------------------------------------


@pytest.mark.parametrize("reader", ["get_value_buffer", "get_kv_buffer"])
def test_konly_reads_of_v_raise_not_implemented(reader):
    pool = make_pool("konly")
    with pytest.raises(NotImplementedError) as err:
        getattr(pool, reader)(0)
    assert "does not allocate V" in str(err.value)
    assert type(pool).__name__ in str(err.value)


def test_konly_set_kv_raises_not_implemented_pointing_to_set_k():
    pool = make_pool("konly")
    k = np.ones((1, pool.head_num, pool.head_dim), np.float32)
    with pytest.raises(NotImplementedError) as err:
        pool.set_kv(0, np.array([1]), k, k)
    assert "does not store V" in str(err.value)
    assert "set_k" in str(err.value)
    assert not np.any(host(pool.k_buffer[0])), "nothing was written"


# ---- setter semantics --------------------------------------------------------------------------


def _encoded(pool, x, scale=None):
    return encode_ref(x, pool.dtype, scale)


class TestSetKvEagerAndJitted(chex.TestCase):
    """An update writes the same bits called eagerly and under `jax.jit` (`chex.variants` runs
    each test both ways)."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*((d.name, d) for d in ALL_DTYPES))
    def test_mha_set_kv_writes_k_and_v_rows_only_at_loc(self, pool_dtype):
        pool = make_pool("mha", pool_dtype)
        rng = np.random.default_rng(3)
        loc = np.array([6, 1, 13])
        k = random_values(rng, (3, pool.head_num, pool.head_dim))
        v = random_values(rng, (3, pool.head_num, pool.v_head_dim))
        new = self.variant(lambda p, loc, k, v: p.set_kv(0, loc, k, v))(pool, loc, k, v)
        for name, x in (("k_buffer", k), ("v_buffer", v)):
            expected = np.zeros(getattr(pool, name)[0].shape, pool.store_dtype)
            expected[loc] = _encoded(pool, x)
            testing.assert_bits_equal({name: getattr(new, name)[0]}, {name: expected})
            assert not np.any(host(getattr(new, name)[1])), "other layer untouched"


def test_set_k_writes_k_only(pool_dtype):
    pool = make_pool("mha", pool_dtype)
    rng = np.random.default_rng(4)
    loc = np.array([2, 3])
    k = random_values(rng, (2, pool.head_num, pool.head_dim))
    new = pool.set_k(1, loc, k)
    expected = np.zeros(pool.k_buffer[1].shape, pool.store_dtype)
    expected[loc] = _encoded(pool, k)
    testing.assert_bits_equal(new.k_buffer[1], expected)
    assert not np.any(host(new.v_buffer[1])), "V untouched"


@pytest.mark.parametrize("kind", ["konly", *LATENT_KINDS])
def test_set_k_writes_the_key_rows(kind, pool_dtype):
    pool = make_pool(kind, pool_dtype)
    rng = np.random.default_rng(5)
    loc = np.array([9, 4])
    k = random_values(rng, (2, *key_row_shape(pool)))
    new = pool.set_k(0, loc, k)
    name = row_buffer_names(kind)[0]
    expected = np.zeros(getattr(pool, name)[0].shape, pool.store_dtype)
    expected[loc] = latent_rows_ref(pool, k) if kind in LATENT_KINDS else _encoded(pool, k)
    testing.assert_bits_equal(getattr(new, name)[0], expected)


@pytest.mark.parametrize("kind", LATENT_KINDS)
@pytest.mark.parametrize("cache_v", ["none", "array"])
def test_latent_set_kv_stores_cache_k_and_ignores_cache_v(kind, cache_v, pool_dtype):
    pool = make_pool(kind, pool_dtype)
    rng = np.random.default_rng(6)
    loc = np.array([1, 8, 3])
    k = random_values(rng, (3, *key_row_shape(pool)))
    v = None if cache_v == "none" else random_values(rng, (3, 1, pool.kv_lora_rank))
    new = pool.set_kv(0, loc, k, v, v_scale=None if v is None else 3.0)
    expected = np.zeros(pool.kv_buffer[0].shape, pool.store_dtype)
    expected[loc] = latent_rows_ref(pool, k)
    testing.assert_bits_equal(new.kv_buffer[0], expected)


@pytest.mark.parametrize("kind", LATENT_KINDS)
def test_set_mla_kv_writes_the_concatenation(kind, pool_dtype):
    pool = make_pool(kind, pool_dtype)
    rng = np.random.default_rng(7)
    loc = np.array([2, 10])
    k_nope = random_values(rng, (2, 1, pool.kv_lora_rank))
    k_rope = random_values(rng, (2, 1, pool.qk_rope_head_dim)).astype(jnp.bfloat16)
    new = pool.set_mla_kv(1, loc, k_nope, k_rope, donate=False)
    expected = np.zeros(pool.kv_buffer[1].shape, pool.store_dtype)
    expected[loc] = mla_rows_ref(pool, k_nope, k_rope)
    testing.assert_bits_equal(new.kv_buffer[1], expected)
    same = pool.set_kv(1, loc, np.concatenate([k_nope, k_rope.astype(np.float32)], -1), None)
    chex.assert_trees_all_equal(same.kv_buffer, new.kv_buffer)


def test_set_index_k_matches_the_numpy_quantiser():
    pool = make_pool("nsa")
    rng = np.random.default_rng(8)
    loc = np.array([4, 7, 9])
    x = random_values(rng, (3, pool.index_head_dim), spread=100.0)
    new = pool.set_index_k(0, loc, x)
    records = np.zeros((rows_of(pool), pool.index_head_dim + 4), np.uint8)
    records[loc] = quantize_index_ref(x)
    expected = index_pages_ref(records, pool.page_size)
    np.testing.assert_array_equal(host(new.index_k_with_scale_buffer[0]), expected)
    assert not np.any(host(new.kv_buffer[0])), "latent rows untouched"


def test_empty_update_changes_nothing(pool_kind):
    pool = make_pool(pool_kind)
    before = testing.buffer_bits(pool)
    for name in SETTERS[pool_kind]:
        pool = call_setter(pool, name, 0, np.zeros((0,), np.int32), np.random.default_rng(0))
    testing.assert_unchanged(before, pool)


# ---- values: dtype conversion, scales, fp8 saturation ------------------------------------------

INPUT_DTYPES = [
    np.dtype(np.float64),
    *(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16)),
    *(jnp.dtype(d) for d in (jnp.float8_e4m3fn, jnp.float8_e5m2)),
]


def _inputs_in(dtype, rng, shape) -> np.ndarray:
    """Random finite values of `dtype` spanning its range (float64: float32's), with subnormals
    and signed zeros."""
    info = ml_dtypes.finfo(dtype) if dtype.itemsize <= 2 else np.finfo(np.float32)
    lo, hi = np.log2(float(info.smallest_subnormal)), np.log2(float(info.max))
    mag = np.exp2(rng.uniform(lo, hi, shape))
    x = (mag * rng.choice([-1.0, 1.0], shape)).astype(np.float64)
    x.flat[:4] = [0.0, -0.0, float(info.max), -float(info.smallest_subnormal)][: x.size]
    return np.clip(x, -float(info.max), float(info.max)).astype(dtype)


# numpy arrays of every float dtype, and jax arrays of each one jax holds without x64.
_INPUTS = [(d, False) for d in INPUT_DTYPES] + [(d, True) for d in INPUT_DTYPES[1:]]


@pytest.mark.parametrize(
    "in_dtype, as_jax", _INPUTS, ids=[f"{'jax' if j else 'numpy'}-{d.name}" for d, j in _INPUTS]
)
def test_any_float_input_dtype_is_converted(pool_dtype, in_dtype, as_jax):
    pool = make_pool("mha", pool_dtype)
    rng = np.random.default_rng(9)
    k = _inputs_in(in_dtype, rng, (8, pool.head_num, pool.head_dim))
    v = _inputs_in(in_dtype, rng, (8, pool.head_num, pool.v_head_dim))
    if as_jax:
        k, v = jnp.asarray(k), jnp.asarray(v)
    loc = np.arange(2, 10)
    new = pool.set_kv(0, loc, k, v)
    # A float64 input reaches the device as float32 (x64 off): the reference does the same.
    for name, x in (("k_buffer", k), ("v_buffer", v)):
        got = host(getattr(new, name)[0])[loc]
        testing.assert_bits_equal({name: got}, {name: encode_ref(np.asarray(x), pool_dtype)})
        if pool_dtype.itemsize == 1:  # fp8 saturates: finite in, finite stored
            assert np.all(np.isfinite(decode_ref(got, pool_dtype))), name


def test_unscaled_values_in_the_pool_dtype_round_trip_bit_exactly(pool_dtype):
    pool = make_pool("konly", pool_dtype)
    rows, width = rows_of(pool), np.dtype(f"uint{8 * pool_dtype.itemsize}")
    shape = (rows, pool.head_num, pool.head_dim)
    bits = np.random.default_rng(19).integers(0, np.iinfo(width).max, shape, dtype=width)
    x = bits.view(pool_dtype)
    x = np.where(np.isfinite(x.astype(np.float32)), x, np.zeros((), pool_dtype))  # any finite
    new = pool.set_k(0, np.arange(rows), x)
    testing.assert_bits_equal(new.get_key_buffer(0), x)


@pytest.mark.parametrize(
    "scale",
    [2.0, 0.37, np.float32(1e-3), np.float64(300.0), jnp.float32(0.5), jnp.bfloat16(3.0)],
    ids=["two", "odd", "np32", "np64", "jax32", "jaxbf16"],
)
def test_scaled_values_are_stored_divided(pool_dtype, scale):
    pool = make_pool("mha", pool_dtype)
    rng = np.random.default_rng(10)
    k = random_values(rng, (4, pool.head_num, pool.head_dim))
    v = random_values(rng, (4, pool.head_num, pool.v_head_dim))
    loc = np.array([1, 2, 3, 4])
    new = pool.set_kv(0, loc, k, v, k_scale=scale, v_scale=2.5)
    k_ref = encode_ref(k, pool_dtype, np.float32(scale))
    testing.assert_bits_equal(host(new.k_buffer[0])[loc], k_ref)
    testing.assert_bits_equal(host(new.v_buffer[0])[loc], encode_ref(v, pool_dtype, 2.5))


def test_scale_divides_exactly_in_float32():
    pool = make_pool("konly", jnp.float32)
    x = np.array([3.0, 1.0, 2315.873, -6.8436863e15, 7.0, 0.1], np.float32)
    k = np.broadcast_to(x[:, None, None], (6, pool.head_num, pool.head_dim))
    # float64 input needs converting, so it is divided (in float32) before the cast.
    new = pool.set_k(0, np.arange(6), k.astype(np.float64), k_scale=0.37)
    got = host(new.get_key_buffer(0))[:6, 0, 0]
    testing.assert_bits_equal(got, x / np.float32(0.37))  # IEEE quotient, not x * (1 / 0.37)
    new = new.set_k(0, np.array([0]), np.full((1, 2, 4), 3.0), k_scale=2.0)
    assert float(new.get_key_buffer(0)[0, 0, 0]) == 1.5


@pytest.mark.parametrize("kind", ["mha", "konly", "mla"])
def test_scale_is_ignored_for_values_already_in_the_pool_dtype(kind, pool_dtype):
    # SGLang divides by the scale only when it converts a value to the pool dtype: values in
    # the pool dtype, or raw bits in its store dtype, are stored as they are.
    pool = make_pool(kind, pool_dtype)
    row = key_row_shape(pool)
    x = random_values(np.random.default_rng(12), (3, *row)).astype(np.float32)
    same = jnp.asarray(x).astype(pool_dtype)
    loc = np.array([1, 2, 3])
    new = pool.set_k(0, loc, same, k_scale=0.37, donate=False)
    buf = "kv_buffer" if kind == "mla" else "k_buffer"
    want = host(same).view(pool.store_dtype)
    testing.assert_bits_equal(host(getattr(new, buf)[0])[loc], want)
    new = pool.set_k(0, loc, want, k_scale=0.37)  # raw bits
    testing.assert_bits_equal(host(getattr(new, buf)[0])[loc], want)


@pytest.mark.parametrize("kind", LATENT_KINDS)
def test_latent_set_kv_applies_k_scale(kind, pool_dtype):
    """Where SGLang applies it: packed fp8 NSA rows carry a scale per tile and take no other."""
    pool = make_pool(kind, pool_dtype)
    k = random_values(np.random.default_rng(11), (2, *key_row_shape(pool)))
    new = pool.set_kv(0, np.array([1, 2]), k, None, k_scale=0.25, v_scale=1e-9)
    testing.assert_bits_equal(host(new.kv_buffer[0])[1:3], latent_rows_ref(pool, k, 0.25))


@pytest.mark.parametrize(
    "pool_dtype, value, stored",
    [
        (jnp.dtype(jnp.float8_e4m3fn), 1000.0, 448.0),
        (jnp.dtype(jnp.float8_e4m3fn), -1000.0, -448.0),
        (jnp.dtype(jnp.float8_e4m3fn), 464.0, 448.0),  # rounds past max: must not become NaN
        (jnp.dtype(jnp.float8_e4m3fn), 3.0e38, 448.0),
        (jnp.dtype(jnp.float8_e5m2), 1e6, 57344.0),
        (jnp.dtype(jnp.float8_e5m2), -1e6, -57344.0),
        (jnp.dtype(jnp.float8_e5m2), 61440.0, 57344.0),  # rounds past max: must not become inf
        (jnp.dtype(jnp.float8_e5m2), -3.0e38, -57344.0),
        (jnp.dtype(jnp.float8_e4m3fn), 1e300, 448.0),  # finite float64, inf once in float32
        (jnp.dtype(jnp.float8_e5m2), -1e300, -57344.0),
    ],
    ids=lambda x: str(x),
)
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_fp8_casts_saturate(pool_dtype, value, stored):
    pool = make_pool("mha", pool_dtype)
    in_dtype = np.float64 if abs(value) > 3.4e38 else np.float32
    k = np.full((1, pool.head_num, pool.head_dim), value, in_dtype)
    v = np.full((1, pool.head_num, pool.v_head_dim), value, in_dtype)
    new = pool.set_kv(0, np.array([3]), k, v)
    for read in (new.get_key_buffer(0), new.get_value_buffer(0)):
        np.testing.assert_array_equal(host(read)[3].astype(np.float32), stored)


@pytest.mark.parametrize("pool_dtype", FP8, ids=lambda d: d.name)
@pytest.mark.parametrize("scale", [None, 1e-30], ids=["unscaled", "scaled"])
def test_fp8_never_turns_finite_input_into_nan_or_inf(pool_dtype, pool_kind, scale):
    pool = make_pool(pool_kind, pool_dtype)
    rng = np.random.default_rng(12)
    f32 = np.finfo(np.float32)
    loc = np.arange(rows_of(pool))
    # Every magnitude from float32's smallest subnormal to its max, both signs.
    mags = np.geomspace(float(f32.smallest_subnormal), float(f32.max), 64).astype(np.float32)
    shape = (len(loc), *key_row_shape(pool))
    x = rng.choice(mags, shape) * rng.choice(np.float32([-1, 1]), shape)
    if pool_kind == "mha":
        pool = pool.set_kv(0, loc, x, x[..., : pool.v_head_dim], k_scale=scale, v_scale=scale)
    else:
        pool = pool.set_k(0, loc, x, k_scale=scale)
    if pool_kind in LATENT_KINDS and scale is None:
        r = pool.kv_lora_rank
        pool = pool.set_mla_kv(1, loc, x[..., :r], x[..., r:])
    for layer in range(pool.layer_num):
        for name in row_buffer_names(pool_kind):
            bits = host(getattr(pool, name)[layer])
            if is_packed(pool):  # codes, scales and rope all finite: so is what reads return
                stored = latent_read_ref(pool, bits)
                np.testing.assert_array_equal(host(pool.get_key_buffer(layer)), stored)
            else:
                stored = decode_ref(bits, pool_dtype)
            assert np.all(np.isfinite(stored)), (name, layer)


# ---- loc: dropping, bounds checks ------------------------------------------------------------


def _prefilled(kind, dtype=jnp.bfloat16):
    """A pool whose every row of every layer holds distinct data."""
    pool = make_pool(kind, dtype)
    rng = np.random.default_rng(13)
    every = np.arange(rows_of(pool))
    for layer in range(pool.layer_num):
        pool = fill_all(pool, kind, layer, every, rng)
    return pool


_BAD_LOCS = {
    "minus-one": lambda rows: np.array([-1]),
    "rows": lambda rows: np.array([rows]),
    "far-negative": lambda rows: np.array([-rows, -(2**40)]),
    "int64-wrap-to-5": lambda rows: np.array([2**32 + 5, 2**33 + 5], np.int64),
    "int32-max": lambda rows: np.array([2**31 - 1, -(2**31)], np.int32),
    "uint32-max": lambda rows: np.array([2**32 - 1, 2**32 - 5], np.uint32),
    "uint64-huge": lambda rows: np.array([2**64 - 1, 2**63 + 5], np.uint64),
    "jax-int32": lambda rows: jnp.array([-1, rows, 2**31 - 1, -(2**31)], jnp.int32),
    "int16": lambda rows: np.array([-1, rows + 3], np.int16),
}


@pytest.mark.parametrize("bad", list(_BAD_LOCS))
def test_out_of_range_loc_is_dropped_and_touches_nothing(pool_kind, bad):
    pool = _prefilled(pool_kind)
    loc = _BAD_LOCS[bad](rows_of(pool))
    before = testing.buffer_bits(pool)
    new = fill_all(pool, pool_kind, 1, loc, np.random.default_rng(14))
    testing.assert_unchanged(before, new)


def test_minus_one_and_wrapping_slots_leave_their_rows_alone_among_valid_ones(pool_kind):
    pool = _prefilled(pool_kind, jnp.float32)
    rows = rows_of(pool)
    loc = np.array([3, -1, 2**32 + 5, rows, 7, -rows + 5], np.int64)
    valid = np.array([True, False, False, False, True, False])
    before = snapshot(pool, pool_kind)
    new = fill_all(pool, pool_kind, 0, loc, np.random.default_rng(15))
    after = snapshot(new, pool_kind)
    for name in row_buffer_names(pool_kind):
        changed = np.flatnonzero(np.any(after[name][0] != before[name][0], axis=(1, 2)))
        np.testing.assert_array_equal(changed, loc[valid])
        np.testing.assert_array_equal(after[name][0][rows - 1], before[name][0][rows - 1])
        np.testing.assert_array_equal(after[name][0][5], before[name][0][5])
    if pool_kind == "nsa":  # pages of slots 3 and 7 (0 and 1) changed, the last page did not
        b, a = before["index_k_with_scale_buffer"][0], after["index_k_with_scale_buffer"][0]
        assert np.any(a[0] != b[0]) and np.any(a[1] != b[1])
        np.testing.assert_array_equal(a[-1], b[-1])


@pytest.mark.parametrize("bad_first", ["minus-one", "past-end", "int64-huge"])
def test_check_bounds_raises_naming_the_first_bad_entry(pool_kind, bad_first):
    pool = make_pool(pool_kind)
    rows = rows_of(pool)
    bad = {"minus-one": -1, "past-end": rows + 1, "int64-huge": 2**32 + 5}[bad_first]
    loc = np.array([1, 2, bad, rows + 1000, 3], np.int64)
    before = testing.buffer_bits(pool)
    for name in SETTERS[pool_kind]:
        with pytest.raises(IndexError) as err:
            call_setter(pool, name, 0, loc, np.random.default_rng(0), check_bounds=True)
        msg = str(err.value)
        assert str(bad) in msg, msg
        assert str(rows + 1000) not in msg, msg
    testing.assert_unchanged(before, pool)  # not donated


def test_check_bounds_accepts_valid_loc(pool_kind):
    pool = make_pool(pool_kind, jnp.float32)
    loc = np.array([0, rows_of(pool) - 1])
    new = fill_all(pool, pool_kind, 0, loc, np.random.default_rng(0), check_bounds=True)
    for name in row_buffer_names(pool_kind):
        buf = host(getattr(new, name)[0])
        assert np.any(buf[loc[0]]) and np.any(buf[loc[1]]), name


# ---- shape errors ----------------------------------------------------------------------------


def _shape_cases(pool, kind):
    """(description, call, argument name, expected shape, actual shape) for each bad shape."""
    t, loc, f = 3, np.array([1, 2, 3]), np.zeros
    key = (t, *key_row_shape(pool))
    wide_key = (*key[:-1], key[-1] + 2)
    cases = [
        ("set_k-dim", lambda: pool.set_k(0, loc, f(wide_key)), "cache_k", key, wide_key),
        ("set_k-rank", lambda: pool.set_k(0, loc, f(key[:2])), "cache_k", key, key[:2]),
        (
            "set_k-tokens",
            lambda: pool.set_k(0, loc, f((2, *key[1:]))),
            "cache_k",
            key,
            (2, *key[1:]),
        ),
    ]
    if kind == "mha":
        v = (t, pool.head_num, pool.v_head_dim)
        v_as_k = (t, pool.head_num, pool.head_dim)  # head_dim where v_head_dim belongs
        cases += [
            ("k-dim", lambda: pool.set_kv(0, loc, f(wide_key), f(v)), "cache_k", key, wide_key),
            ("v-dim", lambda: pool.set_kv(0, loc, f(key), f(v_as_k)), "cache_v", v, v_as_k),
            ("v-rank", lambda: pool.set_kv(0, loc, f(key), f(v[:2])), "cache_v", v, v[:2]),
        ]
    if kind in LATENT_KINDS:
        nope, rope = (t, 1, pool.kv_lora_rank), (t, 1, pool.qk_rope_head_dim)
        flat_nope = (t, pool.kv_lora_rank)
        cases += [
            (
                "set_kv-dim",
                lambda: pool.set_kv(0, loc, f(wide_key), None),
                "cache_k",
                key,
                wide_key,
            ),
            ("nope-dim", lambda: pool.set_mla_kv(0, loc, f(rope), f(rope)), "k_nope", nope, rope),
            ("rope-dim", lambda: pool.set_mla_kv(0, loc, f(nope), f(nope)), "k_rope", rope, nope),
            (
                "nope-rank",
                lambda: pool.set_mla_kv(0, loc, f(flat_nope), f(rope)),
                "k_nope",
                nope,
                flat_nope,
            ),
        ]
    if kind == "nsa":
        index = (t, pool.index_head_dim)
        wide, deep = (t, 2 * pool.index_head_dim), (t, 1, pool.index_head_dim)
        cases += [
            ("index-dim", lambda: pool.set_index_k(0, loc, f(wide)), "index_k", index, wide),
            ("index-rank", lambda: pool.set_index_k(0, loc, f(deep)), "index_k", index, deep),
        ]
    return cases


def test_wrong_value_shapes_raise_value_error_naming_argument_and_shapes(pool_kind):
    pool = make_pool(pool_kind)
    before = testing.buffer_bits(pool)
    for desc, call, arg, expected, actual in _shape_cases(pool, pool_kind):
        with pytest.raises(ValueError) as err:
            call()
        msg = str(err.value)
        assert arg in msg, (desc, msg)
        assert str(tuple(expected)) in msg, (desc, msg)
        assert str(tuple(actual)) in msg, (desc, msg)
    testing.assert_unchanged(before, pool)  # nothing written


@pytest.mark.parametrize("shape", [(2, 1), (1, 2)])
def test_loc_of_wrong_rank_raises_value_error(pool_kind, shape):
    pool = make_pool(pool_kind)
    loc = np.ones(shape, np.int32)
    for name in SETTERS[pool_kind]:
        with pytest.raises(ValueError, match="loc") as err:
            call_setter(pool, name, 0, loc, np.random.default_rng(0))
        assert str(shape) in str(err.value), name


# ---- purity, donation, sharding ----------------------------------------------------------------


def test_updates_never_mutate_their_inputs(pool_kind):
    # fp8 with scales: the path that divides and clips (SGLang divides the caller's tensor).
    pool = make_pool(pool_kind, jnp.float8_e4m3fn)
    rng = np.random.default_rng(16)
    loc = np.array([2**32 + 5, 1, -1, 4], np.int64)
    loc_copy = loc.copy()
    for name in SETTERS[pool_kind]:
        scales = {"k_scale": 0.5} if name in ("set_k", "set_kv") else {}
        if name == "set_kv" and pool_kind == "mha":
            scales["v_scale"] = 4.0
        args = setter_args(pool, name, len(loc), rng)
        kept = [None if a is None else a.copy() for a in args]
        pool = getattr(pool, name)(0, loc, *args, **scales)
        for a, b in zip(args, kept, strict=True):
            np.testing.assert_array_equal(a, b)
        jax_args = [None if a is None else jnp.asarray(a)[1:] for a in args]
        pool = getattr(pool, name)(0, jnp.asarray(loc_copy[1:]), *jax_args, **scales)
        for a, b in zip(jax_args, kept, strict=True):
            if a is not None:
                assert not a.is_deleted(), f"{name} donated a value argument"
                np.testing.assert_array_equal(host(a), b[1:])
    np.testing.assert_array_equal(loc, loc_copy)


def test_donate_true_donates_only_the_replaced_layer_buffers(pool_setter):
    pool_kind, setter_name = pool_setter
    written = SETTERS[pool_kind][setter_name]
    old = _prefilled(pool_kind)
    keep = snapshot(old, pool_kind)
    new = call_setter(old, setter_name, 1, np.array([3, 5]), np.random.default_rng(17))
    for name in buffer_names(pool_kind):
        for li in range(old.layer_num):
            buf = getattr(old, name)[li]
            if name in written and li == 1:
                assert buf.is_deleted()
            else:
                np.testing.assert_array_equal(testing.raw_bits(buf), keep[name][li])
    readers = {
        "k_buffer": [lambda p: p.get_key_buffer(1)],
        "v_buffer": [lambda p: p.get_value_buffer(1), lambda p: p.get_kv_buffer(1)],
        "kv_buffer": [
            lambda p: p.get_key_buffer(1),
            lambda p: p.get_value_buffer(1),
            lambda p: p.get_kv_buffer(1),
            lambda p: p.get_mla_kv(1, np.array([3])),
        ],
        "index_k_with_scale_buffer": [lambda p: p.get_index_k(1, np.array([3]))],
    }
    for name in written:
        for read in readers[name]:
            with pytest.raises(jaxkv.ConsumedPoolError):
                read(old)
            jax.block_until_ready(read(new))  # the new pool owns the buffer
    # The old pool is spent as a whole: its other layers (shared with the new pool, alive and
    # unchanged above) are refused too, so no stray update can donate what the new pool holds.
    with pytest.raises(jaxkv.ConsumedPoolError, match="consumed by an earlier update"):
        old.get_key_buffer(0)
    key = row_buffer_names(pool_kind)[0]
    np.testing.assert_array_equal(testing.raw_bits(new.get_key_buffer(0)), keep[key][0])


def test_donate_false_keeps_the_old_pool_valid(pool_kind):
    old = _prefilled(pool_kind)
    kept = testing.buffer_bits(old)
    keep = snapshot(old, pool_kind)
    new = fill_all(old, pool_kind, 1, np.array([3, 5]), np.random.default_rng(18), donate=False)
    testing.assert_unchanged(kept, old)
    changed = snapshot(new, pool_kind)
    for name in buffer_names(pool_kind):
        assert not np.array_equal(changed[name][1], keep[name][1]), name
        np.testing.assert_array_equal(changed[name][0], keep[name][0])


def test_results_keep_type_shapes_and_dtypes(pool_kind):
    pool = make_pool(pool_kind, jnp.float16)
    ref = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), pool)
    for name in SETTERS[pool_kind]:
        for donate in (True, False):
            rng = np.random.default_rng(0)
            new = call_setter(pool, name, 0, np.array([1, 2]), rng, donate=donate)
            assert type(new) is type(pool)
            assert jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(pool)
            chex.assert_trees_all_equal_shapes_and_dtypes(new, ref)
            pool = new


def test_sharding_places_every_buffer_and_updates_keep_it(pool_kind, device_sharding):
    pool = make_pool(pool_kind, jnp.float8_e4m3fn, sharding=device_sharding)
    for leaf in jax.tree_util.tree_leaves(pool):
        assert leaf.sharding == device_sharding
    for name in SETTERS[pool_kind]:
        pool = call_setter(pool, name, 1, np.array([2, 3]), np.random.default_rng(0))
        for leaf in jax.tree_util.tree_leaves(pool):
            assert leaf.sharding == device_sharding, name
    step = jax.jit(
        lambda p, loc: p.set_k(1, loc, jnp.ones((2, *key_row_shape(p)))), donate_argnums=0
    )
    pool = step(pool, jnp.array([4, 5]))
    for leaf in jax.tree_util.tree_leaves(pool):
        assert leaf.sharding == device_sharding


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_a_slot_repeated_in_one_call_gets_one_of_its_tokens_and_touches_no_other_row(kind):
    # Scatters declare distinct slots; a caller that repeats one gets, per element, the value of
    # one of the tokens written there (which one is the backend's choice), and nothing else moves.
    pool = make_pool(kind, jnp.float32)
    row = key_row_shape(pool)
    rng = np.random.default_rng(21)
    x = random_values(rng, (4, *row))
    new = pool.set_k(0, np.array([3, 5, 3, 3]), x)
    buf = host(new.get_key_buffer(0))
    assert np.all((buf[3] == x[0]) | (buf[3] == x[2]) | (buf[3] == x[3]))
    np.testing.assert_array_equal(buf[5], x[1])
    others = np.delete(buf, [3, 5], axis=0)
    assert not np.any(others)
