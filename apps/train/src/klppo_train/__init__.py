"""klppo-train: the PPO app that composes the klppo packages under one run loop."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

try:
    __version__ = _version("klppo-train")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
