"""A stand-in control plane for node tests: it records what real node processes send.

Only the node side of the protocol is under test here, so this answers
registrations and heartbeats as the console would, parses every message with
workers.protocol (a node that sends a malformed one fails the test), and lets
the test wait for the message it expects.
"""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from workers import protocol


class FakeControlPlane:
    def __init__(self, heartbeat_interval_s: float = 0.1):
        self.heartbeat_interval_s = heartbeat_interval_s
        self.registrations: list[protocol.Registration] = []
        self.heartbeats: list[protocol.Heartbeat] = []
        self.refused: list[str] = []  # protocol errors in what the nodes sent
        self._changed = threading.Condition()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-control-plane", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> "FakeControlPlane":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def wait_for_heartbeat(self, predicate, timeout_s: float = 10.0) -> protocol.Heartbeat:
        """The first heartbeat, old or new, for which `predicate` is true."""
        return self._wait(lambda: next((h for h in self.heartbeats if predicate(h)), None), timeout_s, "a heartbeat")

    def wait_for_registration(self, timeout_s: float = 10.0) -> protocol.Registration:
        return self._wait(lambda: self.registrations[-1] if self.registrations else None, timeout_s, "a registration")

    def heartbeats_after(self, count: int, predicate, timeout_s: float = 10.0) -> protocol.Heartbeat:
        """The first heartbeat after the first `count` received for which `predicate` is true."""
        return self._wait(
            lambda: next((h for h in self.heartbeats[count:] if predicate(h)), None), timeout_s, "a later heartbeat"
        )

    def _wait(self, find, timeout_s: float, what: str):
        with self._changed:
            found = self._changed.wait_for(lambda: find() or self.refused, timeout_s)
        assert not self.refused, f"the control plane refused a message: {self.refused}"
        assert found, f"no {what} in {timeout_s} s ({len(self.heartbeats)} heartbeats received)"
        return found

    def _record(self, path: str, body) -> tuple[int, dict]:
        try:
            if path == protocol.REGISTER_PATH:
                message = protocol.Registration.parse(body)
                answer = {"state": "join", "heartbeat_interval_s": self.heartbeat_interval_s}
                kept = self.registrations
            elif path.endswith("/heartbeat"):
                message = protocol.Heartbeat.parse(body)
                answer = {"state": "serving"}
                kept = self.heartbeats
            else:  # deregister
                return 200, {"state": "left"}
        except protocol.ProtocolError as exc:
            with self._changed:
                self.refused.append(str(exc))
                self._changed.notify_all()
            return 400, {"error": {"message": str(exc), "field": exc.field}}
        with self._changed:
            kept.append(message)
            self._changed.notify_all()
        return 200, answer

    def _handler(self):
        plane = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                status, answer = plane._record(self.path, json.loads(self.rfile.read(length) or b"null"))
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format, *args):  # no output noise
                pass

        return Handler
