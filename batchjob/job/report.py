"""``batchjob report``: one self-contained HTML page of plots about a job, to look at rather than read.

It draws what the job's state already holds: each worker's ``stats.json`` (its last run's timeline of batch
occupancy, tokens, KV blocks in use and preemptions, and histograms of queue wait, time to first token and
latency) and the committed parts (prompt and output lengths, finish reasons, errors by kind with example rows,
and for a ``--choices`` job the labels), read a batch at a time. It reads what is committed, so it works on a
job that is running or was killed. Given two jobs (a static-batching run and a continuous one of the same
data, say), it draws their occupancy and throughput side by side. Images are embedded PNGs: the page opens
offline. Needs matplotlib (``pip install 'batchjob[report]'``).
"""

from __future__ import annotations

import base64
import html
import io
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchjob.errors import ConfigError
from batchjob.job.adapter_counts import adapter_label
from batchjob.job.owned import check_target
from batchjob.job.report_rows import LENGTH_EDGES, Outputs, read_outputs
from batchjob.job.state import STATE_DIR, StateDir
from batchjob.job.stats import HIST_EDGES
from batchjob.job.status import JobStatus, job_status
from batchjob.job.verify import REDO

# -- figures ----------------------------------------------------------------------------------------------


def _plt() -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise ConfigError("batchjob report draws with matplotlib: pip install 'batchjob[report]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plain_text() -> Any:
    """Around drawing: every text is drawn as given. Titles and tick labels carry a folder's name or a
    job's labels, and matplotlib would read ``$...$`` in them as math (and fail on bad math) or ``\\`` as
    TeX."""
    return _plt().rc_context({"text.parse_math": False, "text.usetex": False})


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    _plt().close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _timeline(stats: dict[str, Any]) -> tuple[list[str], list[list[float]]]:
    t = stats.get("timeline") or {}
    return t.get("fields") or [], t.get("points") or []


def _series(stats: dict[str, Any], name: str) -> tuple[list[float], list[float]]:
    fields, points = _timeline(stats)
    if name not in fields:
        return [], []
    i = fields.index(name)
    pts = [p for p in points if len(p) > i]
    return [p[0] for p in pts], [p[i] for p in pts]


def _rate(ts: list[float], cum: list[float], points: int = 60) -> tuple[list[float], list[float]]:
    """The rise per second of a cumulative series, over windows of about 1/``points`` of the run (a step's
    own rate is too jumpy to read)."""
    if len(ts) < 2:
        return [], []
    k = max(1, len(ts) // points)
    xs, ys = [], []
    for i in range(k, len(ts), k):
        dt = ts[i] - ts[i - k]
        if dt > 0:
            xs.append(ts[i])
            ys.append((cum[i] - cum[i - k]) / dt)
    return xs, ys


@dataclass
class Figure:
    key: str
    title: str
    png: str


def _line_figure(
    key: str, title: str, ylabel: str, curves: list[tuple[str, list[float], list[float]]]
) -> Figure | None:
    curves = [c for c in curves if c[1]]
    if not curves:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.0))
    for label, xs, ys in curves:
        ax.plot(xs, ys, label=label, linewidth=1.2)
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if len(curves) > 1:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return Figure(key, title, _png(fig))


def _bar_figure(
    key: str, title: str, labels: list[str], values: list[float], xlabel: str = ""
) -> Figure | None:
    if not labels or not any(values):
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.0))
    ax.bar(range(len(labels)), values, color="#4c72b0")
    ax.set_xticks(range(len(labels)), labels, rotation=45 if len(labels) > 6 else 0, ha="right", fontsize=7)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("rows")
    ax.grid(alpha=0.3, axis="y")
    return Figure(key, title, _png(fig))


def _plain_number(x: float) -> str:
    """``x`` to three significant figures, written out (126, 12.6, 1.26; never 1.3e+02)."""
    digits = 0 if x >= 100 else 1 if x >= 10 else 2
    text = f"{x:.{digits}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _seconds_label(x: float) -> str:
    if x < 1:
        return f"{_plain_number(x * 1000)} ms"
    if x < 100:
        return f"{_plain_number(x)} s"
    return f"{_plain_number(x / 60)} min" if x < 6000 else f"{_plain_number(x / 3600)} h"


