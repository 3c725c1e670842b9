"""Labels the tokenizer can't tell apart or spell (an uncased tokenizer gives 'Yes' and 'yes' the same ids, and
drops a zero-width space): --choices of that kind is refused before work by validate and run alike, naming
the labels; a row's own (its params column) is that row's error row, and the job goes on. Before, validate
said ok, and run stopped at the first row with "choices 'Yes' and 'yes' have the same tokens", every time
it was resumed, for a row's own labels too."""

from __future__ import annotations

import json

import pyarrow.dataset as ds
import pytest
from click.testing import CliRunner

from batchjob.cli import main
from tests.tiers import engine_fixture
from tests.tiny_models import make_model

pytestmark = pytest.mark.timeout(300)

ZWSP = "\u200b"  # a zero-width space: the BERT normalizer drops it (a control character)


@engine_fixture(scope="module")
def uncased(tmp_path_factory):
    """The tiny llama with its tokenizer behind BERT's uncased normalizer (lowercase, control characters
    dropped), as uncased tokenizers have it."""
    from tokenizers import Tokenizer, normalizers

    folder = make_model(tmp_path_factory.mktemp("uncased") / "llama", "llama")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=False, strip_accents=False, lowercase=True
    )
    tok.save(str(folder / "tokenizer.json"))
    return folder


def _run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


@pytest.fixture()
def data(tmp_path):
    params = {
        2: {"choices": ["Yes", "yes"]},
        3: {"choices": [ZWSP, "no"]},
        4: {"choices": ["Yes", "yes"], "n": 2, "temperature": 1.0},
        5: {"choices": ["yes", "no"]},
    }
    path = tmp_path / "in.jsonl"
    lines = [{"id": i, "text": f"Is it {i}?", "p": json.dumps(params.get(i, {}))} for i in range(7)]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


@pytest.mark.parametrize(("labels", "said"), [("Yes,yes", "'Yes' and 'yes'"), (f"{ZWSP},no", "'\\u200b'")])
def test_job_choices_the_tokenizer_cannot_keep_apart_are_refused_before_work(
    uncased, data, tmp_path, labels, said
):
    out = tmp_path / "o"
    common = ["--input", data, "--output", out, "--model", uncased, "--prompt-column", "text", "--no-chat"]
    for command in ("validate", "run"):
        code, output = _run(command, *common, "--choices", labels)
        assert code == 2, output
        assert "--choices: choice" in output and said in output and "tokenizer" in output, output
    assert not (out / "_batchjob" / "job.json").exists()


def test_a_row_s_own_labels_the_engine_refuses_are_its_error_row(uncased, data, tmp_path):
    out = tmp_path / "o"
    code, output = _run(
        "run", "--input", data, "--output", out, "--model", uncased, "--prompt-column", "text", "--no-chat",
        "--id-column", "id", "--params-column", "p", "--max-new-tokens", "3",
    )  # fmt: skip
    assert code == 0, output
    rows = ds.dataset(str(out), format="parquet").to_table().to_pylist()
    by_id: dict[int, list[dict]] = {}
    for r in rows:
        by_id.setdefault(r["id"], []).append(r)
    assert sorted(by_id) == list(range(7)) and len(by_id[4]) == 2  # every row, row 4 with its 2 samples
    for i in (2, 3, 4):
        for r in by_id[i]:
            assert r["finish_reason"] == "error", r
            assert f"in.jsonl line {i + 1}: the engine can't run this row's parameters: choice" in r["error"]
    assert "'Yes' and 'yes' have the same tokens" in by_id[2][0]["error"]
    assert "'\\u200b' has no tokens" in by_id[3][0]["error"]
    for i in (0, 1, 5, 6):
        assert [r["error"] for r in by_id[i]] == [None], by_id[i]
    assert by_id[5][0]["generated_text"] in ("yes", "no")
