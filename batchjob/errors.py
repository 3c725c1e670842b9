"""One family of exceptions for what the user or the world controls.

Our own invariants use ``assert``; everything a user can cause (a bad option, a missing file, a corrupt
checkpoint, a model that is not there) raises a ``BatchjobError`` whose message names the value, path or id.
The CLI turns these into a message and an exit code, never a traceback.
"""

from __future__ import annotations


class BatchjobError(Exception):
    """Base class: a problem the user can fix. ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class ConfigError(BatchjobError, ValueError):
    """A bad option, job file or parameter value."""

    exit_code = 2


class ModelNotFoundError(BatchjobError):
    """The model (or the embedded default model) cannot be found or loaded."""

    exit_code = 2


class InputError(BatchjobError):
    """An input path that does not exist, or a dataset without the columns the job needs."""

    exit_code = 2


class StateError(BatchjobError):
    """The job's saved state is corrupt, torn, or belongs to a different job."""

    exit_code = 1


class RankError(BatchjobError):
    """A tensor-parallel rank died or stopped answering: the step cannot finish; the job stops (resumable)."""

    exit_code = 1
