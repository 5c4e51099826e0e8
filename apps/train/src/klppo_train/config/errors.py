"""The run's user errors: one line, exit 2, no traceback (``--debug`` shows it).

A config value, a recipe or data file, a data row, a reward, or a token budget that cannot
fit is the user's to fix; :class:`UserError` carries its one line to ``main``. Anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pyarrow as pa
import yaml
from omegaconf.errors import OmegaConfBaseException

# What a user can get wrong before any model loads; anything else is a bug (a traceback).
USER_ERRORS = (ValueError, OSError, pa.ArrowException, yaml.YAMLError, OmegaConfBaseException)


class UserError(Exception):
    """A config, recipe, data, row or reward error: one line, exit 2, no traceback."""


@contextmanager
def user_errors(prefix: str = "") -> Iterator[None]:
    """Turn the errors a user causes into one :class:`UserError` line."""
    try:
        yield
    except USER_ERRORS as err:
        raise UserError(prefix + " ".join(str(err).split())) from err
