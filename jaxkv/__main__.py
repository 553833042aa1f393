"""Command line: `python -m jaxkv demo` and `python -m jaxkv bench`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="allocate, write, verify and time MHA, MLA and K-only pools")
    bench = sub.add_parser("bench", help="side-by-side benchmarks against numpy, memcpy, naive JAX")
    bench.add_argument("--quick", action="store_true", help="small sizes, under 2 minutes")
    bench.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    bench.add_argument("--plot", metavar="PATH", help="PNG of update time vs pool size")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from jaxkv import demo

        return demo.run()
    from jaxkv import bench as bench_mod

    return bench_mod.run(quick=args.quick, json_path=args.json, plot_path=args.plot)


if __name__ == "__main__":
    sys.exit(main())
