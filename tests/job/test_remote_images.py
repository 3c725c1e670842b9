"""Remote images (--allow-remote-images) over a real HTTP server on 127.0.0.1 (a thread of this process):
rows whose images come over http equal the rows over the same files' paths, token for token; a 404, a
refused connection and a timeout are error rows naming the URL; without the flag each is an error row
saying to pass it; the fetched bytes are the job's identity (a changed one refuses the resume); a protocol
whose package is missing refuses the job before any work; OpenAI image_url parts over http too."""

from __future__ import annotations

import functools
import http.server
import json
import socket
import threading
import time

import pytest

from tests.job.test_images import MAX_NEW, _args
from tests.jobproc import read_results, run_here
from tests.tiers import engine_fixture
from tests.vision_models import make_image, make_llava

pytestmark = pytest.mark.timeout(600)


@engine_fixture(scope="module")
def llava(tmp_path_factory):
    return make_llava(tmp_path_factory.mktemp("llava") / "llava")


class _Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # quiet
        pass

    def do_GET(self):
        if self.path.startswith("/slow/"):
            time.sleep(3)  # longer than the test's fetch timeout
        return super().do_GET()


@pytest.fixture
def server(tmp_path):
    """An HTTP server over ``tmp_path / "site"``: its base URL."""
    site = tmp_path / "site"
    (site / "imgs").mkdir(parents=True)
    handler = functools.partial(_Handler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _refused_url() -> str:
    """A URL on a port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/a.png"


def _write(path, cells):
    with open(path, "w") as f:
        for rid, image in cells.items():
            f.write(json.dumps({"rid": rid, "prompt": "What is it?", "image": image}) + "\n")


def _tokens(row):
    return [t["token_id"] for t in row["logprobs"]]


def test_http_rows_equal_path_rows_and_failures_are_error_rows(llava, server, tmp_path, monkeypatch):
    from batchjob.job import remote_images

    monkeypatch.setattr(remote_images, "TIMEOUT_S", 1.0)
    site = tmp_path / "site"
    make_image(7).save(site / "imgs" / "a.png")
    make_image(8, (30, 18)).save(site / "imgs" / "b.png")
    make_image(9).save(site / "slow.png")
    (site / "slow").mkdir()
    make_image(9).save(site / "slow" / "c.png")
    _write(
        tmp_path / "paths.jsonl", {"one": "site/imgs/a.png", "two": ["site/imgs/b.png", "site/imgs/a.png"]}
    )
    remote = {
        "one": f"{server}/imgs/a.png",
        "two": [f"{server}/imgs/b.png", f"{server}/imgs/a.png"],
        "missing": f"{server}/imgs/nope.png",
        "refused": _refused_url(),
        "slow": f"{server}/slow/c.png",
    }
    _write(tmp_path / "remote.jsonl", remote)

    code, output = run_here(_args(tmp_path / "paths.jsonl", tmp_path / "by_path", llava))
    assert code == 0, output
    by_path = {r["rid"]: r for r in read_results(tmp_path / "by_path")}
    args = _args(tmp_path / "remote.jsonl", tmp_path / "out", llava, "--allow-remote-images")
    code, output = run_here(args)
    assert code == 0, output
    got = {r["rid"]: r for r in read_results(tmp_path / "out")}
    for rid in ("one", "two"):
        assert got[rid]["error"] is None, got[rid]["error"]
        assert _tokens(got[rid]) == _tokens(by_path[rid]) and len(_tokens(got[rid])) == MAX_NEW, rid
    assert (
        f"image 0 ({remote['missing']}): cannot be fetched: HTTP 404 File not found"
        in got["missing"]["error"]
    )
    assert f"image 0 ({remote['refused']}): cannot be fetched (" in got["refused"]["error"]
    assert f"image 0 ({remote['slow']}): cannot be fetched (timed out" in got["slow"]["error"]
    from batchjob.io.atomic import read_json

    recorded = read_json(tmp_path / "out" / "_batchjob" / "images.json")["images"]
    assert recorded[f"{server}/imgs/a.png"] is not None and recorded[remote["missing"]] is None

    # resumed without the flag: refused (its remaining rows would differ); a changed image: refused, named
    code, output = run_here(_args(tmp_path / "remote.jsonl", tmp_path / "out", llava))
    assert code == 2 and "pass --allow-remote-images to resume it" in output, output
    make_image(1).save(site / "imgs" / "b.png")
    code, output = run_here(args)
    assert code == 2 and f"{server}/imgs/b.png: its bytes changed" in output, output


def test_without_the_flag_a_url_is_an_error_row(llava, server, tmp_path):
    make_image(7).save(tmp_path / "site" / "imgs" / "a.png")
    _write(tmp_path / "in.jsonl", {"url": f"{server}/imgs/a.png", "text": None})
    code, output = run_here(_args(tmp_path / "in.jsonl", tmp_path / "out", llava))
    assert code == 0, output
    got = {r["rid"]: r for r in read_results(tmp_path / "out")}
    assert got["text"]["error"] is None
    assert "pass --allow-remote-images to fetch it" in got["url"]["error"], got["url"]["error"]


def test_a_protocol_without_its_package_is_refused_before_work(llava, tmp_path):
    import importlib.util

    if importlib.util.find_spec("s3fs") is not None:
        pytest.skip("s3fs is installed here")
    _write(tmp_path / "in.jsonl", {"a": "s3://bucket/a.png"})
    code, output = run_here(_args(tmp_path / "in.jsonl", tmp_path / "out", llava, "--allow-remote-images"))
    assert code == 2, output
    assert "the s3:// images need a package" in output and "s3fs" in output, output
    assert not (tmp_path / "out" / "_batchjob" / "manifest.jsonl").exists()


def test_validate_fetches_and_names_what_fails(llava, server, tmp_path):
    from click.testing import CliRunner

    from batchjob.cli import main

    make_image(7).save(tmp_path / "site" / "imgs" / "a.png")
    _write(tmp_path / "in.jsonl", {"a": f"{server}/imgs/a.png", "b": f"{server}/gone.png"})
    args = ["validate", *_args(tmp_path / "in.jsonl", tmp_path / "out", llava, "--allow-remote-images")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "images: 1 of 2 can't be opened" in result.output
    assert f"in.jsonl line 2: image column 'image': image 0 ({server}/gone.png): cannot be fetched" in (
        result.output
    )


def test_openai_image_url_over_http(llava, server, tmp_path):
    """An OpenAI request's image_url part over http equals the same request with the file's path."""
    make_image(6).save(tmp_path / "site" / "six.png")

    def line(cid, url):
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "And this?"}]
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": MAX_NEW, "temperature": 0}
        return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body})

    lines = [line("path", "site/six.png"), line("http", f"{server}/six.png"), line("gone", f"{server}/x.png")]
    (tmp_path / "requests.jsonl").write_text("\n".join(lines) + "\n")
    args = ["--input", tmp_path / "requests.jsonl", "--output", tmp_path / "out", "--model", llava]
    args += ["--format", "openai", "--dtype", "float64", "--logprobs", "0", "--allow-remote-images"]
    code, output = run_here(args)
    assert code == 0, output
    import pyarrow.dataset as ds

    got = {r["custom_id"]: r for r in ds.dataset(tmp_path / "out", format="parquet").to_table().to_pylist()}
    assert got["path"]["error"] is None and got["http"]["error"] is None, got["http"]["error"]
    assert _tokens(got["http"]) == _tokens(got["path"])
    assert f"image 0 ({server}/x.png): cannot be fetched: HTTP 404" in got["gone"]["error"]
