"""The bench's text output: aligned tables, the targets and the misses."""

from __future__ import annotations


def print_table(title: str, rows: list[dict], cols: list[tuple[str, str, str]]) -> None:
    """A titled table: `cols` are `(key, header, format)`; a missing value prints as `-`."""
    widths = [max(len(head), 9) for _, head, _ in cols]
    print(f"\n{title}")
    line = "  ".join(f"{head:>{w}}" for (_, head, _), w in zip(cols, widths))
    print(line)
    print("-" * len(line))
    for r in rows:
        cells = []
        for (key, _, fmt), w in zip(cols, widths):
            v = r.get(key)
            cells.append(f"{'-' if v is None else format(v, fmt):>{w}}")
        print("  ".join(cells))


def scaled(rows: list[dict], keys: tuple[str, ...], factor: float) -> list[dict]:
    """Copies of `rows` with the values at `keys` (where present) multiplied by `factor`
    (seconds to microseconds, say)."""
    return [{**r, **{k: r[k] * factor for k in keys if r.get(k) is not None}} for r in rows]


def _value(t: dict) -> str:
    return "-" if t["value"] is None else f"{t['value']:.2f}"


def print_targets(targets: list[dict]) -> None:
    """Every target: whether it held, its value and its limit."""
    print("\ntargets")
    for t in targets:
        bound = "at least" if t["at_least"] else "limit"
        print(
            f"  [{'ok' if t['ok'] else 'MISS'}] {t['target']}: {_value(t)} ({bound} {t['limit']})"
        )


def print_misses(targets: list[dict]) -> None:
    """What `--check` failed on: each missed target with its measured value and limit."""
    missed = [t for t in targets if not t["ok"]]
    print(f"\n--check: {len(missed)} of {len(targets)} targets missed")
    for t in missed:
        bound = "at least" if t["at_least"] else "at most"
        measured = "not measured" if t["value"] is None else f"measured {_value(t)}"
        print(f"  {t['target']}: {measured}, limit {bound} {t['limit']}")
