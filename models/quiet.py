"""Quieting transformers' logging around a load whose warnings are expected (a cut model's dropped layers reported
as unexpected keys; a draft's shared tensors, attached from its target afterwards, reported as newly initialised)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_transformers(quiet: bool = True) -> Iterator[None]:
    """transformers' logging at ERROR inside the block (quiet=False: left as it is); the previous verbosity comes
    back on exit, also on an exception."""
    from transformers.utils import logging  # transformers loads only when a model does

    before = logging.get_verbosity()
    if quiet:
        logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(before)
