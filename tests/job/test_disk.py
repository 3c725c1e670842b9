"""A full disk stops the job with exit 1 and a message naming the file, leaves no temporary file, and the same
command afterwards finishes the job exactly: by fault injection (``BATCHJOB_FAULT_ENOSPC``), and on a real
full tmpfs where this machine lets us mount one."""

from __future__ import annotations

import errno
import os
import re
import subprocess

import pytest

from batchjob.io.atomic import DiskFullError, disk_full_message, is_disk_full, write_bytes
from tests.faultproc import job_args, reference, temp_files, write_reviews
from tests.jobproc import read_results as results
from tests.jobproc import run_here

pytestmark = pytest.mark.timeout(300)

RESUME = "; free space and run the same command again: finished rows are kept"


@pytest.fixture(scope="module")
def reviews(tmp_path_factory):
    return write_reviews(tmp_path_factory.mktemp("data") / "reviews.jsonl", 15)


@pytest.fixture(scope="module")
def expected(reviews, tiny_model_dir, tmp_path_factory):
    return reference(reviews, tiny_model_dir, tmp_path_factory.mktemp("ref") / "out")


@pytest.fixture
def run(launch):
    """Run ``batchjob run ARGS`` as a process to its end: its exit code and output."""

    def run_to_end(args, **env):
        proc = launch(args, **env)
        text = proc.communicate(timeout=240)[0]
        return proc.returncode, text

    return run_to_end


def test_disk_full_is_recognised_however_it_is_worded(tmp_path):
    pyarrow_style = OSError("Error writing bytes to file. Detail: [errno 28] No space left on device")
    assert is_disk_full(pyarrow_style) and is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert (
        disk_full_message(pyarrow_style, tmp_path / "x")
        == f"no space left on device writing {tmp_path / 'x'}{RESUME}"
    )
    assert disk_full_message(OSError(errno.EDQUOT, "q"), None).startswith("disk quota exceeded; free space")


def test_a_state_write_that_fails_names_the_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHJOB_FAULT_ENOSPC", "s.json:2")
    write_bytes(tmp_path / "s.json", b"one")
    with pytest.raises(DiskFullError, match=r"no space left on device writing .*\.s\.json\.tmp; free space"):
        write_bytes(tmp_path / "s.json", b"two")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json"]
    assert (tmp_path / "s.json").read_bytes() == b"one"  # the old content, whole


@pytest.mark.parametrize(
    "fault, temp",
    [("part:3", ".part-000002.parquet.tmp"), ("inflight.json:4", "_batchjob/.inflight.json.tmp")],
    ids=["part", "checkpoint"],
)
def test_disk_full_exits_1_naming_the_file_and_the_rerun_is_exact(
    run, reviews, tiny_model_dir, tmp_path, expected, fault, temp
):
    out = tmp_path / "out"
    args = job_args(reviews, out, tiny_model_dir, "--checkpoint-interval", "0.001")  # a part per step
    code, text = run(args, BATCHJOB_FAULT_ENOSPC=fault)
    assert code == 1, text
    assert f"no space left on device writing {out / temp}{RESUME}" in text
    assert "Traceback" not in text
    assert temp_files(out) == []
    if fault.startswith("part"):
        assert sorted(p.name for p in out.glob("*.parquet")) == ["part-000000.parquet", "part-000001.parquet"]

    code, text = run_here(args)  # the same command (in this process: what it finds on disk is the point)
    assert code == 0, text
    assert results(out) == expected  # every row exactly once, the same text


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs, or a skip where mounting is not allowed (it needs root)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot mount a tmpfs here: {e}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, timeout=30)


def test_a_really_full_disk(run, reviews, tiny_model_dir, small_tmpfs, expected):
    filler = small_tmpfs / "filler"
    st = os.statvfs(small_tmpfs)
    filler.write_bytes(b"x" * (st.f_bavail * st.f_frsize - 32 * 1024))  # 32 KiB left: a few parts' worth
    out = small_tmpfs / "out"
    args = job_args(reviews, out, tiny_model_dir, "--checkpoint-interval", "0.001")
    code, text = run(args)
    assert code == 1, text
    # the file, whichever it was (a manifest append names no file: then the output folder)
    assert re.search(rf"no space left on device writing (under )?{re.escape(str(out))}\S*{RESUME}", text), (
        text
    )
    assert "Traceback" not in text
    assert temp_files(out) == []

    filler.unlink()  # space freed: the same command finishes the job
    code, text = run_here(args)  # the same command (in this process: what it finds on disk is the point)
    assert code == 0, text
    assert results(out) == expected


def test_the_cli_names_the_output_folder_when_the_error_names_no_file():
    from click import ClickException

    from batchjob.program import errors

    @errors
    def command(output=None):
        raise OSError(errno.ENOSPC, "No space left on device")  # as a plain file write reports it

    with pytest.raises(ClickException) as e:
        command(output="OUT")
    assert e.value.exit_code == 1
    assert e.value.message == f"no space left on device writing under OUT{RESUME}"
