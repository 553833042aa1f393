"""The `create` arguments every pool kind takes, defined once: `CreateArgs` (what type
checkers see), `common_create` (the full signature `help` shows, and the checks Python would
make), and `check_create` (a kind's `create` names exactly its static fields)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias, TypedDict, TypeVar, cast

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

if TYPE_CHECKING:  # typing's own from 3.11 on; annotations only (never evaluated)
    from typing_extensions import NotRequired, Required

# Where a pool's buffers are placed: `create`'s `sharding`.
Placement: TypeAlias = jax.sharding.Sharding | jax.Device | None


F = TypeVar("F", bound=Callable[..., Any])


class CreateArgs(TypedDict):
    """The `create` arguments every pool kind takes, the one definition of them (a kind's
    `create` names only its own sizes, and takes these as `**common: Unpack[CreateArgs]`;
    `common_create` gives it the full signature `help` shows).

    Keys:
        size: usable token slots (rows `1..size`; the pool holds `size + page_size` rows).
        page_size: tokens per page (default: the kind's, see `common_create`).
        dtype: the KV dtype (default bfloat16).
        layer_num: layers the pool holds.
        start_layer: the first model layer it holds (default 0).
        sharding: where the buffers are placed (default: the default device).
    """

    size: Required[int]
    page_size: NotRequired[int]
    dtype: NotRequired[DTypeLike]
    layer_num: Required[int]
    start_layer: NotRequired[int]
    sharding: NotRequired[Placement]


# The `create` arguments every pool kind takes; the others are the kind's own sizes.
COMMON_ARGS = tuple(CreateArgs.__annotations__)
_COMMON_DEFAULTS = {"dtype": jnp.bfloat16, "start_layer": 0, "sharding": None}


def common_create(*, page_size: int) -> Callable[[F], F]:
    """Makes a kind's `create(cls, *, <its sizes>, **common: Unpack[CreateArgs])` take the
    common arguments as if it listed them: its signature (what `help` and `inspect` show) is
    `size, page_size, dtype`, the kind's required sizes, `layer_num`, its sizes with defaults,
    `start_layer, sharding`; a call missing a required one, or naming one no kind takes,
    raises `TypeError` as Python would. `page_size` is the kind's default page size."""
    defaults = {**_COMMON_DEFAULTS, "page_size": page_size}

    def wrap(create: F) -> F:
        own = [
            p
            for p in inspect.signature(create).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY
        ]
        first = next(iter(inspect.signature(create).parameters.values()))

        def param(name: str, default=inspect.Parameter.empty) -> inspect.Parameter:
            return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)

        params = [
            first,
            param("size"),
            param("page_size", defaults["page_size"]),
            param("dtype", defaults["dtype"]),
            *[p for p in own if p.default is inspect.Parameter.empty],
            param("layer_num"),
            *[p for p in own if p.default is not inspect.Parameter.empty],
            param("start_layer", defaults["start_layer"]),
            param("sharding", defaults["sharding"]),
        ]
        signature = inspect.Signature(params)
        names = {p.name for p in params[1:]}
        required = [p.name for p in params[1:] if p.name in COMMON_ARGS and p.default is p.empty]

        @functools.wraps(create)
        def checked(cls, **kwargs):
            unknown = sorted(set(kwargs) - names)
            if unknown:
                raise TypeError(f"{cls.__name__}.create() got unexpected arguments {unknown}")
            missing = [n for n in required if n not in kwargs]
            if missing:
                raise TypeError(f"{cls.__name__}.create() missing required arguments {missing}")
            common = {n: kwargs.pop(n, defaults.get(n)) for n in COMMON_ARGS}
            return create(cls, **kwargs, **common)

        checked.__signature__ = signature  # type: ignore[attr-defined]
        return cast(F, checked)

    return wrap


def check_create(cls) -> None:
    """`TypeError` unless `cls.create` takes, keyword-only, exactly fields of `cls`, every
    static field without a default among them: `create` hands its arguments to the fields
    by name, so a size a kind stores and the argument that sets it cannot drift apart."""
    if not callable(getattr(cls, "create", None)):
        raise TypeError(f"{cls.__name__}: a pool kind needs a create classmethod")
    params = inspect.signature(cls.create).parameters
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in cls.BUFFERS}
    needed = {
        n
        for n, f in fields.items()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    unknown = sorted(set(params) - set(fields))
    missing = sorted(needed - set(params))
    positional = sorted(n for n, p in params.items() if p.kind is not p.KEYWORD_ONLY)
    if unknown or missing or positional:
        raise TypeError(
            f"{cls.__name__}.create: expected keyword-only arguments naming its static fields "
            f"(every one without a default), got unknown {unknown}, missing {missing}, "
            f"positional {positional}"
        )
