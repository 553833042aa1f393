"""Runs a command, then prints its wall time and peak resident memory; exits with its status.

Usage: python3 .ci/measure.py LABEL SECONDS MEGABYTES -- COMMAND...

Also the CPU seconds of every process it ran (user + system: on a busy machine the wall time
grows, this much less). Two peaks: the largest resident set of any one process
(`getrusage(RUSAGE_CHILDREN)`, what `/usr/bin/time -v` reports as "Maximum resident set
size") and the largest sum over the whole process tree (sampled from /proc every 0.2 s),
which is what the machine must hold when the command runs workers side by side. SECONDS and
MEGABYTES are the bounds, printed beside them.
"""

import os
import resource
import subprocess
import sys
import threading
import time


def _tree_rss_kib(root: int) -> int:
    """Resident KiB of `root` and all its descendants, from /proc (0 where it is gone)."""
    parents: dict[int, int] = {}
    rss: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            parents[int(name)] = int(fields[1])
            rss[int(name)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE") // 1024
        except (OSError, IndexError, ValueError):  # exited while being read
            continue
    tree, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        children = [c for c, p in parents.items() if p == pid and c not in tree]
        tree.update(children)
        frontier.extend(children)
    return sum(rss.get(pid, 0) for pid in tree)


def main(argv: list[str]) -> int:
    if len(argv) < 5 or argv[3] != "--":
        print(__doc__.splitlines()[2], file=sys.stderr)
        return 2
    label, seconds, megabytes, cmd = argv[0], argv[1], argv[2], argv[4:]
    start = time.monotonic()
    proc = subprocess.Popen(cmd)
    peak_tree = [0]
    done = threading.Event()

    def sample():
        while not done.wait(0.2):
            peak_tree[0] = max(peak_tree[0], _tree_rss_kib(proc.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    rc = proc.wait()
    done.set()
    sampler.join()
    took = time.monotonic() - start
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    peak_one = usage.ru_maxrss  # KiB on Linux
    print(
        f"CI: {label} took {took:.0f} s ({usage.ru_utime + usage.ru_stime:.0f} s of CPU), "
        f"peak resident {peak_one / 1024:.0f} MB in one process, "
        f"{peak_tree[0] / 1024:.0f} MB summed over its processes "
        f"(bounds: {seconds} s, {megabytes} MB on a 2-core machine)",
        flush=True,
    )
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
