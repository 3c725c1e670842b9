"""Reading rows in and writing results out: files, formats and atomic file changes; nothing about models."""

from batchjob.io.readers import Row, iter_rows
from batchjob.io.sources import Source, discover
from batchjob.io.writers import RESULT_FIELDS, PartWriter

__all__ = ["RESULT_FIELDS", "PartWriter", "Row", "Source", "discover", "iter_rows"]
