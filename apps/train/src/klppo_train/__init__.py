"""klppo-train: the thin PPO app that composes the klppo packages."""

from importlib.metadata import version as _version

__version__ = _version("klppo-train")