def _histogram_figure(key: str, title: str, counts: list[int]) -> Figure | None:
    """A histogram of ``stats.Histogram`` counts: bin 0 holds the times under ``HIST_EDGES[0]``, bin i >= 1
    those in [``HIST_EDGES[i - 1]``, ``HIST_EDGES[i]``) (the last, everything from the last edge up), so a
    bar is labelled with the start of its bin."""
    if not any(counts):
        return None
    first = next(i for i, c in enumerate(counts) if c)
    last = max(i for i, c in enumerate(counts) if c)
    lo, hi = max(0, first - 1), min(len(counts), last + 2)
    labels = [
        f"< {_seconds_label(HIST_EDGES[0])}" if i == 0 else _seconds_label(HIST_EDGES[i - 1])
        for i in range(lo, hi)
    ]
    return _bar_figure(key, title, labels, counts[lo:hi], "time (each bar: its bin's start)")


def _sum_histograms(workers: list[dict[str, Any]], name: str) -> list[int]:
    total = [0] * (len(HIST_EDGES) + 1)
    for stats in workers:
        h = (stats.get("histograms") or {}).get(name) or {}
        for i, c in enumerate(h.get("counts") or []):
            if i < len(total):
                total[i] += c
    return total


def job_figures(st: JobStatus, outputs: Outputs, label: str = "") -> list[Figure]:
    """Every figure of one job (``label`` prefixes the titles when two jobs are compared)."""
    with _plain_text():
        return _job_figures(st, outputs, label)


def _job_figures(st: JobStatus, outputs: Outputs, label: str) -> list[Figure]:
    runs = [
        (f"shard {w.shard.index}" if len(st.workers) > 1 else "this job", w.stats)
        for w in st.workers
        if w.stats
    ]
    pre = f"{label}: " if label else ""
    figs = _run_figures(runs, pre) + _histogram_figures([s for _, s in runs], pre)
    figs += _output_figures(outputs, pre)
    return [f for f in figs if f is not None]


def _run_figures(runs: list[tuple[str, dict[str, Any]]], pre: str) -> list[Figure | None]:
    """The runs' timelines (a curve per worker): occupancy, throughput, KV cache in use, preemptions."""
    figs: list[Figure | None] = []
    figs.append(
        _line_figure(
            "occupancy",
            f"{pre}batch occupancy (running requests / max_num_seqs)",
            "occupancy",
            [(name, *_series(s, "occupancy")) for name, s in runs],
        )
    )
    curves = []
    for name, s in runs:
        ts, gen = _series(s, "generated_tokens")
        curves.append((f"{name} generated", *_rate(ts, gen)))
        ts, prompt = _series(s, "prompt_tokens")
        curves.append((f"{name} prompt", *_rate(ts, prompt)))
    figs.append(_line_figure("throughput", f"{pre}tokens per second", "tokens/s", curves))
    figs.append(
        _line_figure(
            "kv", f"{pre}KV cache in use", "share of blocks", [(n, *_series(s, "kv_used")) for n, s in runs]
        )
    )
    figs.append(
        _line_figure(
            "preemptions",
            f"{pre}preemptions (cumulative)",
            "preemptions",
            [(n, *_series(s, "preemptions")) for n, s in runs],
        )
    )
    return figs


def _histogram_figures(stats: list[dict[str, Any]], pre: str) -> list[Figure | None]:
    """The requests' times, over every worker: queue wait, time to first token, latency. Each run's stats
    hold its own requests only, so the titles say whose (the length figures count every committed row)."""
    runs = "last run" if len(stats) <= 1 else "workers' last runs"
    return [
        _histogram_figure("queue_wait", f"{pre}queue wait ({runs})", _sum_histograms(stats, "queue_wait_s")),
        _histogram_figure("ttft", f"{pre}time to first token ({runs})", _sum_histograms(stats, "ttft_s")),
        _histogram_figure(
            "latency",
            f"{pre}latency, request added to finished ({runs})",
            _sum_histograms(stats, "latency_s"),
        ),
    ]


def _trimmed_lengths(counts: list[int]) -> tuple[list[str], list[int]]:
    """A length histogram's labels and counts, from its first used bin to its last."""
    length_labels = [f"{LENGTH_EDGES[i]}-{LENGTH_EDGES[i + 1] - 1}" for i in range(len(LENGTH_EDGES) - 2)]
    length_labels.append(f">= {LENGTH_EDGES[-2]}")
    used = [i for i, c in enumerate(counts) if c]
    if not used:
        return [], []
    return length_labels[used[0] : used[-1] + 1], counts[used[0] : used[-1] + 1]


