"""Adapters that put jaxkv under other serving stacks.

Each adapter lives in its own subpackage and imports its stack only when it is used:
`import jaxkv` never imports any of them.
"""
