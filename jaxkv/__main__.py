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
    bench = sub.add_parser(
        "bench",
        help="side-by-side benchmarks against numpy, memcpy, naive JAX",
        description="Side-by-side benchmarks against numpy, memcpy and naive JAX, then the "
        "performance targets. The full run holds pools of up to 1M tokens (4 GiB each) and "
        "naive JAX's copies of them: give it about 24 GB of memory.",
    )
    bench.add_argument("--quick", action="store_true",
                       help="smaller pools (16K to 256K tokens) and fewer configurations and "
                       "rounds: under 4 GB of memory and about 2 minutes on 2 cores")  # fmt: skip
    bench.add_argument("--check", action="store_true",
                       help="exit 1 when a performance target is missed, naming each miss "
                       "with its value and limit")  # fmt: skip
    # The remote stores the store-tier section also measures, each skipped without its flag.
    for flag, metavar, what in (
        ("--redis-url", "URL", "the Redis or Valkey server at URL (e.g. "
         "redis://localhost:6379/0)"),
        ("--redis-cluster-url", "URL", "the Redis Cluster at URL (redis+cluster://HOST:PORT)"),
        ("--mooncake", "SPEC", "the Mooncake cluster SPEC names (mooncake://HOST:PORT?"
         "metadata=URL; its segments need room for about 1 GiB), and its store against its "
         "own client"),
    ):  # fmt: skip
        bench.add_argument(flag, metavar=metavar, help=f"also measure {what}; without it "
                           "its rows are skipped")  # fmt: skip
    bench.add_argument("--json", metavar="PATH", dest="json_path",
                       help="write every figure and target as JSON")  # fmt: skip
    bench.add_argument("--plot", metavar="PATH", dest="plot_path",
                       help="PNG of update time vs pool size (needs matplotlib)")  # fmt: skip
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

    options = vars(args)  # each bench option is the `run` argument of its `dest`
    del options["command"]
    return bench_mod.run(**options)


if __name__ == "__main__":
    sys.exit(main())
