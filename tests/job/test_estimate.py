"""`validate --estimate` on short-output (labeling) jobs: the engine steps it counts cover the steps a run
takes, its calibration times enough steps to fit, and the job's own work on each row is counted. Counts, not
wall times: the machine is shared, and a timed assertion would be flaky."""

from __future__ import annotations

import json

import pytest

from batchjob.job import make_spec, run_job
from batchjob.job.calibration import MIN_STEPS, Calibration
from batchjob.job.estimate import Estimate, estimate
from batchjob.job.prepare import prepare
from batchjob.job.runner import load_engine

pytestmark = pytest.mark.timeout(300)


def _rows(path, n, words=25):
    with open(path, "w") as f:
        for i in range(n):
            f.write(
                json.dumps({"id": f"r{i}", "text": f"review {i} " + "good bad " * (1 + i % words)}) + "\n"
            )
    return path


def _spec(data, out, model, **options):
    return make_spec(input=[str(data)], output=str(out), model=str(model), id_column="id", **options)


def test_a_choices_jobs_estimate_counts_the_steps_its_scoring_requests_take(tiny_model_dir, tmp_path):
    """Each choices row holds a seat for more steps than its two output tokens (a scoring request per trie
    node its decoding did not see, its prompt's chunks): 300 short rows (too short for the step's token budget
    to bound them) ran 24 steps, and the estimate counted 12.7 (it took a row's seats to be its output tokens),
    so 3,000 rows were estimated at 2 s and ran 6.2-7.2 s."""
    data = _rows(tmp_path / "rows.jsonl", 300, words=3)
    options = {"choices": ["positive", "negative", "neutral"], "num_speculative_tokens": 0}
    est = estimate(prepare(_spec(data, tmp_path / "est", tiny_model_dir, **options)), seconds=20.0)
    spec = _spec(data, tmp_path / "run", tiny_model_dir, **options)
    engine = load_engine(spec)
    try:
        run_job(spec, engine=engine)
        ran = engine.stats.steps
    finally:
        engine.close()
    assert est.calibration.extra_seat_steps > 0
    assert est.steps(est.calibration) >= 0.8 * ran, (est.steps(est.calibration), ran)


def test_a_short_output_jobs_calibration_times_enough_steps(tiny_model_dir, tmp_path):
    """Rows of two output tokens: the first 64 finished in three steps, and a fit of a step's cost over two
    of them put 0.006 ms on a prompt token that cost 0.012 (3,000 rows estimated at 2 s ran 3.8-6.3 s). The
    calibration goes on feeding rows, as the job loop does, until it has timed enough steps."""
    data = _rows(tmp_path / "rows.jsonl", 2000)
    spec = _spec(data, tmp_path / "est", tiny_model_dir, max_new_tokens=2, num_speculative_tokens=0)
    est = estimate(prepare(spec), seconds=20.0)
    assert est.calibration.steps_timed >= MIN_STEPS, est.calibration
    assert est.calibration.rows > 64
    # the job's own work on a row (reading, building its prompt, writing its result) is in the time
    assert est.row_seconds > 0
    c = est.calibration
    assert est.seconds(c) >= c.job_seconds(*est._job(2000)) + 2000 * est.row_seconds


def test_an_estimate_under_a_second_says_so():
    """300 rows estimated at 0.4 s printed `estimated time: 0 s` for a run of 1.0-1.5 s."""
    c = Calibration("s", 64, 0.1, 64, 64, 0.001, 1e-7, 1e-7, max_num_seqs=64, budget=2048)
    text = "\n".join(Estimate(300, 300, [10] * 300, 0, 0, 1024, 300, 300, c, []).lines())
    assert "estimated time: under 1 s" in text, text
