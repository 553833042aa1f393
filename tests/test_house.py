"""The shape of the package, checked from its source: every module short enough to read, no
reaching into another package's privates, one place that describes a pool, and a connector
that names no serving stack's classes (those live with the integration that knows them)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "jaxkv"
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_LINES = 600
# sglang-jax's classes: only jaxkv's integration with it may name them.
SGLANG_JAX_CLASSES = (
    "MHATokenToKVPool",
    "MLATokenToKVPool",
    "HostKVPool",
    "UnifiedRadixCache",
)


def _name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def _package(module: str, path: Path) -> str:
    """The package a module belongs to (a package's `__init__` belongs to itself)."""
    return module if path.name == "__init__.py" else module.rsplit(".", 1)[0]


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _docstrings(tree: ast.Module) -> set[int]:
    """The ids of the string constants that are docstrings."""
    ids = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                ids.add(id(value))
    return ids


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _name(p))
def test_every_module_is_at_most_600_lines(path):
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{_name(path)} has {lines} lines, expected at most {MAX_LINES}"


def test_no_module_reads_a_private_attribute_by_name():
    found = []
    for path in MODULES:
        for node in ast.walk(_tree(path)):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "setattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and node.args[1].value.startswith("_")
                and not node.args[1].value.startswith("__")
            ):
                found.append(
                    f"{_name(path)}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})"
                )
    assert not found, found


def test_no_package_imports_another_packages_private_module():
    """A subpackage's private modules (`jaxkv.connector._records`) are its own: other
    packages use its public modules. The root package's private modules (`jaxkv._dtypes`) are
    the shared internals every subpackage builds on."""
    found = []
    for path in MODULES:
        module = _name(path)
        mine = _package(module, path)
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] != "jaxkv" or len(parts) < 3:
                    continue
                for i in range(2, len(parts)):
                    if parts[i].startswith("_") and not parts[i].startswith("__"):
                        owner = _owning_package(parts[:i])
                        if owner != "jaxkv" and mine != owner and not mine.startswith(owner + "."):
                            found.append(f"{module}:{node.lineno} imports {name}")
                        break
    assert not found, found


def _owning_package(parts: list[str]) -> str:
    """The package whose private item `parts + [private]` is: `parts` when it names a
    package, else the package of the module it names."""
    if (PACKAGE.parent.joinpath(*parts) / "__init__.py").exists():
        return ".".join(parts)
    return ".".join(parts[:-1])


def test_one_function_describes_a_pool():
    defined = [
        f"{_name(path)}:{node.lineno}"
        for path in MODULES
        for node in ast.walk(_tree(path))
        if isinstance(node, ast.FunctionDef) and node.name == "describe"
    ]
    assert defined == [f"jaxkv.connector.layout:{_describe_line()}"], defined


def _describe_line() -> int:
    tree = _tree(PACKAGE / "connector" / "layout.py")
    return next(
        n.lineno for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "describe"
    )


def test_the_connector_names_no_sglang_jax_class():
    """Only code counts: the connector's docstrings may say which pools it accepts."""
    found = []
    for path in sorted((PACKAGE / "connector").rglob("*.py")):
        tree = _tree(path)
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docs
            ):
                text = node.value
            elif isinstance(node, ast.Name):
                text = node.id
            elif isinstance(node, ast.Attribute):
                text = node.attr
            else:
                continue
            hits = [c for c in SGLANG_JAX_CLASSES if c in text]
            if hits:
                found.append(f"{_name(path)}:{node.lineno} {hits}")
    assert not found, found
