"""Generation engines behind one Protocol (arrives with issue 5)."""

from importlib.metadata import version as _version

__version__ = _version("klppo-rollout")
