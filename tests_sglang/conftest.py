"""jaxkv against SGLang's own classes (sglang 0.5.23, torch on the CPU).

Run with `python -m pytest tests_sglang` in an environment that has torch and sglang (see
BUILD_NOTES.md, "Comparing with SGLang"). A missing package fails the run; nothing here skips.

SGLang's pool setters launch Triton kernels; Triton's interpreter (TRITON_INTERPRET=1, set
before anything imports triton) runs them on the CPU with numpy. Its allocators take their
torch-native CPU path by themselves (the CPU platform does not support Triton launches).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before SGLang's modules decorate their Triton kernels

import pytest  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def single_rank():
    """A single-rank deployment without decode context parallelism (what one SGLang server
    on one device publishes); MLA/DSA pools read these widths."""
    with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False):
        yield
