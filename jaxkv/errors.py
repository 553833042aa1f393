"""Exceptions of the public API."""


class UnsupportedKVCacheError(AttributeError):
    """A pool object exposes none of the buffer layouts the connector understands.

    It subclasses `AttributeError` so code written against SGLang's FlexKV connector, which
    raises a plain `AttributeError`, keeps catching it.
    """
