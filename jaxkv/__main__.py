"""Command line: `python -m jaxkv demo` and `python -m jaxkv bench`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="serve a small decoder through jaxkv pools, with and without prefix reuse",
    )
    demo.add_argument("--attention", choices=("gqa", "mla"), default="gqa",
                      help="grouped-query attention over an MHAPool, or latent attention "
                      "over an MLAPool (default gqa)")  # fmt: skip
    demo.add_argument("--store", choices=("host", "disk"), default="host",
                      help="where reused prefix blocks live (default host)")  # fmt: skip
    demo.add_argument("--requests", type=int, default=8, metavar="N",
                      help="requests sharing the system prompt (default 8)")  # fmt: skip
    demo.add_argument("--new-tokens", type=int, default=32, metavar="N",
                      help="tokens generated per request (default 32)")  # fmt: skip
    demo.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16",
                      help="the pool's dtype (default bf16)")  # fmt: skip
    demo.add_argument("--cache-dir", metavar="PATH",
                      help="with --store disk: keep the blocks here (a later run reuses "
                      "them); default: a temporary folder removed at exit")  # fmt: skip
    bench = sub.add_parser("bench", help="side-by-side benchmarks against numpy, memcpy, naive JAX")
    bench.add_argument("--quick", action="store_true",
                       help="fewer configurations and rounds at the full sizes (pools up to "
                       "1M tokens, 4 GiB each): a few minutes and about 21 GB of memory on "
                       "2 cores")  # fmt: skip
    bench.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    bench.add_argument("--plot", metavar="PATH", help="PNG of update time vs pool size")
    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.requests < 1 or args.new_tokens < 1:
            parser.error("--requests and --new-tokens must be at least 1")
        from jaxkv import demo as demo_mod

        return demo_mod.run(
            attention=args.attention,
            store=args.store,
            requests=args.requests,
            new_tokens=args.new_tokens,
            dtype=args.dtype,
            cache_dir=args.cache_dir,
        )
    from jaxkv import bench as bench_mod

    return bench_mod.run(quick=args.quick, json_path=args.json, plot_path=args.plot)


if __name__ == "__main__":
    sys.exit(main())
