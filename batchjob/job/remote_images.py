"""Remote images (``--allow-remote-images``): an image named by a URL (``http(s)://``, or any protocol the
installed fsspec has: ``s3://``, ``gs://``, ``hf://``, each with its own package) read through
``fsspec.open``, with a timeout and a bound on its bytes; without the flag such an image is its row's error.

Each URL is fetched once a run, when the job starts (``prefetch``, on a few threads): its SHA-256 is its
identity in the job's record (``images.json``), as a path's is, and its bytes are kept in memory for its
rows up to ``KEEP_BYTES`` (past that a row fetches it again, and bytes that differ from the recorded ones
stop the job as a changed file does). A fetch that fails is that URL's rows' error, naming the URL and why;
a protocol whose package is missing refuses the job before any work, naming the package.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from batchjob.errors import ConfigError

SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
TIMEOUT_S = 30.0  # a fetch that takes longer (connecting and reading) fails: its rows' error
KEEP_BYTES = 256 * 2**20  # fetched bytes held for their rows (the rest fetched again when their row is read)
THREADS = 8  # fetches at once when the job starts
NOT_ALLOWED = "a remote image: pass --allow-remote-images to fetch it (or give the bytes or a local path)"
INSTALL = "pip install 'batchjob[images]'"


def scheme(path: str) -> str | None:
    """The protocol of a remote URL (``https``, ``s3``, ...), None for a local path or ``file://``."""
    m = SCHEME.match(path)
    name = m.group(1).lower() if m else None
    return None if name in (None, "file") else name


def check_protocols(protocols: Iterable[str]) -> None:
    """Before any work: fsspec is installed, and so is each protocol's package (a ``ConfigError`` naming
    it). A protocol fsspec does not know is left to its rows' errors (it may be a local name)."""
    protocols = sorted(set(protocols))
    if not protocols:
        return
    try:
        import fsspec
    except ImportError:
        raise ConfigError(f"--allow-remote-images reads images through fsspec: {INSTALL}") from None
    for name in protocols:
        try:
            fsspec.get_filesystem_class(name)
        except ImportError as e:
            raise ConfigError(
                f"--allow-remote-images: the {name}:// images need a package fsspec reads them with "
                f"({e}); install it, or give the images as bytes or local paths"
            ) from None
        except ValueError:
            continue


def _options(name: str) -> dict[str, Any]:
    """fsspec's options for a protocol: http(s) streamed (no range requests) under ``TIMEOUT_S``."""
    if name in ("http", "https"):
        import aiohttp

        return {"block_size": 0, "client_kwargs": {"timeout": aiohttp.ClientTimeout(total=TIMEOUT_S)}}
    return {}


def _why(e: BaseException) -> str:
    """A failed fetch in a few words: fsspec's http reports a refused connection as FileNotFoundError from
    the client's error, so the cause is what is named."""
    cause = e.__cause__ or e
    if isinstance(cause, TimeoutError):
        return f"cannot be fetched (timed out after {TIMEOUT_S:g} s)"
    status = getattr(cause, "status", None)  # aiohttp's ClientResponseError
    if isinstance(status, int):
        return f"cannot be fetched: HTTP {status} {getattr(cause, 'message', '')}".rstrip()[:1000]
    if isinstance(e, FileNotFoundError) and cause is e:
        return "cannot be fetched: not found (no such object)"
    return f"cannot be fetched ({type(cause).__name__}: {cause})"[:1000]


class RemoteImages:
    """A run's remote images: fetched, bounded, kept for their rows. Safe to call from several threads."""

    def __init__(self, max_pixels: int) -> None:
        # a file with more bytes than 4 a pixel of --max-image-pixels (and 1 MiB) is not read whole
        self.limit = 4 * int(max_pixels) + 2**20
        self.kept: dict[str, bytes] = {}
        self.kept_bytes = 0
        self.lock = threading.Lock()

    def fetch(self, url: str) -> tuple[bytes | None, str | None]:
        """The URL's bytes, read now, or why not (not found, refused, timed out, too large, ...)."""
        name = scheme(url)
        assert name is not None, url
        try:
            import fsspec

            with fsspec.open(url, "rb", **_options(name)) as f:
                data = f.read(self.limit + 1)
        except ImportError as e:
            return None, f"cannot be fetched: {e} ({INSTALL})"
        except Exception as e:  # noqa: BLE001 - a network failure is its rows' error, never the job's stop
            return None, _why(e)
        if len(data) > self.limit:
            return (
                None,
                f"more than {self.limit} bytes (4 a pixel of --max-image-pixels, and 1 MiB): not read",
            )
        return bytes(data), None

    def get(self, url: str) -> tuple[bytes | None, str | None]:
        """The URL's bytes as fetched when the job started, else fetched now."""
        with self.lock:
            data = self.kept.get(url)
        return (data, None) if data is not None else self.fetch(url)

    def prefetch(self, urls: Iterable[str]) -> dict[str, str | None]:
        """``{url: sha256 of its bytes, or None when it can't be fetched}``, each fetched once (kept)."""
        urls = list(dict.fromkeys(urls))
        if not urls:
            return {}
        with ThreadPoolExecutor(min(THREADS, len(urls))) as pool:
            fetched = list(pool.map(self.fetch, urls))
        out: dict[str, str | None] = {}
        for url, (data, _) in zip(urls, fetched, strict=True):
            out[url] = None if data is None else hashlib.sha256(data).hexdigest()
            if data is not None and self.kept_bytes + len(data) <= KEEP_BYTES:
                with self.lock:
                    self.kept[url] = data
                    self.kept_bytes += len(data)
        return out
