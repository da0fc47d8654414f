"""The Hub's bytes, bounded. A Hub is outside kvchat, so what it sends is checked before it is used: names
(commits, ETags, file names) against their formats, every path written proved inside the cache, a JSON answer
read up to a cap, a file streamed until its declared size and not a byte past it, a resume's Content-Range
checked, a stall given up on, the disk's free space checked first, and the token sent to the Hub's own host
only (as huggingface_hub does). huggingface_hub still builds the URLs and headers and raises the Hub's errors.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlencode, urljoin, urlsplit

from .errors import EngineError, one_line

JSON_BYTES = 32 << 20  # a listing, a search or a config: an answer past this is refused
ERROR_BYTES = 64 << 10  # what is read of an error's body
STALL_SECONDS = 60.0  # a download that brings under STALL_BYTES in this long has stalled
STALL_BYTES = 64 << 10
CONNECT_SECONDS = 30.0
MAX_REDIRECTS = 5
DISK_SPARE = 64 << 20  # free space kept beyond what a download needs
NAME_CHARS = 1024  # a file name's length

COMMIT = re.compile(r"[0-9a-f]{40}")
ETAG = re.compile(r"[0-9a-fA-F]{32,128}")  # a git blob's SHA-1 or an LFS object's SHA-256
REPO = re.compile(r"[\w.-]{1,96}/[\w.-]{1,96}")


class HubError(EngineError):
    """The Hub could not be asked, or refused, or answered what kvchat does not take: words a person can act on."""


def check_commit(commit) -> str:
    if not isinstance(commit, str) or not COMMIT.fullmatch(commit):
        raise HubError(f"the Hub named a commit that is not one (40 hex digits): {one_line(repr(commit), 80)}")
    return commit


def check_etag(etag) -> str:
    if not isinstance(etag, str) or not ETAG.fullmatch(etag):
        raise HubError(f"the Hub gave a file an ETag that is not a hash: {one_line(repr(etag), 80)}")
    return etag


def is_file_name(name) -> bool:
    """A repository's file name as the Hub may give one: relative, '/'-separated, no '.' or '..' part."""
    if not isinstance(name, str) or not 0 < len(name) <= NAME_CHARS or "\\" in name or "\0" in name:
        return False
    parts = name.split("/")
    return not name.startswith("/") and ":" not in parts[0] and all(p not in ("", ".", "..") for p in parts)


def inside(root: Path, path: Path) -> Path:
    """`path`, once proved to resolve inside `root` (links followed); a HubError otherwise."""
    base, where = Path(root).resolve(), Path(path).resolve()
    if where != base and base not in where.parents:
        raise HubError(f"refused: {one_line(str(path), 120)} would be written outside the hub cache")
    return path


def _headers_for(url: str, home: str) -> dict:
    """huggingface_hub's headers (its token included) for the Hub's own host; without the token elsewhere."""
    from huggingface_hub.utils import build_hf_headers

    headers = build_hf_headers()
    if urlsplit(url).netloc != urlsplit(home).netloc:
        headers.pop("authorization", None)
        headers.pop("Authorization", None)
    return headers


def _http():
    """The HTTP client huggingface_hub itself is built on (httpx2 in its 1.x and later), so its errors map."""
    try:
        import httpx2 as http
    except ImportError:  # an older huggingface_hub, on httpx
        import httpx as http
    return http


def _raise_for(r) -> None:
    """An error answer (its body read up to ERROR_BYTES) raised as huggingface_hub raises it."""
    from huggingface_hub.utils import hf_raise_for_status

    httpx = _http()

    body = _body(r, ERROR_BYTES)[:ERROR_BYTES]
    hf_raise_for_status(httpx.Response(r.status_code, headers=r.headers, content=body, request=r.request))


def _body(r, cap: int) -> bytes:
    """A streamed answer's bytes, read until past `cap` at most (so a longer one shows as cap + more), closed."""
    body = bytearray()
    try:
        for chunk in r.iter_bytes():
            body += chunk
            if len(body) > cap:
                break
    finally:
        r.close()
    return bytes(body)


