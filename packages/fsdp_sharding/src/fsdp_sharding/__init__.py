"""FSDP2/FSDP1 wrapping of HF models (arrives with issue 4)."""

from importlib.metadata import version as _version

__version__ = _version("klppo-fsdp-sharding")