def _output_figures(outputs: Outputs, pre: str) -> list[Figure | None]:
    """What the result rows hold: prompt and output lengths, finish reasons, labels (``choices``)."""
    figs: list[Figure | None] = []
    for key, what, counts in (
        ("prompt_lengths", "prompt lengths", outputs.prompt_lengths),
        ("output_lengths", "output lengths", outputs.output_lengths),
    ):
        figs.append(_bar_figure(key, f"{pre}{what}", *_trimmed_lengths(counts), "tokens"))
    reasons = outputs.finish_reasons.most_common()
    figs.append(
        _bar_figure(
            "finish_reasons", f"{pre}finish reasons", [r for r, _ in reasons], [c for _, c in reasons]
        )
    )
    if outputs.labels:
        labels = outputs.labels.most_common(30)
        figs.append(_bar_figure("labels", f"{pre}labels", [k for k, _ in labels], [c for _, c in labels]))
    return figs


# -- the page ---------------------------------------------------------------------------------------------


def _img(fig: Figure) -> str:
    return (
        f'<figure id="{fig.key}"><img alt="{html.escape(fig.title)}" src="data:image/png;base64,{fig.png}">'
        f"<figcaption>{html.escape(fig.title)}</figcaption></figure>"
    )


def _summary(out_dir: Path, st: JobStatus, outputs: Outputs) -> str:
    done, total = st.total("rows_done"), st.rows_total
    state = "complete" if st.complete else "incomplete (a running or stopped job: what is committed so far)"
    lines = [
        f"<b>{html.escape(str(out_dir))}</b>: {state}",
        f"rows: {done:,} of {total:,}" if total is not None else f"rows: {done:,} of unknown",
        *[line for line in [st.samples_line()] if line],  # --n: the result rows, as status says
        f"errors: {st.total('errors'):,}; {st.tokens_line()}",  # status's: a prefill-only task's tokens read
        f"throughput (workers' last runs, summed): {st.throughput()}; workers: {len(st.workers)}",
    ]
    if st.rate("images_per_s"):  # an image job (--image-column): images/s beside tokens/s
        lines.append(f"images/s (workers' last runs, summed): {st.rate('images_per_s'):.2f}")
    return "<p>" + "<br>".join(lines) + "</p>"


def _adapters_table(st: JobStatus) -> str:
    """Per adapter (``batchjob status``'s counts): rows, errors, tokens, and its generated tokens/s in the
    workers' last runs, as each run counted them by adapter (a prefill-only task's: the tokens read/s). A run
    that did not count them (its stats.json is older than that count) leaves the column out: sharing out the
    job's rate by the committed tokens would credit adapters that did not run."""
    key, what = "generated_tokens_per_s", "generated tokens/s"
    if st.task != "generate":
        key, what = "total_tokens_per_s", "tokens read/s"
    rates = _adapter_rates(st, key)
    rows = [
        f"<tr><td>{html.escape(adapter_label(name))}</td><td>{c.rows:,}</td><td>{c.errors:,}</td>"
        f"<td>{c.prompt_tokens:,}</td><td>{c.generated_tokens:,}</td>"
        + (f"<td>{rates.get(name, 0.0):.1f}</td>" if rates is not None else "")
        + "</tr>"
        for name, c in st.adapters.items()
    ]
    head = "<tr><th>adapter</th><th>rows</th><th>errors</th><th>prompt tokens</th><th>generated tokens</th>"
    head += f"<th>{what} (last run)</th></tr>" if rates is not None else "</tr>"
    table = '<table id="adapters">' + head + "".join(rows) + "</table>"
    if rates is None:
        table += (
            f"<p>No {what} by adapter: the last run's stats.json does not count tokens by adapter "
            "(written by an older batchjob); the next `batchjob run` writes them.</p>"
        )
    return table


def _adapter_rates(st: JobStatus, key: str) -> dict[str, float] | None:
    """Each adapter's ``key`` rate summed over the workers' last runs (an adapter a run did not run: 0), or
    None when a run's stats do not have them."""
    rates: dict[str, float] = {}
    for w in st.last_runs:
        if not w.stats:  # not run yet: nothing to add
            continue
        adapters = w.stats.get("adapters")
        if not isinstance(adapters, dict):
            return None
        for name, figures in adapters.items():
            rates[name] = rates.get(name, 0.0) + float(figures.get(key, 0) or 0)
    return rates


