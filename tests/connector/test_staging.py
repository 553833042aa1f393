"""Processes that use the connector exit cleanly.

Loading through staging that XLA imported from numpy (DLPack) aborted the interpreter at exit in
about one run in six ("terminate called without an active exception"): an XLA worker dropped
the last reference to the numpy memory during shutdown. Several short runs catch a regression.
"""

import pytest
from helpers import REPO, run_python

EXAMPLE = REPO / "examples" / "sglang_shaped_pools.py"


@pytest.mark.slow  # six fresh interpreters
def test_example_with_foreign_pools_exits_cleanly_every_time():
    for _ in range(6):
        proc = run_python(str(EXAMPLE), timeout=120)
        assert proc.stdout.count("bit-exact: True") == 2
        assert "UnsupportedKVCacheError (an AttributeError: True)" in proc.stdout
