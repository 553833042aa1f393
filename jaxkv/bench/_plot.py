"""`--plot`: update time against pool size (needs matplotlib, the `bench` extra)."""

from __future__ import annotations


def plot(res: dict, path: str) -> None:
    """Draws jaxkv's eager and jitted MHA bf16 updates of the middle T, and naive JAX's,
    against the pool's size, into the PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cpu = res["machine"]["backend"] == "cpu"
    t = res["sizes"]["tokens" if cpu else "accel_tokens"][1]
    rows = [
        r
        for r in res["updates"]
        if r["kind"] == "mha" and r["dtype"] == "bfloat16" and r["tokens"] == t
    ]
    rows.sort(key=lambda r: r["pool_tokens"])
    x = [r["pool_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, style in (("jaxkv jit", "o-"), ("jaxkv eager", "s-"), ("naive JAX", "x--")):
        points = [(n, r[key] * 1e6) for n, r in zip(x, rows) if r.get(key) is not None]
        ax.plot([n for n, _ in points], [us for _, us in points], style, label=key)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("pool size (tokens)")
    ax.set_ylabel(f"update time, {t} tokens (us)")
    ax.set_title("set_kv: MHA 8x128 bf16, one layer")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
