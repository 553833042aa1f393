"""A reference consumer of jaxkv: a small decoder served from jaxkv pools.

An example of how a model uses the pools, not a model zoo: a decoder-only transformer in plain
JAX with random weights from a fixed seed and a byte-level tokenizer, in two attention variants
(grouped-query attention over an `MHAPool`, DeepSeek-style latent attention over an `MLAPool`),
and a serving loop with paged slots, a request-to-token table, bucketed jitted steps that
donate the pool, and prefix reuse through `jaxkv.connector`.
"""

from jaxkv.models.decoder import LOGIT_BOUNDS, Decoder, DecoderConfig
from jaxkv.models.serving import Engine, Request, Result
from jaxkv.models.steps import CompiledSteps, bucket, steps_for
from jaxkv.models.tokenizer import ByteTokenizer
from jaxkv.models.weights import params_fingerprint

__all__ = [
    "LOGIT_BOUNDS",
    "ByteTokenizer",
    "CompiledSteps",
    "Decoder",
    "DecoderConfig",
    "Engine",
    "Request",
    "Result",
    "bucket",
    "params_fingerprint",
    "steps_for",
]
