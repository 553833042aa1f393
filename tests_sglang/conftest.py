"""jaxkv against SGLang's own classes (sglang 0.5.23, torch on the CPU).

Run with `python -m pytest tests_sglang` in an environment that has torch and sglang (see
BUILD_NOTES.md, "Comparing with SGLang"). A missing package fails the run; nothing here skips.

SGLang's pool setters launch Triton kernels; Triton's interpreter (TRITON_INTERPRET=1, set
before anything imports triton) runs them on the CPU with numpy. Its allocators take their
torch-native CPU path by themselves (the CPU platform does not support Triton launches).

One repair to the interpreter, not to SGLang: Triton 3.8's interpreter narrows floats by
cutting bits (float32 -> bfloat16 truncates; -> float8 rounds half up without carrying into
the exponent, so 7.79 becomes 4.0, and subnormals truncate). A GPU rounds to nearest even. The
interpreter's float conversion is replaced by an exact one (numpy and ml_dtypes casts, round to
nearest even) so SGLang's kernels compute here what they compute on a GPU;
test_sglang_setters.py checks the repaired conversion against torch's casts.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before SGLang's modules decorate their Triton kernels

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import triton.language as tl  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

_NP_FLOATS = {
    tl.float32: np.dtype(np.float32),
    tl.float16: np.dtype(np.float16),
    tl.bfloat16: np.dtype(ml_dtypes.bfloat16),
    tl.float8e4nv: np.dtype(ml_dtypes.float8_e4m3fn),
    tl.float8e5: np.dtype(ml_dtypes.float8_e5m2),
}
_interpreter_convert = interpreter._convert_float


def _convert_float_exactly(input, input_dtype, output_dtype, rounding_mode):
    """The interpreter's float conversion, rounded to nearest even as a GPU does; other
    formats, and conversions asking for round-toward-zero, keep the interpreter's own."""
    src, dst = _NP_FLOATS.get(input_dtype), _NP_FLOATS.get(output_dtype)
    if src is None or dst is None or rounding_mode == interpreter._ir.ROUNDING_MODE.RTZ:
        return _interpreter_convert(input, input_dtype, output_dtype, rounding_mode)
    values = np.frombuffer(np.ascontiguousarray(input).tobytes(), src).astype(np.float32)
    out = values.astype(dst).view(f"uint{8 * dst.itemsize}")
    return out.reshape(input.shape)


interpreter._convert_float = _convert_float_exactly


@pytest.fixture(scope="session", autouse=True)
def single_rank():
    """A single-rank deployment without decode context parallelism (what one SGLang server
    on one device publishes); MLA/DSA pools read these widths."""
    with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False):
        yield
