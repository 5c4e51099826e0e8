"""Token-budget micro-batching and sequence packing (arrives with issue 3)."""

from importlib.metadata import version as _version

__version__ = _version("klppo-batching")
