"""A row whose value its column can't store unchanged (a JSONL line past the 1,000 the columns were read from, a
file whose column merged into another type) is an error row naming the value, never a silently changed or
dropped value; and ids are unique as they are written (batchjob/io/fits.py)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchjob.cli import main
from batchjob.io.fits import Fit, fits, id_text
from batchjob.io.jsontext import Overflow, loads_text
from batchjob.io.readers import iter_rows
from batchjob.io.schema import input_schema
from batchjob.io.sources import discover
from batchjob.io.writers import build_table

FITS = [
    (5, pa.int64(), True),
    (2.5, pa.int64(), False),  # pyarrow itself would store 2
    (True, pa.int64(), False),
    (2**63, pa.int64(), False),
    (2**64 - 1, pa.uint64(), True),
    (2**64 - 1, pa.int64(), False),
    (-1, pa.uint64(), False),
    (2**53, pa.float64(), True),
    (2**53 + 1, pa.float64(), False),  # would be stored as 2**53
    (10**400, pa.float64(), False),
    (float("nan"), pa.float64(), True),
    ("abc", pa.float64(), False),
    (1, pa.bool_(), False),
    ({"a": 1}, pa.string(), True),  # a text column takes any value as its JSON text
    ([1, 2], pa.list_(pa.int64()), True),
    ([1.5], pa.list_(pa.int64()), False),
    (None, pa.int64(), True),
    # a struct column that gained a field in another file: this file's rows hold it as null, unchanged
    ({"src": "x"}, pa.struct([("src", pa.string()), ("lang", pa.string())]), True),
    ([{"src": "x"}], pa.list_(pa.struct([("src", pa.string()), ("lang", pa.string())])), True),
    ({"src": "x", "other": 1}, pa.struct([("src", pa.string()), ("lang", pa.string())]), False),
]


@pytest.mark.parametrize(("value", "type_", "fit"), FITS)
def test_fits(value, type_, fit):
    assert fits(value, type_) is fit
    # a row's check (the common types without asking the type each time) says the same
    assert (Fit(pa.schema([("c", type_)]), None).why({"c": value}) is None) is fit


def test_ids_are_compared_as_they_are_written():
    assert id_text(1, pa.float64()) == id_text(1.0, pa.float64()) == "1.0"
    assert id_text(True, pa.string()) == "true" != id_text("True", pa.string())
    assert id_text(float("nan"), pa.string()) == "NaN"
    assert id_text(7, pa.int64()) == "7" and id_text("a b", pa.string()) == "a b"


def _lines(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_lines_past_the_sample_that_dont_fit_are_error_rows(tmp_path):
    rows = [{"id": i, "q": "hi", "n": i} for i in range(1000)]
    rows += [
        {"id": 1000, "q": "hi", "n": "abc"},  # text in an integer column
        {"id": 1001, "q": "hi", "n": 2.5},
        {"id": 1002, "q": "hi", "n": 3, "extra": "late"},  # a key the first 1,000 lines never had
        {"id": 1003, "q": "hi", "n": 4},
        {"id": 7.5, "q": "hi", "n": 5},  # the id itself
    ]
    sources = discover([str(_lines(tmp_path / "a.jsonl", rows))])
    schema = input_schema(sources)
    read = list(iter_rows(sources, schema=schema))[1000:]
    assert [r.error is None for r in read] == [False, False, False, True, False]
    assert "a.jsonl line 1001: column 'n': 'abc' (str)" in read[0].error and "int64" in read[0].error
    assert "first 1,000 lines" in read[0].error
    assert read[0].values == {"id": 1000, "q": "hi", "n": None}  # the rest of the row is kept
    assert "2.5 (float)" in read[1].error
    assert "key 'extra' is not a column" in read[2].error and "extra" not in read[2].values
    assert "column 'id': 7.5" in read[4].error and read[4].values["id"] is None
    # without the job's schema (counting rows, checking OpenAI custom ids) nothing is checked
    assert all(r.error is None for r in iter_rows(sources))


def test_parquet_values_that_dont_fit_the_merged_column_are_error_rows_and_take_no_id(tmp_path):
    pq.write_table(
        pa.table({"id": pa.array([1, 2], pa.int64()), "u": pa.array([2**64 - 1, 5], pa.uint64())}),
        tmp_path / "a.parquet",
    )
    pq.write_table(
        pa.table({"id": pa.array([1.5, 3.0]), "u": pa.array([-1, 6], pa.int64())}), tmp_path / "b.parquet"
    )
    pq.write_table(
        pa.table({"id": pa.array([2**53 + 1, 4], pa.int64()), "u": pa.array([7, 8], pa.int64())}),
        tmp_path / "c.parquet",
    )
    sources = discover([str(tmp_path)])
    schema = input_schema(sources)
    assert schema.field("id").type == pa.float64() and schema.field("u").type == pa.int64()
    read = list(iter_rows(sources, schema=schema))
    bad = {(r.source, r.index): r.error for r in read if r.error is not None}
    assert set(bad) == {("a.parquet", 0), ("c.parquet", 0)}
    assert "column 'u': 18446744073709551615 (int)" in bad["a.parquet", 0]
    assert "column 'id': 9007199254740993 (int)" in bad["c.parquet", 0] and "merge" in bad["c.parquet", 0]
    skipped = {}
    rows = iter_rows(
        sources,
        skip=lambda o: True,
        covered=lambda a, b: True,  # a file whose columns are checked is read row by row all the same
        on_skipped=skipped.__setitem__,
        id_column="id",
        schema=schema,
    )
    assert list(rows) == []
    assert sorted(v for v in skipped.values() if v is not None) == [1.5, 2, 3.0, 4]  # error rows: no id


def test_rows_passed_over_unread_report_the_ids_the_rows_would_have(tmp_path):
    """A batch passed over whole (a resumed job's done rows, another worker's) reported the id of a row that
    is an error row when read (its time64[ns] value): another worker's row of that id was then a duplicate
    of no row; an id that is no UTF-8 stopped the reader there, and the resumed job said complete without
    the rest of the file."""
    ids = pa.array([b"a", b"b", b"c\xff", b"d"], pa.binary())
    table = pa.table(
        {
            "id": pa.Array.from_buffers(pa.string(), len(ids), ids.buffers()),
            "t": pa.array([1000, 1, 2000, 3000], pa.time64("ns")),  # row 1: nanoseconds a time would drop
        }
    )
    pq.write_table(table, tmp_path / "a.parquet")
    sources = discover([str(tmp_path / "a.parquet")])

    def ids_passed(covered):
        seen = {}
        assert list(iter_rows(sources, lambda o: True, covered, seen.__setitem__, "id")) == []
        return seen

    by_row = ids_passed(lambda a, b: False)
    assert list(by_row.values()) == ["a", None, None, "d"]
    assert ids_passed(lambda a, b: True) == by_row
    # read, an error row keeps its id where the id reads cleanly, as a JSONL line's does
    rows = list(iter_rows(sources, id_column="id"))
    assert [(r.values, r.error is not None) for r in rows[1:3]] == [({"id": "b"}, True), (None, True)]


def test_the_writer_never_stores_a_value_changed(tmp_path):
    schema = pa.schema([("n", pa.int64()), ("f", pa.float64())])
    rows = [{"values": {"n": 2.5, "f": 2**53 + 1}}, {"values": {"n": 3, "f": 1}}]
    table = build_table(rows, schema)
    assert table.column("n").to_pylist() == [None, 3] and table.column("f").to_pylist() == [None, 1.0]


@pytest.mark.engine
def test_a_job_over_merged_id_columns_finds_ids_equal_as_written(tmp_path, tiny_model_dir):
    """1 in an integer file and 1.0 in a float file are one id once written (1.0): the second is a duplicate."""
    pq.write_table(pa.table({"id": pa.array([1, 2], pa.int64()), "q": ["a", "b"]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"id": [1.0, 2.5], "q": ["c", "d"]}), tmp_path / "b.parquet")
    out = tmp_path / "out"
    args = ["run", "--input", str(tmp_path / "a.parquet"), "--input", str(tmp_path / "b.parquet")]
    args += ["--output", str(out), "--model", str(tiny_model_dir), "--prompt-column", "q", "--id-column", "id"]
    result = CliRunner().invoke(main, [*args, "--max-new-tokens", "2"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    by_q = {r["q"]: r for r in ds.dataset(out, format="parquet").to_table().to_pylist()}
    assert by_q["c"]["error"] == "duplicate id '1.0': first used by row a.parquet:0; ids must be unique"
    assert [by_q[q]["error"] for q in "abd"] == [None, None, None]


def test_a_json_number_past_float64s_range_is_an_error_row_naming_column_and_number(tmp_path):
    """json.loads makes 1e400 inf without a word, and the row was written with score inf (-2.5e308: -inf)."""
    lines = [
        '{"id": 1, "prompt": "a", "score": 1e400}',
        '{"id": 2, "prompt": "b", "score": 0.5, "deep": [{"x": -2.5e308}]}',
        '{"id": 3, "prompt": "c", "score": 1.5e308, "deep": []}',
    ]
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    sources = discover([str(tmp_path / "a.jsonl")])
    rows = list(iter_rows(sources, id_column="id", schema=input_schema(sources)))
    assert rows[0].error == (
        "a.jsonl line 1: column 'score': the number 1e400 is past float64's range (it would be stored as inf); "
        "write it as text (a JSON string) if it is meant"
    )
    assert "column 'deep': the number -2.5e308 is past" in rows[1].error
    assert [r.values for r in rows[:2]] == [{"id": 1}, {"id": 2}]  # the error rows say whose they are
    assert rows[2].error is None and rows[2].values["score"] == 1.5e308
    with pytest.raises(Overflow, match="the number 1e400 is past float64's range"):  # a column's JSON text too
        loads_text('{"temperature": 1e400}')


def test_a_categorical_text_column_beside_a_plain_one_starts_as_append_takes_it(tmp_path):
    """A dictionary<string> column (a pandas categorical) in one file and a string column in another were
    refused at the start ('the inputs of one job must agree'), while --append took the same file in."""
    labels = pa.array(["x", "y"]).dictionary_encode()
    pq.write_table(pa.table({"prompt": ["a0", "a1"], "lab": labels}), tmp_path / "1.parquet")
    pq.write_table(pa.table({"prompt": ["b0"], "lab": ["z"]}), tmp_path / "2.parquet")
    pq.write_table(pa.table({"prompt": ["c0"], "lab": pa.array([None], pa.null())}), tmp_path / "3.parquet")
    sources = discover([str(tmp_path)])
    schema = input_schema(sources)
    assert schema.field("lab").type == pa.string()
    rows = list(iter_rows(sources, schema=schema))
    assert [(r.values["lab"], r.error) for r in rows] == [("x", None), ("y", None), ("z", None), (None, None)]
    table = build_table([{"values": r.values} for r in rows], schema)
    assert table.column("lab").to_pylist() == ["x", "y", "z", None]
