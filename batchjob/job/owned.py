"""What batchjob writes at a user's word never lands on a job's own files.

``export --to``, ``report --to`` and ``bench --json`` write where they are told (and ``run`` where
``--output`` says: never inside another job's folder, ``check_output``). Told the wrong place, they
would write over a job's result part or its manifest (after which the job can't be resumed), into a job's
output folder (where ``pyarrow.dataset`` would read the file as a result), or over an input of the job, or
into its input folder (where the next ``--append`` would take it in as rows). ``check_target`` refuses all of
these by name, after resolving symbolic links, and is what every such writer calls first.

The other way round, a file the job did not write in its output folder (``foreign_entries``): ``run`` refuses
to start or to say complete over it, and ``status`` names it, as readers of the folder would read it too.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from batchjob.errors import ConfigError, InputError, StateError
from batchjob.io.sources import discover, takes
from batchjob.job.state import STATE_DIR, StateDir


def _job_folder(path: Path) -> Path | None:
    """The batchjob output folder ``path`` is (or is inside), if any."""
    for folder in [path, *path.parents]:
        if (folder / STATE_DIR / "job.json").exists():
            return folder
    return None


def _input_of(real: Path, out_dir: Path) -> str | None:
    """Why writing ``real`` would write over, or add to, the inputs of the job in ``out_dir``."""
    try:
        paths = StateDir(out_dir).load_job().input_paths
    except StateError:
        return None  # the job's own commands say what is wrong with it
    local = [p for p in paths if "://" not in p or p.startswith("file://")]
    try:
        sources = discover(local, exclude=out_dir) if local else []
    except InputError:
        sources = []  # an input gone now: the rule below still applies to the values
    for source in sources:
        where = Path(source.path).resolve()
        if where == real or where in real.parents:
            return f"an input of the job in {out_dir} ({source.path})"
    for value in local:
        if takes(value, real):
            return f"where the job in {out_dir} takes its inputs from (--input {value}): it would become one"
    return None


def check_output(out_dir: Path) -> None:
    """A job's ``--output`` must not lie inside another job's output folder (its results would be read as
    the other's, and its state could land in the other's)."""
    try:
        real = out_dir.expanduser().resolve()
    except (RuntimeError, OSError) as e:
        raise ConfigError(f"--output {out_dir} cannot be resolved ({e}); give another folder") from e
    folder = _job_folder(real.parent)
    if folder is not None:
        raise ConfigError(
            f"--output {out_dir} is inside the batchjob output folder {folder}: its parts would be read as "
            "that job's results; give a folder outside it"
        )


def check_target(target: Path, option: str, jobs: list[Path] = (), allowed: Path | None = None) -> None:
    """Refuse ``target`` (given as ``option``) when it is inside any batchjob output folder (a part, the
    state, or beside them), or an input of one of ``jobs`` (or would become one). ``allowed``: a file of a
    job that is the command's own (``report``'s default page)."""
    try:
        real = target.expanduser().resolve()
    except (RuntimeError, OSError) as e:  # a symbolic link loop
        raise ConfigError(f"{option} {target} cannot be resolved ({e}); give another path") from e
    if allowed is not None and real == allowed.resolve():
        return
    folder = _job_folder(real)
    if folder is not None:
        what = "the state of" if STATE_DIR in real.relative_to(folder).parts else "inside"
        raise ConfigError(
            f"{option} {target} is {what} the batchjob output folder {folder}: writing there would damage "
            "the job's parts or state (or add a file its results would be read with); give a path outside it"
        )
    for out_dir in jobs:
        why = _input_of(real, out_dir.resolve())
        if why is not None:
            raise ConfigError(f"{option} {target} is {why}; give a path outside the job's inputs")


_PART = re.compile(r"part-(\d{5}-of-\d{5}-)?\d{6,}\.parquet")  # a worker's part (rows/columns.py part_prefix)


def foreign_entries(out_dir: Path) -> list[str]:
    """The files and folders in a job's output folder that a reader of the folder would read as results and
    that are not the job's: a Parquet file (by name or by its first bytes) not named as a part, or a folder
    holding one, whose name does not start with ``_`` or ``.`` (``pyarrow.dataset`` skips those; a file that
    is no Parquet, a Slurm log in ``logs/``, makes it fail loudly, so it is the user's to keep there). A copy of a part saved
    as ``out/stray.parquet`` made the folder read 80 rows for a job of 60 while the job said complete. A part
    name the manifest does not list is the run's to remove (``PartWriter.remove_orphans``), not listed here."""
    found = []
    try:
        entries = sorted(os.scandir(out_dir), key=lambda e: e.name)
    except OSError:
        return []  # no folder (yet): nothing in it
    for entry in entries:
        if entry.name.startswith(("_", ".")) or _PART.fullmatch(entry.name):
            continue
        if _holds_parquet(entry):
            found.append(entry.name)
    return found


def _holds_parquet(entry: os.DirEntry) -> bool:
    """A Parquet file, or a folder with one somewhere under names a dataset reader does not skip."""
    if not entry.is_dir():
        return entry.name.lower().endswith(".parquet") or _parquet_bytes(entry.path)
    try:
        inside = list(os.scandir(entry.path))
    except OSError:
        return False  # unreadable: no reader reads it either
    return any(not e.name.startswith(("_", ".")) and _holds_parquet(e) for e in inside)


def _parquet_bytes(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PAR1"
    except OSError:
        return False  # unreadable: no reader reads it either


def check_foreign(out_dir: Path) -> None:
    """Refuse (exit 2) an output folder holding what ``foreign_entries`` finds, naming it: its results would
    be read with it."""
    found = foreign_entries(out_dir)
    if found:
        more = f" and {len(found) - 1} more" if len(found) > 1 else ""
        raise InputError(
            f"--output {out_dir} holds {out_dir / found[0]}{more}, which is not the job's: a reader of the folder "
            "(pyarrow.dataset, pandas, Spark) would read it as results too; move it out of the output folder "
            "and run again"
        )
