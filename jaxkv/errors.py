"""Exceptions of the public API."""


class UnsupportedKVCacheError(AttributeError):
    """A pool object exposes none of the buffer layouts the connector understands.

    It subclasses `AttributeError` so code written against SGLang's FlexKV connector, which
    raises a plain `AttributeError`, keeps catching it.
    """


class ConsumedPoolError(RuntimeError):
    """A pool was read or updated after an eager update (or a connector load) consumed it.

    An eager update with `donate=True` hands the pool's buffers to the pool it returns, so the
    old pool object is spent: every later read or update through it raises this, whatever its
    dtype and whether or not XLA could actually reuse the memory. It subclasses `RuntimeError`,
    which is what reading a donated buffer raised before.
    """


class CopyWarning(UserWarning):
    """An eager donating update could not reuse a buffer and copied it whole (O(pool)).

    XLA cannot donate a buffer while something else holds its memory: a numpy view
    (`np.asarray(pool.k_buffer[0])`), a DLPack export, or another live reference outside JAX.
    The update is still correct (the returned pool has the new values and the old pool is
    consumed all the same), but it cost a full copy of the buffer. Release the view, or copy
    what you need out of it, before updating.
    """


class StoreReplyError(OSError):
    """A block store answered a call with something that is not an answer: a result of the
    wrong type or length, or an exception that is not an I/O error.

    The connector treats it as the store failing (counted in `io_errors`, a miss or a dropped
    write) and raises it only when strict. It subclasses `OSError`, the class of every store
    failure a strict caller catches.
    """
