"""Readers and writers: discovery, dirty JSONL/Parquet, compressed files, schemas, coercion, flat memory."""

from __future__ import annotations

import datetime
import glob
import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.errors import InputError
from batchjob.io.jsontext import MAX_DEPTH
from batchjob.io.readers import iter_rows
from batchjob.io.schema import input_schema
from batchjob.io.sources import count_rows, discover
from batchjob.io.writers import PartWriter, build_table, output_schema
from batchjob.job.intervals import IntervalSet

pytestmark = pytest.mark.timeout(120)


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def test_discover_file_dir_glob_and_names(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    write_jsonl(tmp_path / "d" / "a.jsonl", [{"text": "x"}])
    write_jsonl(tmp_path / "d" / "sub" / "b.jsonl", [{"text": "y"}])
    (tmp_path / "d" / "notes.txt").write_text("ignored")
    (tmp_path / "d" / "_hidden.jsonl").write_text("{}")
    assert [s.name for s in discover([str(tmp_path / "d")])] == ["a.jsonl", "sub/b.jsonl"]
    assert [s.name for s in discover([str(tmp_path / "d" / "*.jsonl")])] == ["a.jsonl"]  # one rule
    assert [s.name for s in discover([str(tmp_path / "d" / "_*.jsonl")])] == ["_hidden.jsonl"]  # asked for
    assert [s.name for s in discover([str(tmp_path / "d" / "a.jsonl")])] == ["a.jsonl"]
    # the same name from two --input values stays unique
    write_jsonl(tmp_path / "d" / "sub" / "a.jsonl", [{"text": "w"}])
    names = [
        s.name for s in discover([str(tmp_path / "d" / "a.jsonl"), str(tmp_path / "d" / "sub" / "a.jsonl")])
    ]
    assert len(set(names)) == 2
    # one file named twice is one input: read once
    assert len(discover([str(tmp_path / "d" / "a.jsonl"), str(tmp_path / "d" / "a.jsonl")])) == 1
    (tmp_path / "d" / "sub" / "a.jsonl").unlink()
    # the output folder inside an input folder is never read back
    (tmp_path / "d" / "out").mkdir()
    write_jsonl(tmp_path / "d" / "out" / "c.jsonl", [{"text": "z"}])
    assert "out/c.jsonl" not in [
        s.name for s in discover([str(tmp_path / "d")], exclude=tmp_path / "d" / "out")
    ]


def test_folders_and_globs_take_the_same_files_and_say_what_they_skip(tmp_path):
    """One rule for a folder and a glob over it: names starting with '.' or '_' are left out unless asked for,
    symlinked folders are followed (a loop ends; a file reached twice is read once, by its own path), and every
    path left out is listed with its reason."""
    d = tmp_path / "d"
    for rel in ["a.jsonl", "_SUCCESS.jsonl", ".tmp.jsonl", "sub/b.jsonl", "_meta/c.jsonl", "x/z.jsonl"]:
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(d / rel, [{"text": rel}])
    (d / "notes.txt").write_text("not data")
    (d / "linked").symlink_to(d / "x", target_is_directory=True)  # a symlinked folder: followed
    (d / "x" / "loop").symlink_to(d, target_is_directory=True)  # a loop back to the top: not followed
    taken = ["a.jsonl", "sub/b.jsonl", "x/z.jsonl"]
    skipped = []
    assert [s.name for s in discover([str(d)], skipped=skipped)] == taken
    assert [s.name for s in discover([str(d / "**" / "*.jsonl")])] == taken  # the glob: the same files
    reasons = {Path(s.path).relative_to(d).as_posix(): s.reason for s in skipped}
    assert reasons["_SUCCESS.jsonl"] == "its name starts with '_'"
    assert reasons[".tmp.jsonl"] == "its name starts with '.'"
    assert reasons["_meta"] == "its name starts with '_'"
    assert reasons["notes.txt"].startswith("not .parquet")
    assert "symbolic link loop" in reasons["linked/loop"] and "symbolic link loop" in reasons["x/loop"]
    assert reasons["linked/z.jsonl"] == f"the same file as {d / 'x' / 'z.jsonl'} (read once, as that)"
    # spelled out, a name starting with '_' is taken: by a glob part, or as the path itself
    assert [s.name for s in discover([str(d / "_*" / "*.jsonl")])] == ["_meta/c.jsonl"]
    assert [s.name for s in discover([str(d / "_meta")])] == ["c.jsonl"]
    assert [s.name for s in discover([str(d / "_SUCCESS.jsonl")])] == ["_SUCCESS.jsonl"]


def test_remote_folders_and_globs_follow_the_same_rule():
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    for rel in ["a.jsonl", "_SUCCESS.jsonl", "sub/b.jsonl", "_meta/c.jsonl", "notes.txt"]:
        fs.pipe(f"/rule/{rel}", b'{"text": "x"}\n')
    skipped = []
    taken = ["a.jsonl", "sub/b.jsonl"]
    assert [s.name for s in discover(["memory://rule"], skipped=skipped)] == taken
    assert [s.name for s in discover(["memory://rule/**/*.jsonl"])] == taken  # names as for a folder
    assert [s.name for s in discover(["memory://rule/_*.jsonl"])] == ["_SUCCESS.jsonl"]
    assert sorted(s.path.rsplit("/rule/", 1)[1] for s in skipped) == [
        "_SUCCESS.jsonl",
        "_meta/c.jsonl",
        "notes.txt",
    ]


def test_validate_lists_what_the_input_folder_skipped(tmp_path, tiny_model_dir):
    from click.testing import CliRunner

    from batchjob.cli import main

    d = tmp_path / "d"
    d.mkdir()
    write_jsonl(d / "a.jsonl", [{"text": "x"}])
    write_jsonl(d / "_part-0.jsonl", [{"text": "y"}])
    out, model = str(tmp_path / "o"), str(tiny_model_dir)
    result = CliRunner().invoke(main, ["validate", "--input", str(d), "--output", out, "--model", model])
    assert result.exit_code == 0 and "ok: 1 input file(s)" in result.output, result.output
    assert f"skipped {d / '_part-0.jsonl'}: its name starts with '_'" in result.output, result.output


def test_discover_errors(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        discover([str(tmp_path / "missing.jsonl")])
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(InputError, match="unsupported format"):
        discover([str(tmp_path / "x.csv")])
    with pytest.raises(InputError, match="matches no"):
        discover([str(tmp_path / "*.parquet")])


def test_a_file_named_like_a_glob_is_that_file(tmp_path):
    """'x[1].jsonl' was read as a glob: it read x1.jsonl instead, or without one refused a file that exists."""
    named, other = tmp_path / "x[1].jsonl", tmp_path / "x1.jsonl"
    named.write_text('{"text": "named"}\n')
    other.write_text('{"text": "other"}\n')
    with pytest.raises(
        InputError, match=r"x\[1\]\.jsonl names a file, and read as a glob it matches .*x1\.jsonl"
    ):
        discover([str(named)])
    assert [s.path for s in discover([glob.escape(str(named))])] == [str(named)]  # as the message says
    other.unlink()
    assert [s.path for s in discover([str(named)])] == [str(named)]


def test_dirty_jsonl_becomes_error_rows_with_file_and_line(tmp_path):
    path = tmp_path / "dirty.jsonl"
    with open(path, "wb") as f:
        f.write(b'{"text": "good"}\n')
        f.write(b"{not json\n")
        f.write(b"\n")  # blank: not a row
        f.write(b'{"text": "bad bytes \xff\xfe"}\n')
        f.write(b"[1, 2]\n")
        f.write(b'{"text": "last", "extra": [1, {"a": 2}]}')  # no final newline
    rows = list(iter_rows(discover([str(path)])))
    assert [r.ordinal for r in rows] == [0, 1, 2, 3, 4]
    assert (
        rows[0].values == {"text": "good"} and rows[0].error is None and rows[0].derived_id == "dirty.jsonl:0"
    )
    assert "line 2" in rows[1].error and "bad JSON" in rows[1].error
    assert "line 4" in rows[2].error and "UTF-8" in rows[2].error
    assert "line 5" in rows[3].error and "not a JSON object" in rows[3].error
    assert rows[4].values["extra"] == [1, {"a": 2}]
    assert count_rows(discover([str(path)])[0]) == 5


def test_a_lone_surrogate_escape_is_that_rows_error_and_a_pair_is_a_character(tmp_path):
    # JSON may escape half of a UTF-16 pair ("\\udcff"): Python takes it, but it is no character, and
    # writing it to Parquet raised UnicodeEncodeError and stopped the whole job
    path = tmp_path / "halves.jsonl"
    path.write_text(
        '{"id": 1, "text": "a pair \\ud83d\\ude00 is one character"}\n'
        '{"id": 2, "text": "half \\udcff of one"}\n'
        '{"id": 3, "text": "ok", "tags": ["x", "\\ud800"]}\n'
        '{"id": 4, "\\udfff": "in a key"}\n'
        '{"id": 5, "text": "last"}\n'
    )
    with open(path, "ab") as f:  # a surrogate encoded as bytes (not UTF-8): its key is no column either
        f.write(b'{"id": 6, "k\xed\xbf\xbf": 1}\n')
    rows = list(iter_rows(discover([str(path)]), id_column="id"))
    assert rows[0].error is None and rows[0].values["text"] == "a pair \U0001f600 is one character"
    assert rows[1].error == (
        "halves.jsonl line 2: a lone UTF-16 surrogate escape, not a character, at key 'text': character 5 (\\udcff)"
    )
    assert "line 3" in rows[2].error and "key 'tags': character 0 (\\ud800)" in rows[2].error
    assert "line 4" in rows[3].error and "surrogate" in rows[3].error
    assert [r.values for r in rows[1:4]] == [{"id": 2}, {"id": 3}, {"id": 4}]  # whose rows they are
    assert rows[4].error is None and "line 6: invalid UTF-8" in rows[5].error
    schema = input_schema(discover([str(path)]))
    assert schema.names == ["id", "text"]  # an error row's keys are no columns
    table = build_table([{"values": r.values} for r in rows], schema)  # every row writes
    assert table.column("id").to_pylist() == [1, 2, 3, 4, 5, 6]


def test_a_row_nested_too_deeply_is_that_rows_error_not_the_files(tmp_path):
    deep = "[" * 200_000 + "]" * 200_000  # json.loads raises RecursionError, not ValueError
    path = write_jsonl(
        tmp_path / "deep.jsonl",
        [
            {"text": "first"},
            '{"text": "x", "v": ' + deep + "}",
            {"text": "x", "v": nested(MAX_DEPTH + 5)},  # parses, but no writer or template could take it
            {"text": "x", "v": nested(MAX_DEPTH - 5)},  # deep, but fine
            {"text": "last"},
        ],
    )
    schema = input_schema(discover([str(path)]))  # inferring the columns does not stop at the line either
    assert schema.names == ["text", "v"]
    rows = list(iter_rows(discover([str(path)])))
    assert [r.values["text"] if r.values else None for r in rows] == ["first", None, None, "x", "last"]
    assert rows[1].error == "deep.jsonl line 2: bad JSON (nested deeper than 100 levels)"
    assert rows[2].error == "deep.jsonl line 3: values nested deeper than 100 levels"
    table = build_table([{"values": r.values} for r in rows if r.values], schema)
    assert table.column("v").to_pylist()[1] == json.dumps(nested(MAX_DEPTH - 5))


def test_a_parquet_value_one_row_cant_convert_is_that_rows_error(tmp_path):
    path = tmp_path / "dates.parquet"
    ts = pa.array([0, 300_000_000_000, 5], type=pa.timestamp("s"))  # the middle one is beyond year 9999
    pq.write_table(pa.table({"ts": ts, "text": ["a", "b", "c"]}), path)
    rows = list(iter_rows(discover([str(path)])))
    assert [r.values["text"] if r.values else None for r in rows] == ["a", None, "c"]
    assert rows[1].error.startswith("dates.parquet row 1: cannot convert its values (OverflowError")
    assert [r.ordinal for r in rows] == [0, 1, 2]


def nested(depth):
    value: object = 0
    for _ in range(depth):
        value = [value]
    return value


def test_truncated_gzip_and_zstd(tmp_path):
    import zstandard

    data = b"".join(json.dumps({"text": f"row {i}"}).encode() + b"\n" for i in range(2000))
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
    rows = list(iter_rows(discover([str(tmp_path / "a.jsonl.zst")])))
    assert len(rows) == 2000 and rows[-1].values == {"text": "row 1999"}
    whole = gzip.compress(data)
    (tmp_path / "b.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    rows = list(iter_rows(discover([str(tmp_path / "b.jsonl.gz")])))
    assert rows[-1].error is not None and "cannot read the rest" in rows[-1].error
    assert all(r.error is None for r in rows[:-1]) and len(rows) > 10


def test_parquet_and_hf_folder_and_skip(tmp_path):
    import datasets

    table = pa.table({"text": [f"t{i}" for i in range(3000)], "n": list(range(3000))})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=500)
    datasets.Dataset.from_dict({"text": ["h0", "h1"]}).save_to_disk(str(tmp_path / "hf"))
    sources = discover([str(tmp_path / "a.parquet"), str(tmp_path / "hf")])
    assert [s.kind for s in sources] == ["parquet", "hf"]
    assert [count_rows(s) for s in sources] == [3000, 2]
    rows = list(iter_rows(sources))
    assert len(rows) == 3002 and rows[2999].values == {"text": "t2999", "n": 2999}
    hf = 1 << 40  # the second file's rows start at ordinal 1 << 40 (batchjob.job.inputs)
    assert (
        rows[3001].values == {"text": "h1"}
        and rows[3001].ordinal == hf + 1
        and rows[3001].derived_id == "hf:1"
    )
    done = IntervalSet([(0, 2500), (hf, hf + 1)])
    gen = iter_rows(sources, skip=done.__contains__, covered=done.covers)
    left = []
    with pytest.raises(StopIteration) as stop:
        while True:
            left.append(next(gen))
    assert [r.ordinal for r in left] == list(range(2500, 3000)) + [hf + 1]
    assert stop.value.value == [3000, 2]  # rows per source


def test_a_dataset_dict_whose_splits_differ_is_refused_naming_a_split_to_give(tmp_path):
    """All of a saved DatasetDict's splits are read, under the first's columns: a split with other columns or
    types had them dropped or nulled, without a word."""
    import datasets

    same = {"test": {"prompt": ["T0"], "score": [1]}, "train": {"prompt": ["R0", "R1"], "score": [2, 3]}}
    datasets.DatasetDict({k: datasets.Dataset.from_dict(v) for k, v in same.items()}).save_to_disk(
        tmp_path / "a"
    )
    assert input_schema(discover([str(tmp_path / "a")])).names == ["prompt", "score"]
    assert len(list(iter_rows(discover([str(tmp_path / "a")])))) == 3
    other = {**same, "train": {"prompt": ["R0"], "score": ["high"], "label": [0]}}
    datasets.DatasetDict({k: datasets.Dataset.from_dict(v) for k, v in other.items()}).save_to_disk(
        tmp_path / "b"
    )
    with pytest.raises(InputError, match="splits 'test' and 'train' have different columns .*b/train"):
        input_schema(discover([str(tmp_path / "b")]))


def test_corrupt_parquet_file_is_an_error_row(tmp_path):
    pq.write_table(pa.table({"text": ["a", "b"]}), tmp_path / "a.parquet")
    (tmp_path / "b.parquet").write_bytes(b"PAR1 this is not parquet")
    pq.write_table(pa.table({"text": ["c"]}), tmp_path / "c.parquet")
    rows = list(iter_rows(discover([str(tmp_path)])))
    assert [r.values for r in rows if r.error is None] == [{"text": "a"}, {"text": "b"}, {"text": "c"}]
    bad = [r for r in rows if r.error is not None]
    assert len(bad) == 1 and "b.parquet" in bad[0].error
    with pytest.raises(InputError, match="b.parquet"):
        input_schema(discover([str(tmp_path / "b.parquet")]))


def test_a_damaged_row_group_takes_its_own_rows_and_the_file_goes_on(tmp_path):
    path = tmp_path / "groups.parquet"
    pq.write_table(pa.table({"text": [f"row {i} " + "x" * 40 for i in range(6)]}), path, row_group_size=1)
    column = pq.ParquetFile(path).metadata.row_group(2).column(0)
    with open(path, "r+b") as f:  # the third group's page header overwritten
        f.seek(column.data_page_offset)
        f.write(b"\xff" * 16)
    sources = discover([str(path)])
    rows = list(iter_rows(sources))
    assert count_rows(sources[0]) == len(rows) == 6  # every row once: what status counts is what is read
    assert [r.values["text"][:5] if r.values else None for r in rows] == [
        "row 0",
        "row 1",
        None,
        "row 3",
        "row 4",
        "row 5",
    ]
    assert rows[2].error.startswith("groups.parquet row 2: cannot read its row group, #3 of 6 (")
    assert "\n" not in rows[2].error


def test_jsonl_schema_inference_and_writer_coercion(tmp_path):
    path = write_jsonl(
        tmp_path / "m.jsonl",
        [
            {"a": 1, "b": "x", "c": 1, "d": [1, 2], "e": True},
            {"a": 2, "b": 5, "c": 2.5, "d": {"k": "v"}, "e": None},
        ],
    )
    schema = input_schema(discover([str(path)]))
    assert schema.types == [pa.int64(), pa.string(), pa.float64(), pa.string(), pa.bool_()]
    rows = [
        {"values": {"a": "not an int", "b": {"nested": 1}, "c": 3, "d": [3], "e": "yes", "zzz": 1}},
        {"values": None, "generated_text": None, "finish_reason": "error", "error": "bad"},
        {
            "values": {"a": 2**70},
            "generated_text": "ok",
            "finish_reason": "stop",
            "num_prompt_tokens": 3,
            "num_generated_tokens": 1,
        },
    ]
    table = build_table(rows, schema)
    assert table.schema == output_schema(schema)
    assert table.column("a").to_pylist() == [None, None, None]
    assert table.column("b").to_pylist() == ['{"nested": 1}', None, None]
    assert table.column("d").to_pylist() == ["[3]", None, None]
    assert table.column("e").to_pylist() == [None, None, None]
    assert "zzz" not in table.column_names


def test_result_name_clash_and_part_writer(tmp_path):
    schema = pa.schema([("error", pa.string()), ("text", pa.string())])
    assert output_schema(schema).names[:2] == ["input_error", "text"]
    writer = PartWriter(tmp_path, schema)
    name = writer.write(
        0,
        [
            {
                "values": {"error": "e", "text": "t"},
                "generated_text": "g",
                "finish_reason": "stop",
                "num_prompt_tokens": 1,
                "num_generated_tokens": 2,
            }
        ],
    )
    assert pq.read_table(tmp_path / name).to_pylist()[0]["input_error"] == "e"
    (tmp_path / "part-000009.parquet").write_bytes(b"orphan")
    (tmp_path / ".part-000010.parquet.tmp").write_bytes(b"torn")
    assert sorted(writer.remove_orphans({name})) == [".part-000010.parquet.tmp", "part-000009.parquet"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


@pytest.mark.engine  # streams a large file to measure memory: seconds, not the unit tier's inner loop
def test_reader_memory_is_flat(tmp_path):
    """Peak traced memory while streaming 4N rows is about that of N rows: the dataset is never held."""
    import tracemalloc

    n = 20_000
    peaks = {}
    for k in (1, 4):
        path = tmp_path / f"big{k}.jsonl"
        with open(path, "w") as f:
            for i in range(n * k):
                f.write(f'{{"id": {i}, "text": "short prompt number {i} with some padding words"}}\n')
        sources = discover([str(path)])
        tracemalloc.start()
        count = sum(1 for _ in iter_rows(sources))
        peaks[k] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert count == n * k
    # 60k more rows (~5 MB of JSON, far more as Python objects) must not show up in peak memory
    assert peaks[4] < peaks[1] + 1_000_000, peaks


def test_a_time_with_nanoseconds_is_an_error_row_not_written_back_as_microseconds(tmp_path):
    """A Python time holds microseconds: a time64[ns] value with nanoseconds was echoed cut to them."""
    times = pa.array([1, 3_600_000_000_000, None], pa.time64("ns"))
    pq.write_table(pa.table({"text": ["a", "b", "c"], "t": times}), tmp_path / "a.parquet")
    rows = list(iter_rows(discover([str(tmp_path / "a.parquet")])))
    assert rows[0].values is None and "column 't' holds a time of 1 ns after midnight" in rows[0].error
    assert rows[1].error is None and rows[1].values["text"] == "b"
    assert rows[2].error is None and rows[2].values["t"] is None


def test_a_nested_time_with_nanoseconds_is_an_error_row_not_written_back_as_microseconds(tmp_path):
    """A time64[ns] value in a struct, list or map was written back cut to microseconds without a word (only
    a column of its own was checked): 00:00:01.000000001 came back 00:00:01."""
    ns = pa.time64("ns")
    backed = pa.ListArray.from_arrays(pa.array([0, 1, 2, 3, 4]), pa.array([5000, 1, 7, 2000], ns))
    backed = pa.ListArray.from_arrays(
        backed.offsets, backed.values, mask=pa.array([False, False, True, False])
    )
    table = pa.table(
        {
            "id": ["s", "l", "m", "ok"],
            "st": pa.array([{"t": 1_000_000_001}, None, {"t": None}, {"t": 5000}], pa.struct([("t", ns)])),
            "lt": backed,  # row 2's list is null over a value with nanoseconds: nothing of it is written
            "mt": pa.array([[], [], [("k", 3)], [("k", 4000)]], pa.map_(pa.string(), ns)),
            "fl": pa.array([[0, 0], [1000, 2000], [3000, 4000], [5000, 6000]], pa.list_(ns, 2)),
        }
    )
    pq.write_table(table, tmp_path / "a.parquet")
    rows = list(iter_rows(discover([str(tmp_path / "a.parquet")]), id_column="id"))
    assert "column 'st' holds a time of 1000000001 ns after midnight in a nested value" in rows[0].error
    assert "column 'lt' holds a time of 1 ns" in rows[1].error and rows[1].values == {"id": "l"}
    assert "column 'mt' holds a time of 3 ns" in rows[2].error
    assert rows[3].error is None and rows[3].values["fl"] == [
        datetime.time(0, 0, 0, 5),
        datetime.time(0, 0, 0, 6),
    ]
    assert rows[2].values == {"id": "m"}  # the error row says whose it is; no value of it is written


def test_parts_leave_out_the_input_frames_pandas_index(tmp_path):
    """A frame written with a RangeIndex from 1000 (a chunk of a bigger one) stores the index only as its
    'pandas' metadata; the parts copied it, so pandas labelled the output's rows, in output order, 1000...:
    each row with the label of the row at its place in the input (111 of 300 rows in the prober's run)."""
    import pandas as pd  # only this test reads the output as pandas does

    frame = pd.DataFrame({"prompt": ["a", "b", "c"], "rowno": [0, 1, 2]}, index=pd.RangeIndex(1000, 1003))
    frame.to_parquet(tmp_path / "a.parquet")
    schema = input_schema(discover([str(tmp_path / "a.parquet")]))
    rows = [{"values": {"prompt": p, "rowno": n}, "generated_text": "x"} for p, n in [("c", 2), ("a", 0)]]
    out = tmp_path / "out"
    out.mkdir()
    PartWriter(out, schema).write(0, rows)
    assert b"pandas" not in (pq.read_schema(out / "part-000000.parquet").metadata or {})
    read = pd.read_parquet(out / "part-000000.parquet")
    assert read.index.tolist() == [0, 1] and read["rowno"].tolist() == [2, 0]  # no input label on another row