def _errors_table(outputs: Outputs) -> str:
    if not outputs.errors:
        return "<p>No error rows.</p>"
    rows = []
    for kind, n in outputs.errors.most_common(20):
        examples = "<br>".join(
            f"<code>{html.escape(i)}</code> {html.escape(m)}" if i else html.escape(m)
            for i, m in outputs.error_examples.get(kind, [])
        )
        rows.append(f"<tr><td>{n:,}</td><td>{html.escape(kind)}</td><td>{examples}</td></tr>")
    return (
        '<table id="errors"><tr><th>rows</th><th>kind</th><th>examples (id, message)</th></tr>'
        + "".join(rows)
        + "</table>"
    )


_STYLE = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222}figure{display:inline-block;margin:.5em}
img{max-width:100%}figcaption{font-size:.8em;color:#555}table{border-collapse:collapse;font-size:.85em}
td,th{border:1px solid #ccc;padding:.3em .6em;vertical-align:top}.pair{display:grid;grid-template-columns:1fr 1fr;gap:1em}
"""


def build(out_dirs: list[Path], to: Path | None = None) -> Path:
    """Write the report of one job, or two side by side; returns the file's path."""
    if not 1 <= len(out_dirs) <= 2:
        raise ConfigError("batchjob report takes one output folder, or two to compare")
    default = out_dirs[0] / STATE_DIR / "report.html"
    if to is not None:
        check_target(to, "--to", out_dirs, allowed=default)
    jobs = [_read_job(out_dir) for out_dir in out_dirs]
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>batchjob report</title><style>{_STYLE}</style></head><body>"
    ]
    parts.append("<h1>batchjob report</h1>")
    if len(jobs) == 2:
        parts.append("<h2>Side by side</h2><div class='pair'>")
        for out_dir, st, outputs in jobs:
            figs = {f.key: f for f in job_figures(st, outputs, out_dir.name)}
            parts.append("<div>" + _summary(out_dir, st, outputs))
            parts += [_img(figs[k]) for k in ("occupancy", "throughput") if k in figs]
            parts.append("</div>")
        parts.append("</div>")
    for out_dir, st, outputs in jobs:
        parts += _job_section(out_dir, st, outputs)
    parts.append("</body></html>")
    target = to or default
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("".join(parts), encoding="utf-8")
    return target


def _read_job(out_dir: Path) -> tuple[Path, JobStatus, Outputs]:
    """A job's status and result rows (the parts it can vouch for), saying on stderr what is not drawn."""
    st = job_status(out_dir)
    info = StateDir(out_dir).load_job()
    choices = "choices" in (info.fingerprint.get("sampling") or {})
    id_column = (info.fingerprint.get("prompt") or {}).get("id_column")
    damaged = {p.record.name for p in st.problems}
    for p in st.problems:
        print(f"batchjob: {out_dir}: missing or damaged, not drawn: {p}; {REDO}", file=sys.stderr)
    for w in st.workers:
        if w.stats_problem:
            print(f"batchjob: {w.stats_problem}", file=sys.stderr)
    return out_dir, st, read_outputs(out_dir, choices, id_column, damaged)


def _job_section(out_dir: Path, st: JobStatus, outputs: Outputs) -> list[str]:
    """One job's part of the page: summary, warnings, figures, errors, and its workers when several."""
    parts = [f"<h2>{html.escape(str(out_dir))}</h2>" + _summary(out_dir, st, outputs)]
    for w in st.workers:
        if w.stats_problem:
            parts.append(f"<p class='warn'>{html.escape(w.stats_problem)}</p>")
    if st.problems:
        missing = "".join(f"<li>{html.escape(str(p))}</li>" for p in st.problems)
        parts.append(
            f"<p class='warn'>Missing or damaged parts, not drawn ({html.escape(REDO)}):</p><ul>{missing}</ul>"
        )
    if not any(w.stats for w in st.workers):
        parts.append("<p>No run statistics yet (stats.json is written at the first checkpoint).</p>")
    parts += [_img(f) for f in job_figures(st, outputs)]
    parts.append("<h3>Errors by kind</h3>" + _errors_table(outputs))
    if st.adapters:
        parts.append("<h3>LoRA adapters</h3>" + _adapters_table(st))
    if len(st.workers) > 1:
        parts.append(
            "<h3>Workers</h3><table><tr><th>worker</th><th>state</th><th>rows</th><th>errors</th></tr>"
        )
        for w in st.workers:
            share = w.rows_total if w.rows_total is not None else "?"
            parts.append(
                f"<tr><td>{w.shard}</td><td>{w.state}</td><td>{w.rows_done} of {share}</td><td>{w.errors}</td></tr>"
            )
        parts.append("</table>")
    return parts
