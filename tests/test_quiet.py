"""models.quiet.quiet_transformers: ERROR inside the block, the caller's verbosity back after, also on an error."""

import pytest
from transformers.utils import logging

from models.quiet import quiet_transformers


def test_verbosity_is_error_inside_and_restored_after_an_exception():
    before = logging.get_verbosity()
    logging.set_verbosity_info()
    try:
        with pytest.raises(RuntimeError, match="load failed"):
            with quiet_transformers():
                assert logging.get_verbosity() == logging.ERROR
                raise RuntimeError("load failed")
        assert logging.get_verbosity() == logging.INFO
        with quiet_transformers(quiet=False):
            assert logging.get_verbosity() == logging.INFO
    finally:
        logging.set_verbosity(before)
