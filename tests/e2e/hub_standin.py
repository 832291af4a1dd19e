"""A stand-in for the Hugging Face Hub's file API, enough for `hf download REPO --local-dir DIR` (what the operator's
fetch init container runs for hf:// models) with HF_ENDPOINT pointing here: repo info, its file tree, and each
file by HEAD (commit, ETag, size) and GET. It serves every repository from one folder: a model written by
`kubeinfer random-model`. Standard library only: the e2e suite runs it in a pod of the engine image.

    python hub_standin.py FOLDER [PORT]
"""
from __future__ import annotations

import hashlib
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

COMMIT = "e2e0" * 10  # one fixed 40-hex revision for every repository


class Hub(BaseHTTPRequestHandler):
    folder: Path

    def _files(self) -> list[str]:
        return sorted(str(p.relative_to(self.folder)) for p in self.folder.rglob("*") if p.is_file())

    def _route(self) -> tuple[str, object]:
        """("info", body) for /api/models/ORG/NAME[/revision/REV] and its /tree/REV (the file list); ("file", path)
        for /ORG/NAME/resolve/REV/FILE."""
        parts = unquote(urlsplit(self.path).path).strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 5 and parts[4] == "tree":
            return "info", [{"type": "file", "path": f, "size": (self.folder / f).stat().st_size,
                             "oid": hashlib.sha1((self.folder / f).read_bytes()).hexdigest()} for f in self._files()]
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo = "/".join(parts[2:4])
            return "info", {"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                            "siblings": [{"rfilename": f} for f in self._files()]}
        if len(parts) >= 5 and parts[2] == "resolve":
            path = (self.folder / "/".join(parts[4:])).resolve()
            if path.is_file() and self.folder.resolve() in path.parents:
                return "file", path
        return "missing", None

    def _headers(self, status: int, length: int, extra: dict[str, str]) -> None:
        self.send_response(status)
        for key, value in {"Content-Length": str(length), "X-Repo-Commit": COMMIT, **extra}.items():
            self.send_header(key, value)
        self.end_headers()

    def _answer(self, with_body: bool) -> None:
        kind, found = self._route()
        if kind == "info":
            body = json.dumps(found).encode()
            self._headers(200, len(body), {"Content-Type": "application/json"})
        elif kind == "file":
            body = found.read_bytes()
            etag = hashlib.sha256(body).hexdigest()
            self._headers(200, len(body), {"ETag": f'"{etag}"', "Content-Type": "application/octet-stream",
                                           "Accept-Ranges": "none"})
        else:
            body = b'{"error": "Entry not found"}'
            self._headers(404, len(body), {"X-Error-Code": "EntryNotFound", "Content-Type": "application/json"})
        if with_body:
            self.wfile.write(body)

    def do_HEAD(self) -> None:  # noqa: N802 - http.server's naming
        self._answer(with_body=False)

    def do_GET(self) -> None:  # noqa: N802
        self._answer(with_body=True)


def serve(folder: Path, port: int, host: str = "0.0.0.0") -> ThreadingHTTPServer:
    handler = type("FolderHub", (Hub,), {"folder": folder})
    return ThreadingHTTPServer((host, port), handler)


if __name__ == "__main__":
    server = serve(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 8000)
    print(f"hub stand-in on :{server.server_address[1]} serving {sys.argv[1]}", flush=True)
    server.serve_forever()
