"""The schema metadata the parts carry from the inputs: a record that describes only some of the rows (a saved
dataset's features, by which ``datasets`` decodes a ClassLabel's integers) is refused or left out, never
written over rows it would read wrong."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from batchjob.errors import InputError
from batchjob.io.schema import HF_KEY, compatible, input_schema
from batchjob.io.sources import discover

pytestmark = pytest.mark.timeout(120)


def _dataset(labels, text="x"):
    import datasets  # heavy: only the tests that save a dataset load it

    features = datasets.Features(
        {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=labels)}
    )
    return datasets.Dataset.from_dict({"text": [text], "label": [1]}, features=features)


def test_splits_whose_class_label_names_differ_are_refused_naming_both_folders(tmp_path):
    """train ['neg', 'pos'] and test ['pos', 'neg'] were read as one input: the parts carried one split's
    names, so datasets decoded the other split's labels wrong (the test row's 'neg' read back as 'pos')."""
    import datasets  # heavy: only the tests that save a dataset load it

    splits = {"train": _dataset(["neg", "pos"]), "test": _dataset(["pos", "neg"])}
    datasets.DatasetDict(splits).save_to_disk(tmp_path / "dd")
    with pytest.raises(InputError) as refused:
        input_schema(discover([str(tmp_path / "dd")]))
    said = str(refused.value)
    assert "splits 'test' and 'train' have different features for column 'label'" in said
    assert f"{tmp_path}/dd/test or {tmp_path}/dd/train" in said
    datasets.DatasetDict({"train": splits["train"], "test": _dataset(["neg", "pos"])}).save_to_disk(
        tmp_path / "same"
    )
    assert HF_KEY in input_schema(discover([str(tmp_path / "same")])).metadata  # alike: kept


def test_files_whose_features_differ_give_parts_without_them(tmp_path):
    """Of several files, the first file's features were the job's: the other files' labels were decoded by
    names they never had. Kept only where every input gives the same; an appended file must give the job's."""
    (tmp_path / "a").mkdir()
    _dataset(["neg", "pos"]).to_parquet(tmp_path / "a" / "1.parquet")
    _dataset(["neg", "pos"]).to_parquet(tmp_path / "a" / "2.parquet")
    alike = input_schema(discover([str(tmp_path / "a")]))
    assert HF_KEY in alike.metadata
    _dataset(["pos", "neg"]).to_parquet(tmp_path / "other.parquet")
    pq.write_table(
        pq.read_table(tmp_path / "other.parquet").replace_schema_metadata(), tmp_path / "plain.parquet"
    )
    for other in ("other.parquet", "plain.parquet"):
        mixed = input_schema(discover([str(tmp_path / "a"), str(tmp_path / other)]))
        assert mixed.names == ["text", "label"] and HF_KEY not in (mixed.metadata or {})
        why = compatible(alike, discover([str(tmp_path / other)])[0])
        assert why is not None and "'huggingface' schema metadata" in why
    assert compatible(alike, discover([str(tmp_path / "a" / "2.parquet")])[0]) is None


def test_a_renamed_input_columns_feature_goes_with_it(tmp_path):
    """An input column named as a result column is written as ``input_<name>``; its feature stayed under the
    old name, so ``datasets`` decoded the result column by it (an input ``num_prompt_tokens`` ClassLabel made
    every row's token count a label name)."""
    import datasets  # heavy: only the tests that save a dataset load it

    from batchjob.io.writers import output_schema

    features = datasets.Features(
        {"prompt": datasets.Value("string"), "num_prompt_tokens": datasets.ClassLabel(names=["a", "b"])}
    )
    table = datasets.Dataset.from_dict({"prompt": ["x"], "num_prompt_tokens": [1]}, features=features)
    table.to_parquet(tmp_path / "in.parquet")
    schema = output_schema(input_schema(discover([str(tmp_path / "in.parquet")])))
    assert "input_num_prompt_tokens" in schema.names and "num_prompt_tokens" in schema.names
    read = datasets.Features.from_arrow_schema(schema)
    assert read["input_num_prompt_tokens"] == datasets.ClassLabel(names=["a", "b"])
    assert read["num_prompt_tokens"] == datasets.Value(str(schema.field("num_prompt_tokens").type))
