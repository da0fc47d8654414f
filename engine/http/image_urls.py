"""An image named by an http(s) URL in a chat request, fetched for `engine serve --allow-image-urls`: bounded in
bytes (the engine's image limit, counted as they arrive) and in time, a few redirects at most, an image/* answer
only; never another scheme (file:, ftp:)."""

from __future__ import annotations

import time

import httpx

from ..images import MAX_IMAGE_BYTES, Image, ImageError, read_image

FETCH_SECONDS = 15.0  # the whole fetch: connecting, redirects and the body
MAX_REDIRECTS = 3


def fetch_image(url: str) -> Image:
    """The image at `url`, or ImageError saying why not (a status, a type, a size, a time)."""
    if not url.startswith(("http://", "https://")):
        raise ImageError("only http and https image URLs are fetched")
    deadline = time.monotonic() + FETCH_SECONDS
    try:
        with httpx.Client(timeout=FETCH_SECONDS, follow_redirects=True, max_redirects=MAX_REDIRECTS) as client:
            with client.stream("GET", url, headers={"Accept": "image/*"}) as r:
                if r.status_code != 200:
                    raise ImageError(f"the image URL answered {r.status_code}")
                kind = r.headers.get("content-type", "").split(";")[0].strip().lower()
                if not kind.startswith("image/"):
                    raise ImageError(f"the image URL answered {kind or 'no content type'}, not an image")
                declared = r.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > MAX_IMAGE_BYTES:
                    raise ImageError(f"the image URL's image is over {MAX_IMAGE_BYTES >> 20} MiB")
                got = bytearray()
                for piece in r.iter_bytes():
                    got += piece
                    if len(got) > MAX_IMAGE_BYTES:
                        raise ImageError(f"the image URL's image is over {MAX_IMAGE_BYTES >> 20} MiB")
                    if time.monotonic() > deadline:
                        raise ImageError(f"the image URL took over {FETCH_SECONDS:g} s")
    except httpx.HTTPError as e:
        raise ImageError(f"the image URL could not be fetched: {type(e).__name__}") from None
    return read_image(bytes(got), url.rsplit("/", 1)[-1][:80] or "image")
