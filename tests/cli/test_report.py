"""Seeing a job: `batchjob report` (an HTML page of plots), `validate --estimate`, progress lines in logs."""

from __future__ import annotations

import base64
import io
import json
import re
import signal

import pytest
from click.testing import CliRunner

from batchjob.cli import main
from batchjob.job import make_spec, run_job
from tests.faultproc import wait_for_points

pytestmark = pytest.mark.timeout(300)

FIGURES = [
    "occupancy",
    "throughput",
    "kv",
    "preemptions",
    "queue_wait",
    "ttft",
    "latency",
    "prompt_lengths",
    "output_lengths",
    "finish_reasons",
]


@pytest.fixture(scope="module")
def reviews(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "reviews.jsonl"
    with open(path, "w") as f:
        for i in range(120):
            words = " ".join(["fine", "broke", "great", "slow"][j % 4] for j in range(3 + (i * 7) % 40))
            f.write(json.dumps({"rid": f"r{i:03d}", "review": f"Review {i}: {words}"}) + "\n")
        f.write(json.dumps({"rid": "empty", "review": None}) + "\n")
        f.write("{torn\n")
    return path


def args(reviews, out, model, *extra):
    return [
        "--input",
        str(reviews),
        "--output",
        str(out),
        "--model",
        str(model),
        "--template",
        "{review}",
        "--id-column",
        "rid",
        "--max-new-tokens",
        "6",
        "--max-num-seqs",
        "8",
        "--checkpoint-interval",
        "0.05",
        *extra,
    ]


def invoke(*argv):
    result = CliRunner().invoke(main, [str(a) for a in argv])
    return result.exit_code, result.output


def figures(page: str) -> dict[str, bytes]:
    found = re.findall(r'<figure id="(\w+)"><img alt="[^"]*" src="data:image/png;base64,([^"]+)">', page)
    return {key: base64.b64decode(data) for key, data in found}


def assert_images(figs: dict[str, bytes]) -> None:
    from PIL import Image

    for key, png in figs.items():
        image = Image.open(io.BytesIO(png))
        image.verify()  # a real, decodable PNG
        assert image.size[0] > 100, key


def test_report_of_a_finished_choices_job(reviews, tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    code, text = invoke("run", *args(reviews, out, tiny_model_dir, "--choices", "good,bad,meh"))
    assert code == 0, text
    code, text = invoke("report", out)
    assert code == 0, text
    path = out / "_batchjob" / "report.html"
    assert text.strip() == str(path)
    page = path.read_text()
    figs = figures(page)
    assert set(FIGURES) | {"labels"} <= set(figs), sorted(figs)
    assert_images(figs)
    assert ": complete" in page and "rows: 122 of 122" in page
    assert 'id="errors"' in page and "bad JSON" in page and "is null" in page  # errors by kind, with examples
    assert "<code>empty</code>" in page  # an example row named by its id


def test_report_of_a_killed_job_and_side_by_side(launch, reviews, tiny_model_dir, tmp_path):
    killed = tmp_path / "killed"
    proc = launch(args(reviews, killed, tiny_model_dir), BATCHJOB_FAULT_PAUSE="part_committed")
    wait_for_points(proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    code, text = invoke("report", killed, "--to", tmp_path / "killed.html")
    assert code == 0, text
    page = (tmp_path / "killed.html").read_text()
    assert "incomplete" in page
    assert {"prompt_lengths", "finish_reasons"} <= set(figures(page))  # from what was committed
    static = tmp_path / "static"
    assert invoke("run", *args(reviews, static, tiny_model_dir, "--admission", "static"))[0] == 0
    cont = tmp_path / "continuous"
    assert invoke("run", *args(reviews, cont, tiny_model_dir))[0] == 0
    code, text = invoke("report", static, cont, "--to", tmp_path / "both.html")
    assert code == 0, text
    page = (tmp_path / "both.html").read_text()
    side = page.split("<h2>Side by side</h2>")[1].split("<h2>")[0]
    assert side.count('<figure id="occupancy">') == 2 and side.count('<figure id="throughput">') == 2
    assert "static: batch occupancy" in side and "continuous: batch occupancy" in side
    assert_images(figures(page))


def _seconds(text: str) -> float:
    match = re.search(r"^estimated time: ([\d.]+) (s|min|h)$", text, re.M)
    assert match, text
    return float(match.group(1)) * {"s": 1, "min": 60, "h": 3600}[match.group(2)]


def test_estimate_is_within_a_factor_two_of_the_real_run(tiny_model_dir, tmp_path):
    """The estimate against a real run of the same job, right after it. Both are timings on a shared machine,
    so a second try is allowed when another program's load fell on one of them only."""
    data = tmp_path / "rows.jsonl"
    with open(data, "w") as f:
        for i in range(1200):
            f.write(json.dumps({"text": f"item {i} " + "word " * (5 + i % 60)}) + "\n")
    tries = []
    for attempt in range(2):
        out = tmp_path / f"out{attempt}"
        common = ["--input", data, "--output", out, "--model", tiny_model_dir, "--max-new-tokens", "24"]
        common += ["--no-chat", "--num-speculative-tokens", "0"]
        code, text = invoke("validate", *common, "--estimate")
        assert code == 0, text
        assert (
            "prompt lengths (tokens) of 1,200 usable rows" in text and "rows that will be errors: 0" in text
        )
        assert "--max-num-seqs" in text and "--max-num-batched-tokens" in text  # the table of other settings
        estimated = _seconds(text)
        spec = make_spec(
            input=[str(data)],
            output=str(out),
            model=str(tiny_model_dir),
            max_new_tokens=24,
            chat=False,
            num_speculative_tokens=0,
        )
        actual = run_job(spec).stats["elapsed_s"]
        tries.append((estimated, actual))
        if actual / 2 <= estimated <= actual * 2:
            return
    raise AssertionError(f"estimated vs actual seconds, each try: {tries}")


def test_progress_lines_in_a_log(launch, reviews, tiny_model_dir, tmp_path):
    proc = launch(args(reviews, tmp_path / "out", tiny_model_dir), BATCHJOB_PROGRESS_SECONDS="0")
    text = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, text
    lines = re.findall(
        r"^batchjob: [\d,]+ of 122 rows \([\d.]+%\), [\d.]+ rows/s, [\d.]+ tok/s, \d+ errors.*$", text, re.M
    )
    assert len(lines) > 2, text
    assert "ETA" in lines[-1]
    assert "\r" not in text  # no bar drawn into a log


def test_progress_eta_is_withheld_until_rows_finish_then_right(monkeypatch):
    """The first progress line's ETA was far off: rows finish only after their whole answer (and on a GPU the
    first steps compile kernels), so a rate from the start is too slow. Simulated clock: 60 s of warm-up,
    then 10 rows/s; the ETA is withheld until a batch of rows has finished, then right within 10%."""
    from batchjob.job import progress

    now = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(progress.sys.stderr, "isatty", lambda: False)
    bar = progress.Progress(total=10_000, done=0, errors=0, warmup=16)
    now[0] += 60  # warm-up: nothing finishes
    assert "ETA after the first 16 rows" in bar.line()
    for i in range(300):  # then 10 rows/s
        now[0] += 0.1
        bar.row(False)
        if i == 10:
            assert "ETA after the first 16 rows" in bar.line()  # not yet a batch of rows
    true_left = (10_000 - 300) / 10
    eta = re.search(r"ETA ([\d.]+) (s|min|h)", bar.line())
    assert eta, bar.line()
    shown = float(eta.group(1)) * {"s": 1, "min": 60, "h": 3600}[eta.group(2)]
    assert abs(shown - true_left) <= 0.1 * true_left, (bar.line(), true_left)  # from the start: 3x too long
    for _ in range(9_700):
        now[0] += 0.1
        bar.row(False)
    assert bar.line().endswith("ETA 0 s")


@pytest.mark.engine  # renders plots with matplotlib: seconds, not the unit tier's inner loop
def test_text_in_plots_is_drawn_as_given():
    """Labels and folder names with matplotlib's math markup ($...$, bad math too) are drawn as text."""
    from collections import Counter
    from pathlib import Path

    from batchjob.job.report import Outputs, job_figures
    from batchjob.job.status import JobStatus

    outputs = Outputs(labels=Counter({r"$\frac{$": 3, "a$b$c": 2}), finish_reasons=Counter({"$x^$": 2}))
    figs = job_figures(JobStatus(Path("out"), [], None), outputs, r"out$\alpha_{$")
    assert {f.key for f in figs} == {"labels", "finish_reasons"}


def test_report_of_a_folder_with_math_in_its_name_and_torn_stats(reviews, tiny_model_dir, tmp_path):
    out = tmp_path / r"run$\alpha_{$"
    code, text = invoke("run", *args(reviews, out, tiny_model_dir, "--choices", r"$\frac{$,b$ad$,meh"))
    assert code == 0, text
    code, text = invoke("report", out, out, "--to", tmp_path / "r.html")
    assert code == 0 and "Traceback" not in text, text
    assert {"labels", "occupancy"} <= set(figures((tmp_path / "r.html").read_text()))
    # a torn stats.json (derived data) costs the statistics only, as in `run`, which rewrites it
    stats = out / "_batchjob" / "stats.json"
    stats.write_bytes(stats.read_bytes()[:50])
    code, text = invoke("status", out)
    assert code == 0 and "complete" in text and "rows: 122 of 122" in text, text
    assert f"stats: {stats} is torn" in text and "unavailable until the next `batchjob run`" in text
    assert "restore" not in text
    code, text = invoke("report", out)
    assert code == 0 and "unavailable until the next" in (out / "_batchjob" / "report.html").read_text()
    code, text = invoke("run", *args(reviews, out, tiny_model_dir, "--choices", r"$\frac{$,b$ad$,meh"))
    assert code == 0 and "already complete" in text, text


def test_a_progress_interval_that_is_not_a_number_is_the_default(monkeypatch, capsys):
    """BATCHJOB_PROGRESS_SECONDS=abc stopped the job with a traceback."""
    from batchjob.job import progress

    monkeypatch.setenv("BATCHJOB_PROGRESS_SECONDS", "abc")
    bar = progress.Progress(total=10, done=0, errors=0)
    assert (
        bar.every == 30.0
        and "BATCHJOB_PROGRESS_SECONDS='abc' is not a number of seconds" in capsys.readouterr().err
    )


def test_histogram_bars_are_labelled_with_their_bins_start(monkeypatch):
    """Ten 150 ms latencies sat under the bar labelled "1.6e+02 ms" (the bin's end, 158.5 ms, in .2g) while
    the axis said the bars were labelled with their bins' start, 125.9 ms; the last two bars had one label."""
    from batchjob.job import report
    from batchjob.job.stats import HIST_EDGES, Histogram

    drawn = {}  # label -> bar height, as handed to matplotlib (a PNG's tick labels can't be read back)
    monkeypatch.setattr(
        report,
        "_bar_figure",
        lambda key, title, labels, values, xlabel="": drawn.update(zip(labels, values, strict=True)),
    )
    latency = Histogram()
    for x in [0.15] * 10 + [0.0005, 2e5]:  # under the first edge, and over the last
        latency.add(x)
    report._histogram_figure("latency", "latency", latency.counts)
    assert drawn["126 ms"] == 10 and drawn["158 ms"] == 0  # [125.9, 158.5) ms holds 150 ms
    assert drawn["< 1 ms"] == 1 and drawn["27.8 h"] == 1 and drawn["22.1 h"] == 0  # 100,000 s and up
    assert len(drawn) == len(HIST_EDGES) + 1  # a label for each bin, none twice
    assert not any("e+" in label or "e-" in label for label in drawn)


def test_report_of_an_n_job_counts_each_prompt_once_and_says_whose_times(reviews, tiny_model_dir, tmp_path):
    """--n 3: the prompt-length histogram counted each prompt three times (360 prompts for 120 rows), the
    summary had no samples line (status has), and the times' histograms, of the last run only, did not say so
    beside length figures of every committed row."""
    from batchjob.job.report_rows import read_outputs

    out = tmp_path / "out"
    code, text = invoke("run", *args(reviews, out, tiny_model_dir, "--n", "3", "--temperature", "0.8"))
    assert code == 0, text
    outputs = read_outputs(out, False, "rid")
    assert sum(outputs.prompt_lengths) == 120 and sum(outputs.output_lengths) == 360  # 2 rows are errors
    code, text = invoke("report", out)
    assert code == 0, text
    page = (out / "_batchjob" / "report.html").read_text()
    assert "<br>samples: 362 result rows (2.96721 a row)<br>" in page  # status's line, in the summary
    titles = dict(re.findall(r'<figure id="(\w+)"><img alt="([^"]*)"', page))
    assert titles["prompt_lengths"] == "prompt lengths"
    for key in ("queue_wait", "ttft", "latency"):
        assert titles[key].endswith(" (last run)"), titles