def open_stream(client, url: str, home: str, headers: dict | None = None):
    """A streamed GET of `url`, redirects followed by hand: the token goes only to `home`'s host."""
    for _ in range(MAX_REDIRECTS + 1):
        req = client.build_request("GET", url, headers={**_headers_for(url, home), **(headers or {})})
        r = client.send(req, stream=True, follow_redirects=False)
        if r.status_code in (301, 302, 303, 307, 308) and r.headers.get("location"):
            r.close()
            url = urljoin(url, r.headers["location"])
            continue
        if r.status_code >= 400:
            _raise_for(r)
        return r
    raise HubError(f"the Hub redirected more than {MAX_REDIRECTS} times: {one_line(url, 120)}")


def _client():
    httpx = _http()
    timeout = httpx.Timeout(STALL_SECONDS, connect=CONNECT_SECONDS)
    return httpx.Client(timeout=timeout, follow_redirects=False)


def get_json(url: str, home: str, params: dict | None = None, cap: int | None = None, what: str = "the answer"):
    """The JSON at `url`, read up to `cap` bytes (more is refused before it is parsed)."""
    cap = JSON_BYTES if cap is None else cap
    if params:
        url = f"{url}?{urlencode(params, doseq=True)}"
    with _client() as client:
        body = _body(open_stream(client, url, home), cap)
    if len(body) > cap:
        raise HubError(f"{what} from the Hub is over {cap / 2**20:,.0f} MiB: refused, not read")
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:
        raise HubError(f"{what} from the Hub is not JSON ({one_line(str(e), 120)})") from None


def _content_range(value: str | None) -> tuple[int, int | None] | None:
    """(first byte, total or None) of a `bytes a-b/total` header; None when it is not one."""
    m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", (value or "").strip())
    return None if m is None else (int(m[1]), None if m[3] == "*" else int(m[3]))


def transfer(url: str, home: str, part: Path, size: int, add: Callable[[int], None], name: str) -> None:
    """`size` bytes of `url` into `part`, going on from what is there: the server's answer to the resume
    checked, the disk's room checked first, stopped at `size`, and given up on when it stalls."""
    httpx = _http()

    have = part.stat().st_size if part.exists() else 0
    if have > size:  # not this file's beginning: start over
        part.unlink()
        have = 0
    free = shutil.disk_usage(part.parent).free
    if size - have + DISK_SPARE > free:
        raise HubError(
            f"disk full: {name} needs {(size - have) / 2**20:,.1f} MiB more and {free / 2**20:,.1f} MiB are free "
            f"at {part.parent}"
        )
    try:
        with _client() as client:
            r = open_stream(client, url, home, {"Range": f"bytes={have}-"} if have else None)
            try:
                if have and r.status_code == 206:
                    got = _content_range(r.headers.get("content-range"))
                    if got is None or got[1] not in (None, size):
                        said = one_line(str(r.headers.get("content-range")), 60)
                        raise HubError(f"{name}: the answer to a resume is not this file's (Content-Range {said})")
                    if got[0] != have:  # it started elsewhere: only from the start is usable
                        if got[0] != 0:
                            raise HubError(f"{name}: asked from byte {have:,}, the server sent from byte {got[0]:,}")
                        have = 0
                elif have:  # a whole answer (200): start over
                    have = 0
                add(have)
                _receive(r, part, have, size, add, name)
            finally:
                r.close()
    except httpx.TimeoutException:
        said = f"{name}: the Hub stopped sending (nothing for {STALL_SECONDS:.0f} s); pull again to go on"
        raise HubError(said) from None
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            said = f"disk full while writing {name} at {part.parent}; free space and pull again to go on"
            raise HubError(said) from None
        raise


def _receive(r, part: Path, have: int, size: int, add: Callable[[int], None], name: str) -> None:
    left, window, since = size - have, time.monotonic(), 0
    with open(part, "r+b" if have else "wb") as out:
        out.seek(have)
        out.truncate()
        for chunk in r.iter_bytes():
            if len(chunk) > left:
                out.close()
                part.unlink()
                raise HubError(f"{name}: the server sent more than the {size:,} bytes it declared: refused")
            out.write(chunk)
            left -= len(chunk)
            add(len(chunk))
            since += len(chunk)
            now = time.monotonic()
            if now - window >= STALL_SECONDS:
                if since < STALL_BYTES:
                    raise HubError(
                        f"{name}: the Hub sent {since:,} bytes in {now - window:.0f} s, too slow to go on; pull again"
                    )
                window, since = now, 0
        out.flush()
        os.fsync(out.fileno())
