"""Images as the engine takes them: bytes from outside (a file, a data: URL, a paste) checked and decoded with
Pillow under caps on bytes and pixels, and the prompt ids that stand for an image's positions.

An image's positions are written into a prompt's ids as negative ids derived from its content hash (`image_ids`):
two prompts holding the same image agree on them and two different images never do, so every comparison of ids
the cache makes (the reuse plan, the prefix store, the disk tier) treats an image's positions by its content, and
an edit of the text after an image keeps them.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import io
import warnings
from pathlib import Path

from .errors import EngineError

MAX_IMAGE_BYTES = 20 * 2**20  # a file larger than this is refused before it is read
MAX_PIXELS = 40_000_000  # width × height, checked from the header before anything is decoded
MAX_SIDE = 16_384  # pixels on either side
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # what Pillow is allowed to open
KEY_BITS = 47  # the content hash's bits in an image's ids (the index takes 16 more: 63 in all, an int64)
INDEX_BITS = 16  # positions one image may take: 65,536
IMAGE_TEXT = "[image]"  # what an image position reads as where a token's text is shown


class ImageError(EngineError):
    """An image that cannot be used: not an image, too large, or given to a model that does not see images."""


@dataclasses.dataclass(frozen=True, eq=False)
class Image:
    """One image as given: its bytes (kept to embed in an export and to decode again), their SHA-256, its size in
    pixels and format. Equal images are equal by content."""

    data: bytes
    digest: str  # sha256 of `data`, hex
    width: int
    height: int
    format: str  # PNG | JPEG | ...
    name: str | None = None  # the file's name, where it came from one

    def __eq__(self, other) -> bool:
        return isinstance(other, Image) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    @property
    def key(self) -> int:
        """The content hash's first KEY_BITS bits: what its positions' ids carry."""
        return int(self.digest[:12], 16) >> (48 - KEY_BITS)

    @property
    def mime(self) -> str:
        return f"image/{self.format.lower()}"

    def rgb(self):
        """The decoded picture, RGB (PIL.Image.Image); decoded again on each call (only the bytes are kept)."""
        return _decoded(self.data, self.name)[0].convert("RGB")

    def describe(self) -> str:
        return f"{self.name or 'image'} ({self.width}×{self.height} {self.format}, {_size(len(self.data))})"

    def data_url(self) -> str:
        return f"data:{self.mime};base64,{base64.b64encode(self.data).decode()}"


def read_image(data: bytes, name: str | None = None) -> Image:
    """Bytes from outside as an Image, or ImageError saying why not: too many bytes, not an image Pillow may open,
    too many pixels (checked from the header, before decoding: a decompression bomb is refused unread), or
    bytes that do not decode."""
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"{name or 'the image'} is {_size(len(data))}; images are limited to {_size(MAX_IMAGE_BYTES)}")
    if not data:
        raise ImageError(f"{name or 'the image'} is empty")
    picture, fmt = _decoded(data, name)
    return Image(bytes(data), hashlib.sha256(data).hexdigest(), picture.width, picture.height, fmt, name)


def image_file(path) -> Image:
    """An image file, its size checked before it is read."""
    path = Path(path).expanduser()
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise ImageError(f"{path} is not a file")
        if size > MAX_IMAGE_BYTES:
            raise ImageError(f"{path.name} is {_size(size)}; images are limited to {_size(MAX_IMAGE_BYTES)}")
        with open(path, "rb") as f:
            data = f.read(MAX_IMAGE_BYTES + 1)
    except OSError as e:
        raise ImageError(f"cannot read {path}: {e.strerror or e}") from None
    return read_image(data, path.name)


def data_url_image(url: str, name: str | None = None) -> Image:
    """A data: URL (data:image/png;base64,...) as an Image; its length checked before it is decoded."""
    head, sep, body = url.partition(",")
    if not (url.startswith("data:") and sep and head.endswith(";base64")):
        raise ImageError("an image URL must be a data:image/...;base64, URL")
    if len(body) > (MAX_IMAGE_BYTES * 4) // 3 + 8:
        raise ImageError(f"the image is over {_size(MAX_IMAGE_BYTES)}; images are limited to that")
    try:
        data = base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the image's data: URL is not valid base64") from None
    return read_image(data, name)


def _decoded(data: bytes, name: str | None):
    """(the picture, loaded; its format) with Pillow, under the caps; ImageError for what is not an image."""
    from PIL import Image as PILImage  # Pillow: imported where an image is first read

    what = name or "the image"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", PILImage.DecompressionBombWarning)
            picture = PILImage.open(io.BytesIO(data), formats=FORMATS)
            w, h = picture.size
            if w < 1 or h < 1 or w > MAX_SIDE or h > MAX_SIDE or w * h > MAX_PIXELS:
                raise ImageError(
                    f"{what} is {w:,}×{h:,} pixels; images are limited to {MAX_PIXELS / 1e6:.0f} megapixels "
                    f"and {MAX_SIDE:,} pixels a side"
                )
            picture.load()
    except ImageError:
        raise
    except (PILImage.DecompressionBombError, PILImage.DecompressionBombWarning) as e:
        raise ImageError(f"{what} was refused as a decompression bomb: {e}") from None
    except PILImage.UnidentifiedImageError:
        raise ImageError(f"{what} is not an image ({', '.join(FORMATS)} are read)") from None
    except (OSError, SyntaxError, ValueError, EOFError, MemoryError) as e:
        raise ImageError(f"{what} cannot be decoded: {e}") from None
    return picture, picture.format or "PNG"


def _size(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 1024:,.1f} KiB"


# --- an image's positions among a prompt's ids ----------------------------------------------------
def image_ids(image: Image, n: int) -> list[int]:
    """The ids of an image's n positions: negative, its content's key and the position's index in them."""
    if n > 1 << INDEX_BITS:
        raise ImageError(f"an image of {n:,} positions is more than a prompt may hold ({1 << INDEX_BITS:,})")
    base = image.key << INDEX_BITS
    return [-(1 + base + j) for j in range(n)]


def is_image_id(token: int) -> bool:
    return token < 0


def image_position(token: int) -> tuple[int, int]:
    """An image position's id as (the image's key, the position's index within the image)."""
    raw = -token - 1
    return raw >> INDEX_BITS, raw & ((1 << INDEX_BITS) - 1)


def text_with_images(ids: list[int], decode) -> str:
    """`decode(ids)` of the text between images, each run of an image's positions read as IMAGE_TEXT once."""
    if all(i >= 0 for i in ids):
        return decode(ids)
    out, run = [], []
    for i, t in enumerate(ids):
        if t >= 0:
            run.append(t)
        elif i == 0 or ids[i - 1] >= 0:  # the first position of an image's run
            out += [decode(run), IMAGE_TEXT]
            run = []
    return "".join(out) + decode(run)


def image_runs(ids) -> list[tuple[int, int, int]]:
    """The runs of one image's positions among `ids`: (first, end, key), in order."""
    out: list[tuple[int, int, int]] = []
    for i, t in enumerate(ids):
        if t >= 0:
            continue
        key = image_position(t)[0]
        if out and out[-1][1] == i and out[-1][2] == key:
            out[-1] = (out[-1][0], i + 1, key)
        else:
            out.append((i, i + 1, key))
    return out
