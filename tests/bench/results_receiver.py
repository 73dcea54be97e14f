"""A results server on 127.0.0.1 for `--submit` tests (bench and TUI)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kapitsa.bench.schema import report_from_dict
from kapitsa.errors import InvalidRequest


class Receiver:
    """A results server on 127.0.0.1 that validates and records what `--submit` posts."""

    def __init__(self) -> None:
        self.received: list[dict] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                try:
                    report_from_dict(body)
                except InvalidRequest as err:
                    return self._reply(400, {"error": str(err)})
                receiver.received.append(body)
                self._reply(201, {"id": f"run-{len(receiver.received)}"})

            def _reply(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/results"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
