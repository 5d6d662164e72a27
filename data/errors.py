"""The one error type for user mistakes: a bad command line, config value, input file, checkpoint or model path.

It lives in the lowest layer so that every layer raises the same class (data <- models <- inference <- train <-
tools). The message is the one line the user sees: it names the flag, config key, file or line at fault. Each
package's own kinds (DataError below, data.templates.ChatTemplateError, models.loading.ModelLoadError,
models.checkpoint.CheckpointError, inference.engine.tree.TreeError, ...) subclass it, so a command line catches
`UsageError` once, prints `error: <message>` and exits non-zero before any expensive work. It is a ValueError:
library callers that catch ValueError keep working.
"""

from __future__ import annotations


class UsageError(ValueError):
    """A user mistake; str(error) is the one line to show."""


class DataError(UsageError):
    """Bad input data or an unavailable data source; the message starts with "<file>:<record>:" (or "<file>:" for
    whole-file problems, or the config key at fault). data.readers re-exports it, where callers have found it."""
