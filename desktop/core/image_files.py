"""The images of conversations, kept as files named by their content's SHA-256 in kvchat's data folder, and the
reference a message's record holds to each (its hash, name, size in pixels and format). No Qt here.

A reference from the store or an import is data from outside: checked field by field (a hash is 64 hex digits,
so a reference never names a path), and the file it names is read back under the engine's image limits and its
hash checked, so a changed or damaged file is a clear error, never another image.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from engine.errors import cut
from engine.images import MAX_IMAGE_BYTES, Image, ImageError, read_image

DIGEST = re.compile(r"[0-9a-f]{64}")
MAX_IMAGES = 16  # images one message may carry
SUFFIXES = {"PNG": ".png", "JPEG": ".jpg", "WEBP": ".webp", "GIF": ".gif", "BMP": ".bmp"}


def reference(image: Image) -> dict:
    """What a message's record keeps of an image."""
    return {"digest": image.digest, "name": cut(image.name or "image", 200), "width": image.width,
            "height": image.height, "format": image.format}  # fmt: skip


def checked_reference(ref) -> dict | None:
    """A reference read from a record, or None where it is not one kvchat writes."""
    if not isinstance(ref, dict) or not isinstance(ref.get("digest"), str) or not DIGEST.fullmatch(ref["digest"]):
        return None
    if ref.get("format") not in SUFFIXES or not isinstance(ref.get("name"), str):
        return None
    sizes = [ref.get(k) for k in ("width", "height")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 1 << 16 for v in sizes):
        return None
    return {"digest": ref["digest"], "name": cut(ref["name"], 200), "width": sizes[0], "height": sizes[1],
            "format": ref["format"]}  # fmt: skip


def checked_references(refs) -> list[dict] | None:
    """A record's list of image references, or None where any is not one (the record then shows none)."""
    if not isinstance(refs, list) or len(refs) > MAX_IMAGES:
        return None
    out = [checked_reference(r) for r in refs]
    return None if None in out else out


class ImageFiles:
    """A folder of images by content: `keep` writes one once (atomically), `image` reads one back, checked."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def path(self, ref: dict) -> Path:
        return self.folder / (ref["digest"] + SUFFIXES[ref["format"]])

    def keep(self, image: Image) -> dict:
        """Write the image's bytes (unless a file of them is there) and return its reference."""
        ref = reference(image)
        target = self.path(ref)
        if not target.is_file():
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(image.data)
                os.replace(tmp, target)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        return ref

    def image(self, ref: dict) -> Image:
        """The image a reference names, read and checked; ImageError where it is missing or not the same."""
        path = self.path(ref)
        try:
            if path.stat().st_size > MAX_IMAGE_BYTES:
                raise ImageError(f"{ref['name']} in kvchat's image folder is over the image limit")
            data = path.read_bytes()
        except FileNotFoundError:
            raise ImageError(f"{ref['name']} is missing from kvchat's image folder ({self.folder})") from None
        except OSError as e:
            raise ImageError(f"{ref['name']} cannot be read from kvchat's image folder: {e.strerror or e}") from None
        image = read_image(data, ref["name"])
        if image.digest != ref["digest"]:
            raise ImageError(f"{ref['name']} in kvchat's image folder has changed since it was attached")
        return image
