"""A row's images (``--image-column``): what a cell may hold, each image's bytes read and decoded, and the
digests of the files the cells reference.

A cell is one image or a list of them (null or an empty list: a text-only row). An image is Parquet/Arrow
binary, a Hugging Face ``datasets`` Image struct ``{bytes, path}`` (the bytes win; the path is read when they
are null), a ``data:`` URL (base64) or a path as text: relative to the input file's folder, absolute, or
``file://``; a URL (``http(s)://``, ``s3://``, ...) is fetched only with ``--allow-remote-images``
(``remote_images.py``), else the row's error. Each image is decoded with Pillow, refused over
``--max-image-pixels`` before its pixels are read, and converted to RGB. Whatever goes wrong is the row's
error, naming the image (its index and path); nothing here raises for a row.

The files that paths reference are part of the job's inputs: ``scan`` digests each one (its bytes, whole)
before any work, the job keeps the digests in its state folder (``images.json``), a resume whose images
differ is refused naming the file, and a row whose file changed while the job ran stops the job. A
remote image is recorded the same way, by the bytes fetched when the job starts.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchjob.errors import InputError
from batchjob.job.remote_images import NOT_ALLOWED, RemoteImages, check_protocols, scheme

if TYPE_CHECKING:
    from PIL import Image as PILImage

    from batchjob.io.sources import Source

# told each image file read (path as written, its bytes); returns why the row cannot use it, or None
Seen = Callable[[str, bytes], str | None]
Fetch = Callable[[str], tuple[bytes | None, str | None]]  # a remote image's bytes, or why not


class ImageChangedError(InputError):
    """An image file the job recorded is not the same file now."""

    exit_code = 2


@dataclass(frozen=True)
class ImageRef:
    """One image of a cell: its bytes, or the path to read them from."""

    index: int  # its place in the row's list (0 for a single image)
    data: bytes | None
    path: str | None  # as written in the cell

    @property
    def name(self) -> str:
        """How a message names it: ``image 1 (cats/a.png)``."""
        return f"image {self.index}" + (f" ({self.path})" if self.path else "")


_LINE_BREAKS = str.maketrans("", "", " \t\n\r\v\f")  # ASCII whitespace: base64.encodebytes wraps at 76


def data_url(url: str) -> tuple[bytes | None, str | None]:
    """The bytes of a ``data:`` URL (base64, as OpenAI's image parts carry them), or why not. Its ';base64'
    in any case and its data wrapped in lines, as transformers' ``load_image`` reads them (the same bytes);
    any other character outside base64 is refused (``load_image`` would drop it without a word)."""
    head, sep, data = url.partition(",")
    if not sep or not head.lower().endswith(";base64"):
        return None, "a data: URL must be base64 (data:image/png;base64,...)"
    try:
        return base64.b64decode(data.translate(_LINE_BREAKS), validate=True), None
    except (binascii.Error, ValueError) as e:
        return None, f"the data: URL is not valid base64 ({e})"


def refs(value: Any, column: str) -> tuple[list[ImageRef] | None, str | None]:
    """A cell's images (``[]``: none), or why the cell holds no images."""
    if value is None:
        return [], None
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    out = []
    for k, item in enumerate(items):
        if isinstance(item, str) and item.startswith("data:"):
            data, error = data_url(item)
            if data is None:
                return None, f"image column {column!r}: image {k}: {error}"
            out.append(ImageRef(k, data, None))
            continue
        ref = _ref(item, k)
        if ref is None:
            kind = type(item).__name__
            return None, (
                f"image column {column!r}: image {k} is {kind}, not bytes, a path or a {{bytes, path}} struct"
            )
        out.append(ref)
    return out, None


def _ref(item: Any, k: int) -> ImageRef | None:
    if isinstance(item, (bytes, bytearray, memoryview)):
        return ImageRef(k, bytes(item), None)
    if isinstance(item, str):
        return ImageRef(k, None, item)
    if isinstance(item, dict) and set(item) <= {"bytes", "path"} and item:
        data, path = item.get("bytes"), item.get("path")
        if data is not None and not isinstance(data, (bytes, bytearray)):
            return None
        if path is not None and not isinstance(path, str):
            return None
        if data is None and path is None:
            return None
        return ImageRef(k, None if data is None else bytes(data), None if data is not None else path)
    return None


def local_path(path: str, folder: Path | None) -> tuple[Path | None, str | None]:
    """Where a cell's path points (``folder``: the input file's, None when it is remote), or why not read."""
    if scheme(path) is not None:
        return None, NOT_ALLOWED
    if path.startswith("file://"):
        path = path[len("file://") :]
    if not path:  # it would name the input file's folder
        return None, "an empty path: give the image's path or bytes (null or [] for a row without images)"
    p = Path(path).expanduser()
    if p.is_absolute():
        return p, None
    if folder is None:
        return None, "a relative path in a remote input file: give an absolute path or the bytes"
    return folder / p, None


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_bytes(
    ref: ImageRef, folder: Path | None, fetch: Fetch | None = None
) -> tuple[bytes | None, str | None]:
    """The image's bytes, or why they can't be read (naming the image); ``fetch``: how a URL is read (None:
    it is not, ``--allow-remote-images`` was not given)."""
    if ref.data is not None:
        return ref.data, None
    assert ref.path is not None
    if fetch is not None and scheme(ref.path) is not None:
        data, why = fetch(ref.path)
        return data, None if data is not None else f"{ref.name}: {why}"
    path, why = local_path(ref.path, folder)
    if path is None:
        return None, f"{ref.name}: {why}"
    try:
        return path.read_bytes(), None
    except OSError as e:
        return None, f"{ref.name}: cannot be read ({e.strerror or e})"


class _PillowLimit:
    """Pillow's own pixel limit (a process-wide setting) off while any decode runs, ``--max-image-pixels``
    on the header being the check: counted, not saved and restored by each decode, so that decodes on
    several threads at once (``job/ahead.py``) each meet the same checks and leave the setting as found."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0  # decodes in progress
        self.saved: int | None = None  # Pillow's limit before the first of them

    @contextmanager
    def off(self) -> Iterator[None]:
        from PIL import Image

        with self.lock:
            if self.running == 0:
                self.saved, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
            self.running += 1
        try:
            yield
        finally:
            with self.lock:
                self.running -= 1
                if self.running == 0:
                    Image.MAX_IMAGE_PIXELS = self.saved


_PILLOW_LIMIT = _PillowLimit()


def decode(data: bytes, ref: ImageRef, max_pixels: int) -> tuple[PILImage.Image | None, str | None]:
    """The image as RGB, or why not: not an image, corrupt, or over ``max_pixels`` (checked on its header,
    before its pixels are decoded)."""
    from PIL import Image, ImageOps

    try:
        with _PILLOW_LIMIT.off():
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > max_pixels:
                return None, (
                    f"{ref.name}: {width} x {height} = {width * height} pixels is over --max-image-pixels "
                    f"{max_pixels}"
                )
            image.load()
            # turned as its EXIF orientation says, as transformers' load_image and datasets' Image give it
            return ImageOps.exif_transpose(image).convert("RGB"), None
    except Image.UnidentifiedImageError:
        return None, f"{ref.name}: not an image Pillow can read (corrupt, or a format it does not know)"
    except Exception as e:  # noqa: BLE001 - any decoder failure is this row's, not the job's
        return None, f"{ref.name}: cannot be decoded as an image ({type(e).__name__}: {e})"[:1000]


def load(
    value: Any,
    column: str,
    folder: Path | None,
    max_pixels: int,
    seen: Seen | None = None,
    fetch: Fetch | None = None,
) -> tuple[list[PILImage.Image] | None, str | None]:
    """A cell's images decoded (``folder``: where relative paths start), or why the row has none;
    ``seen(path, data)`` is told each file read by its path."""
    found, error = refs(value, column)
    if found is None:
        return None, error
    images, error = load_refs(found, folder, max_pixels, seen, fetch)
    return (images, None) if images is not None else (None, f"image column {column!r}: {error}")


def load_refs(
    found: list[ImageRef],
    folder: Path | None,
    max_pixels: int,
    seen: Seen | None = None,
    fetch: Fetch | None = None,
) -> tuple[list[PILImage.Image] | None, str | None]:
    """The images read and decoded, in order, or why the first that can't be is not."""
    out = []
    for ref in found:
        data, error = read_bytes(ref, folder, fetch)
        if data is None:
            return None, error
        if ref.data is None and ref.path is not None and seen is not None:
            error = seen(ref.path, data)
            if error is not None:
                return None, error
        image, error = decode(data, ref, max_pixels)
        if image is None:
            return None, error
        out.append(image)
    return out, None


def unreadable(
    sources: list[Source], column: str, max_pixels: int, most: int = 10, fetch: Fetch | None = None
) -> tuple[int, int, list[str]]:
    """``validate``: how many images the column holds, how many can't be opened (read and decoded), and
    why for the first ``most`` of those, each naming its row and image."""
    from batchjob.io.readers import iter_rows

    by_name = {s.name: s for s in sources}
    total, bad, lines = 0, 0, list[str]()
    for row in iter_rows(sources):
        if row.values is None:
            continue
        found, error = refs(row.values.get(column), column)
        folder = source_folder(by_name[row.source])
        whys = [error] if found is None else []
        for ref in found or []:
            data, why = read_bytes(ref, folder, fetch)
            if data is not None:
                _, why = decode(data, ref, max_pixels)
            if why is not None:
                whys.append(f"image column {column!r}: {why}")
        total += len(found) if found is not None else 1
        bad += len(whys)
        lines += [f"{row.place}: {why}" for why in whys][: max(0, most - len(lines))]
    return total, bad, lines


def source_folder(source: Source) -> Path | None:
    """The folder relative image paths of ``source``'s rows start from (None: a remote input)."""
    if source.remote:
        return None
    path = source.path[len("file://") :] if source.path.startswith("file://") else source.path
    p = Path(path)
    return p if source.kind == "hf" else p.parent


def key(source: Source, path: str) -> str:
    """A referenced file's name in the job's records: a URL or an absolute path as written, else under its
    input's name."""
    if scheme(path) is not None:
        return path
    if path.startswith("file://"):
        path = path[len("file://") :]
    return path if Path(path).expanduser().is_absolute() else f"{source.name}: {path}"


CellRefs = Callable[[dict[str, Any]], list[ImageRef]]  # a row's values -> the images it names


def column_refs(column: str) -> CellRefs:
    """The images of a row's ``column`` cell (none when the cell holds no images: that row's error)."""
    return lambda values: refs(values.get(column), column)[0] or []


def scan(
    sources: list[Source], cell_refs: CellRefs, remote: RemoteImages | None = None
) -> dict[str, str | None]:
    """``{key: sha256 of the file's bytes, or None when it can't be read now}`` for every local file the
    rows name (``cell_refs``: a row's images; bytes in a row are the input's already), and with ``remote``
    every URL (fetched now, once; a protocol without its package refused). A file that can't be read makes
    its row an error row, not the job's stop."""
    from batchjob.io.readers import iter_rows

    by_name = {s.name: s for s in sources}
    out: dict[str, str | None] = {}
    urls: list[str] = []
    for row in iter_rows(sources):
        if row.values is None:
            continue
        source = by_name[row.source]
        for ref in cell_refs(row.values):
            if ref.data is not None or ref.path is None:
                continue
            if scheme(ref.path) is not None:
                urls += [ref.path] if remote is not None else []
                continue
            name = key(source, ref.path)
            if name in out:
                continue
            where, _ = local_path(ref.path, source_folder(source))
            try:
                out[name] = digest(where.read_bytes()) if where is not None else None
            except OSError:
                out[name] = None
    if remote is not None:
        check_protocols(scheme(url) or "" for url in urls)
        out |= remote.prefetch(urls)
    return out


def changes(saved: dict[str, str | None], now: dict[str, str | None]) -> list[str]:
    """What differs for the files the job recorded (a file unreadable then is not held against now: its
    rows were error rows, which --retry-errors redoes)."""
    out = []
    for name, was in saved.items():
        if was is None:
            continue
        if name not in now or now[name] is None:
            out.append(f"{name}: recorded, now missing or unreadable")
        elif now[name] != was:
            out.append(f"{name}: its bytes changed")
    return out
