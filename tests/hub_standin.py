"""A stand-in for the Hugging Face Hub on loopback, speaking the part of its HTTP API that huggingface_hub uses
to search, list a repository's files and download them (HEAD and ranged GET on /resolve/, the commit and ETag
headers, a gated repository's 401). The real Hub cannot be reached from these machines; the client code under
test is exactly what runs against it (`HF_ENDPOINT` points it here)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib

from servers import serve_in_thread, stop_thread_server

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclasses.dataclass
class Repo:
    files: dict[str, bytes]  # path -> content
    gated: bool = False
    served: dict[str, bytes] = dataclasses.field(default_factory=dict)  # what is sent instead (a corrupt copy)
    tags: tuple[str, ...] = ("gguf",)
    summary: dict = dataclasses.field(default_factory=dict)  # the Hub's `gguf` or `config` field (expand=...)
    lies: dict = dataclasses.field(default_factory=dict)  # what a hostile Hub says instead (HubStandIn's doc)


class HubStandIn:
    """`repos`: id -> Repo. `trickle`: (path, after this many bytes) — the rest of that file comes slowly,
    so a test can stop a download in the middle. `ranges` records each GET's Range header, by path, and
    `tokens` each Authorization header a GET brought.

    A repository's `lies` make the Hub hostile: `sha` (the commit it names), `etag`, `siblings` (more rows, as
    given), `endless` (a file's GET never ends, whatever its HEAD said), `drip` (a file comes one byte every
    that many seconds), `from_zero` (a resume is answered 206 from byte 0), `redirect` (a file's GET and HEAD
    are sent to that URL base, another host)."""

    def __init__(self, repos: dict[str, Repo], trickle: tuple[str, int] | None = None):
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, Response, StreamingResponse
        from starlette.routing import Route

        self.repos, self.trickle = repos, trickle
        self.ranges: dict[str, list[str | None]] = {}
        self.tokens: list[str | None] = []

        def info(repo_id: str) -> dict:
            r = self.repos[repo_id]
            siblings = []
            for path, data in r.files.items():
                s = {"rfilename": path, "size": len(data), "blobId": hashlib.sha1(data).hexdigest()}
                if len(data) > 64:  # an LFS file: its sha256 is what the client checks
                    s["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                siblings.append(s)
            siblings += r.lies.get("siblings", [])
            sha = r.lies.get("sha", COMMIT)
            return {"id": repo_id, "modelId": repo_id, "sha": sha, "private": False, "gated": "auto" if r.gated
                    else False, "tags": list(r.tags), "pipeline_tag": "text-generation", "siblings": siblings,
                    "downloads": 1000, "likes": 10, **r.summary}  # fmt: skip

        async def models(request):
            q = (request.query_params.get("search") or "").lower()
            rows = [info(k) for k in self.repos if q in k.lower()]
            return JSONResponse([{k: v for k, v in row.items() if k != "siblings"} for row in rows])

        async def model_info(request):
            repo_id = f"{request.path_params['org']}/{request.path_params['name']}"
            if repo_id not in self.repos:
                return JSONResponse({"error": "Repository not found"}, 404, headers={"X-Error-Code": "RepoNotFound"})
            return JSONResponse(info(repo_id))

        async def resolve(request):
            repo_id = f"{request.path_params['org']}/{request.path_params['name']}"
            path = request.path_params["path"]
            r = self.repos.get(repo_id)
            if r is None:
                return JSONResponse({"error": "Repository not found"}, 404, headers={"X-Error-Code": "RepoNotFound"})
            if path not in r.files:
                return JSONResponse({"error": "Entry not found"}, 404, headers={"X-Error-Code": "EntryNotFound"})
            if r.gated and not request.headers.get("authorization"):
                return JSONResponse(
                    {"error": "Access to this model is restricted"},
                    401,
                    headers={"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to this model is restricted"},
                )
            data = r.served.get(path, r.files[path])
            etag = r.lies.get("etag", hashlib.sha256(r.files[path]).hexdigest())
            headers = {"X-Repo-Commit": r.lies.get("sha", COMMIT), "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
            if "redirect" in r.lies and not request.query_params.get("moved"):
                where = f"{r.lies['redirect']}{request.url.path}?moved=1"
                linked = {"X-Linked-Size": str(len(data)), "X-Linked-Etag": f'"{etag}"', "Location": where}
                return Response(b"", 302, headers={**headers, **linked})
            if request.method == "HEAD":
                return Response(b"", headers={**headers, "Content-Length": str(len(data))})
            self.tokens.append(request.headers.get("authorization"))
            rng = request.headers.get("range")
            self.ranges.setdefault(path, []).append(rng)
            start = 0 if r.lies.get("from_zero") else int(rng.split("=")[1].split("-")[0]) if rng else 0
            body = data[start:]
            slow = self.trickle and self.trickle[0] == path and not rng  # the first try only: a resume runs at speed
            drip = r.lies.get("drip")

            async def chunks():
                if r.lies.get("endless") == path:
                    while True:
                        yield b"\0" * 65536
                        await asyncio.sleep(0)
                for i in range(0, len(body), 1 if drip else 4096):
                    if slow and start + i >= self.trickle[1]:
                        await asyncio.sleep(0.05)
                    if drip:
                        await asyncio.sleep(drip)
                    yield body[i : i + (1 if drip else 4096)]

            status = 206 if rng else 200
            if r.lies.get("endless") != path:
                headers["Content-Length"] = str(len(body))
            if rng:
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            return StreamingResponse(chunks(), status_code=status, headers=headers)

        app = Starlette(
            routes=[
                Route("/api/models", models),
                Route("/api/models/{org}/{name}", model_info),
                Route("/api/models/{org}/{name}/revision/{rev}", model_info),
                Route("/{org}/{name}/resolve/{rev}/{path:path}", resolve, methods=["GET", "HEAD"]),
            ]
        )
        self.port, self._server, self._thread = serve_in_thread(app, "the Hub stand-in")
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        stop_thread_server(self._server, self._thread)
