"""A byte-level tokenizer: token ids 0-255 are the bytes of UTF-8 text, then BOS and EOS.

No vocabulary file and no merges, so the reference model runs anywhere; a real model brings
its own tokenizer and only the token ids reach jaxkv.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from jax.typing import ArrayLike


class ByteTokenizer:
    """UTF-8 bytes as token ids, with `bos_id = 256` and `eos_id = 257`.

    Example:
        >>> tok = ByteTokenizer()
        >>> tok.encode("hi").tolist()
        [256, 104, 105]
        >>> tok.decode([256, 104, 105, 257])
        'hi'
    """

    bos_id = 256
    eos_id = 257
    vocab_size = 258

    def encode(self, text: str, *, bos: bool = True) -> np.ndarray:
        """Token ids `(n,)` int32 of `text`, led by BOS unless `bos=False`."""
        ids = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
        return np.concatenate([[self.bos_id], ids]).astype(np.int32) if bos else ids

    def decode(self, ids: ArrayLike | Sequence[int]) -> str:
        """Text of `ids`; BOS and EOS are dropped, invalid UTF-8 becomes U+FFFD.

        Args:
            ids: token ids, any shape (read flat).

        Returns:
            The decoded text.
        """
        ids = np.asarray(ids).reshape(-1)
        data = bytes(int(i) for i in ids if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")
