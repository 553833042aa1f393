"""pytest plugin (`-p ci_no_skips`): under CI, a skipped test fails the run.

The sglang-jax step runs sglang-jax's own tests, which skip themselves when their setup is
missing (no devices); in CI such a skip hides a broken environment, so it is a failure there.
Expected failures (xfail) are not skips. CI is on when the `CI` environment variable is set to
anything but "", "0", "false" or "no".
"""

from __future__ import annotations

import os

_skipped: list[str] = []


def _ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        _skipped.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    if _ci() and _skipped and exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
    if _ci() and _skipped:
        terminalreporter.write_line(
            f"CI: {len(_skipped)} test(s) skipped, which fails the run under CI: "
            + ", ".join(_skipped[:10])
            + (" ..." if len(_skipped) > 10 else ""),
            red=True,
        )
