"""Whether an input file stayed put while it was read: its stamp (size, time stamp, inode) when reading starts,
compared with the stamp when reading ends.

A file truncated in place (logrotate's ``copytruncate``), appended to, rewritten, replaced or removed under a
running job has changed: the rows the reader happened to see are not the file's rows. The reader then stops
the job, naming the file and what changed, instead of taking what it saw for the whole file. (What happens to
a file between runs is ``batchjob.job.inputs``' business; a remote file or a saved dataset folder has no
stamp here.)
"""

from __future__ import annotations

import os

from batchjob.errors import InputError
from batchjob.io.sources import Source

Stamp = tuple[int, int, int]  # (size in bytes, mtime_ns, inode)


class InputChangedWhileReadError(InputError):
    """An input file changed while the job read it (exit 2: the job stops, what it committed is kept)."""


def stamp(source: Source) -> Stamp | None:
    """A local input file's stamp now; None for what has none (remote, a folder, a file that is not there:
    the reader makes an error row of that one)."""
    if source.remote or source.kind == "hf":
        return None
    try:
        st = os.stat(source.path.removeprefix("file://"))
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino


def _what_changed(before: Stamp, now: Stamp | None) -> str | None:
    if now is None:
        return "was removed"
    if now[2] != before[2]:
        return "was replaced by another file"
    if now[0] < before[0]:
        return (
            f"shrank from {before[0]} to {now[0]} bytes (truncated in place, as logrotate's copytruncate "
            "does?)"
        )
    if now[0] > before[0]:
        return f"grew from {before[0]} to {now[0]} bytes (is something still writing to it?)"
    if now[1] != before[1]:
        return "was modified (its time stamp changed)"
    return None


def check_unchanged(source: Source, before: Stamp | None) -> None:
    """Raise InputChangedWhileReadError when ``source`` is not as it was at ``before`` (its stamp when the
    reader opened it); nothing when it had no stamp."""
    if before is None:
        return
    what = _what_changed(before, stamp(source))
    if what is None:
        return
    if what.startswith("grew"):
        go_on = (
            "Once nothing writes to it any more, run the same command with --append: what is done is kept "
            "and the new rows are processed"
        )
    else:
        go_on = (
            "Restore the file the job started with and run the same command to resume, or run the new data "
            "into a new --output"
        )
    raise InputChangedWhileReadError(
        f"input {source.path} {what} while it was being read, so the rows read may not be the file's: "
        f"stopped before anything was marked complete (rows already committed are kept). {go_on}"
    )
