"""A small Hugging Face Hub on 127.0.0.1 speaking the endpoints huggingface_hub uses for downloads:
model info (`/api/models/{repo}[/revision/{rev}]`), the recursive tree listing, and `resolve` HEAD/GET
with byte ranges. Faults can be injected per file: cut a response short, or fail requests outright.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

LFS_THRESHOLD = 1024  # files at least this big are served as LFS files (sha256 etag, X-Linked-* headers)


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    commit: str = ""

    def __post_init__(self) -> None:
        digest = hashlib.sha1()
        for name in sorted(self.files):
            digest.update(name.encode() + self.files[name])
        self.commit = self.commit or digest.hexdigest()


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo]
    cut_after: dict[str, int] = field(default_factory=dict)  # file → bytes sent before the connection drops
    fail_gets: dict[str, int] = field(default_factory=dict)  # file → GETs answered 500 (after any cut)
    corrupt: set[str] = field(default_factory=set)  # files whose served bytes differ from the listed hash
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # (method, path, Range)

    def start(self) -> str:
        hub = self

        class Handler(_Handler):
            fake = hub

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _QuietServer(ThreadingHTTPServer):
    """A client that hangs up mid-body (the point of `cut_after`) raises in the handler thread; the stock
    server prints that traceback to sys.stderr, where a test capturing the CLI's stderr would read it."""

    def handle_error(self, request: object, client_address: object) -> None:
        pass


class _Handler(BaseHTTPRequestHandler):
    fake: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self._route(head=False)

    def do_HEAD(self) -> None:
        self._route(head=True)

    def _route(self, head: bool) -> None:
        path = unquote(urlparse(self.path).path)
        self.fake.requests.append((self.command, path, self.headers.get("Range")))
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path):
            return self._info(m.group(1))
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(/.*)?", path):
            return self._tree(m.group(1))
        if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            return self._file(m.group(1), m.group(3), head)
        self._json(404, {"error": "not found"})

    def _repo(self, repo_id: str) -> FakeRepo | None:
        repo = self.fake.repos.get(repo_id)
        if repo is None:
            self._json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
        return repo

    def _info(self, repo_id: str) -> None:
        if repo := self._repo(repo_id):
            self._json(
                200,
                {
                    "id": repo_id,
                    "sha": repo.commit,
                    "siblings": [{"rfilename": name} for name in sorted(repo.files)],
                },
            )

    def _tree(self, repo_id: str) -> None:
        if repo := self._repo(repo_id):
            self._json(200, [_tree_entry(name, data) for name, data in sorted(repo.files.items())])

    def _file(self, repo_id: str, name: str, head: bool) -> None:
        repo = self._repo(repo_id)
        if repo is None:
            return
        if name not in repo.files:
            return self._json(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
        data = repo.files[name]
        headers = _file_headers(repo, name, data)
        if head:
            return self._send(200, headers | {"Content-Length": str(len(data))}, b"")
        if name not in self.fake.cut_after and self.fake.fail_gets.get(name, 0) > 0:
            self.fake.fail_gets[name] -= 1
            return self._json(500, {"error": "injected failure"})
        self._send_body(name, data, headers)

    def _send_body(self, name: str, data: bytes, headers: dict[str, str]) -> None:
        if name in self.fake.corrupt:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        start, status = 0, 200
        if m := re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or ""):
            start, status = int(m.group(1)), 206
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        body = data[start:]
        headers["Content-Length"] = str(len(body))
        cut = self.fake.cut_after.pop(name, None)
        if cut is not None:
            self._send(status, headers, body[:cut], close=True)
            return
        self._send(status, headers, body)

    def _json(self, status: int, payload: object, extra: dict[str, str] | None = None) -> None:
        body = json.dumps(payload).encode()
        self._send(
            status,
            {"Content-Type": "application/json", "Content-Length": str(len(body)), **(extra or {})},
            body,
        )

    def _send(self, status: int, headers: dict[str, str], body: bytes, close: bool = False) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        if close:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()
        if close:
            self.close_connection = True


def _tree_entry(name: str, data: bytes) -> dict[str, object]:
    entry: dict[str, object] = {"type": "file", "oid": git_blob_id(data), "size": len(data), "path": name}
    if len(data) >= LFS_THRESHOLD:
        entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
    return entry


def _file_headers(repo: FakeRepo, name: str, data: bytes) -> dict[str, str]:
    headers = {
        "X-Repo-Commit": repo.commit,
        "Accept-Ranges": "bytes",
        "Content-Type": "application/octet-stream",
    }
    if len(data) >= LFS_THRESHOLD:
        sha = hashlib.sha256(data).hexdigest()
        headers |= {"ETag": f'"{sha}"', "X-Linked-Etag": f'"{sha}"', "X-Linked-Size": str(len(data))}
    else:
        headers["ETag"] = f'"{git_blob_id(data)}"'
    return headers
