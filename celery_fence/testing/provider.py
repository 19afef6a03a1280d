"""A provider stub that behaves like a real idempotent API (an email or payment provider).

A small threaded HTTP service on 127.0.0.1:

- ``POST /<anything>`` with an ``Idempotency-Key`` header performs the operation once per key:
  the first request is performed and its response stored; a repeat with the same key replays the
  stored response (header ``Idempotent-Replayed: true``) without performing again. A repeat with
  the same key but another path or body is refused with 422, as real providers do. A request
  without the header is performed every time.
- ``ProviderStub(idempotent=False)`` is a provider without idempotency support: it ignores the
  header and performs every request (the control arm for "duplicate external effects").
- ``GET /stats`` → ``{"performed": n, "requests": m, "by_key": {key: {...}}}``: what it really
  did. ``by_key[key]`` holds ``requests``, ``performed`` (the operations really performed under
  that key: 1 when the provider deduplicated every repeat, more when it did not), ``path``,
  ``status`` and ``response`` (the last performed response, which echoes the request body under
  ``"request"``).
- Faults for the next requests: ``fail_next(n, status=503)`` answers an error without performing;
  ``fail_next(n, after_perform=True)`` performs and stores, then answers an error;
  ``delay_next(seconds, n)`` performs and stores, then waits before answering — the caller times
  out "after the provider did the work". Over HTTP: ``POST /_control`` with
  ``{"fail_next": n, "status": 503, "after_perform": false, "delay_next": s, "count": n,
  "path": "/emails"}``; ``POST /_reset`` forgets everything.

In-process: ``url = ProviderStub().start()`` ... ``.stop()`` (or ``with ProviderStub() as stub``).
Standalone: ``python -m celery_fence.testing.provider --port 8025`` (``--port 0``: a free port).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

IDEMPOTENCY_HEADER = "Idempotency-Key"


@dataclass
class _Fault:
    kind: str  # "fail" or "delay"
    remaining: int
    status: int = 503
    after_perform: bool = False
    seconds: float = 0.0
    path: str | None = None


@dataclass
class _KeyState:
    path: str
    body: bytes
    status: int
    response: dict[str, Any]
    requests: int = 0
    performed: int = 0  # operations really performed under this key


@dataclass
class _State:
    lock: threading.Lock = field(default_factory=threading.Lock)
    idempotent: bool = True  # False: the header is ignored, every request is performed
    requests: int = 0
    performed: int = 0
    by_key: dict[str, _KeyState] = field(default_factory=dict)
    faults: list[_Fault] = field(default_factory=list)
    ids: itertools.count = field(default_factory=lambda: itertools.count(1))


class ProviderStub:
    """An idempotent HTTP provider on 127.0.0.1 (see the module docstring)."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, idempotent: bool = True) -> None:
        self.host = host
        self.port = port
        self._state = _State(idempotent=idempotent)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> str:
        """Start serving in a daemon thread; return the base URL (``http://127.0.0.1:<port>``)."""
        if self._server is not None:
            return self.url
        server = ThreadingHTTPServer((self.host, self.port), _handler_class(self._state))
        server.daemon_threads = True
        self._server = server
        self.port = server.server_address[1]
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True
        )
        self._thread.name = f"provider-stub-{self.port}"
        self._thread.start()
        return self.url

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = None
        self._thread = None

    def __enter__(self) -> ProviderStub:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- what it did, faults ---------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return _stats(self._state)

    def fail_next(
        self,
        n: int = 1,
        *,
        status: int = 503,
        after_perform: bool = False,
        path: str | None = None,
    ) -> None:
        """The next ``n`` requests (to ``path``, if given) answer ``status``.

        ``after_perform=False``: nothing is performed or stored (a retry performs it).
        ``after_perform=True``: performed and stored first (a retry gets the stored response).
        """
        _add_fault(
            self._state, _Fault("fail", n, status=status, after_perform=after_perform, path=path)
        )

    def delay_next(self, seconds: float, n: int = 1, *, path: str | None = None) -> None:
        """The next ``n`` requests are performed and stored, then answered after ``seconds``."""
        _add_fault(self._state, _Fault("delay", n, seconds=seconds, after_perform=True, path=path))

    def reset(self) -> None:
        _reset(self._state)


def _add_fault(state: _State, fault: _Fault) -> None:
    if fault.remaining < 1:
        return
    with state.lock:
        state.faults.append(fault)


def _reset(state: _State) -> None:
    with state.lock:
        state.requests = state.performed = 0
        state.by_key.clear()
        state.faults.clear()
        state.ids = itertools.count(1)


def _stats(state: _State) -> dict[str, Any]:
    with state.lock:
        return {
            "performed": state.performed,
            "requests": state.requests,
            "by_key": {
                key: {
                    "requests": s.requests,
                    "performed": s.performed,
                    "path": s.path,
                    "status": s.status,
                    "response": s.response,
                }
                for key, s in state.by_key.items()
            },
        }


def _take_fault(state: _State, path: str) -> _Fault | None:
    """Consume one use of the first fault that applies to ``path`` (call with the lock held)."""
    for fault in state.faults:
        if fault.path is None or fault.path == path:
            fault.remaining -= 1
            if fault.remaining <= 0:
                state.faults.remove(fault)
            return fault
    return None


def _handler_class(state: _State) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "ProviderStub/1"
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _reply(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(body).encode()
            with contextlib.suppress(OSError):  # the client may have timed out and gone
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path.rstrip("/") == "/stats":
                self._reply(200, _stats(state))
            elif self.path.rstrip("/") == "/health":
                self._reply(200, {"ok": True})
            else:
                self._reply(404, {"error": "not found"})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            if self.path == "/_control":
                self._control(body)
                return
            if self.path == "/_reset":
                _reset(state)
                self._reply(200, {"ok": True})
                return
            self._operation(body)

        def _control(self, body: bytes) -> None:
            try:
                spec = json.loads(body or b"{}")
                count = int(spec.get("count", 1))
                if spec.get("fail_next"):
                    _add_fault(
                        state,
                        _Fault(
                            "fail",
                            int(spec["fail_next"]),
                            status=int(spec.get("status", 503)),
                            after_perform=bool(spec.get("after_perform", False)),
                            path=spec.get("path"),
                        ),
                    )
                if spec.get("delay_next"):
                    _add_fault(
                        state,
                        _Fault(
                            "delay",
                            count,
                            seconds=float(spec["delay_next"]),
                            after_perform=True,
                            path=spec.get("path"),
                        ),
                    )
            except (ValueError, TypeError, AttributeError) as exc:
                self._reply(400, {"error": f"bad control request: {exc}"})
                return
            self._reply(200, {"ok": True})

        def _operation(self, body: bytes) -> None:
            key = self.headers.get(IDEMPOTENCY_HEADER)
            with state.lock:
                state.requests += 1
                fault = _take_fault(state, self.path)
                stored = state.by_key.get(key) if key else None
                if stored is not None:
                    stored.requests += 1
                if stored is not None and not _same_request(stored, self.path, body):
                    status, response, replayed = 422, _mismatch(key), False
                elif stored is not None and state.idempotent:
                    status, response, replayed = stored.status, stored.response, True
                elif fault is not None and fault.kind == "fail" and not fault.after_perform:
                    status, response, replayed = fault.status, {"error": "simulated failure"}, False
                else:
                    state.performed += 1
                    status, replayed = 200, False
                    response = {
                        "id": f"op_{next(state.ids)}",
                        "idempotency_key": key,
                        "path": self.path,
                        "request": _json_or_none(body),
                    }
                    if key and stored is None:
                        stored = state.by_key[key] = _KeyState(self.path, body, status, response, 1)
                    elif stored is not None:  # a provider without idempotency: performed again
                        stored.status, stored.response = status, response
                    if stored is not None:
                        stored.performed += 1
            if fault is not None and fault.kind == "delay":
                time.sleep(fault.seconds)
            if fault is not None and fault.kind == "fail" and fault.after_perform:
                status, response = fault.status, {"error": "simulated failure after performing"}
            headers = {"Idempotent-Replayed": "true"} if replayed else {}
            self._reply(status, response, headers)

    return Handler


def _same_request(stored: _KeyState, path: str, body: bytes) -> bool:
    if stored.path != path:
        return False
    first, again = _json_or_none(stored.body), _json_or_none(body)
    return stored.body == body or (first is not None and first == again)


def _mismatch(key: str | None) -> dict[str, Any]:
    return {"error": f"idempotency key {key} was used with a different request"}


def _json_or_none(body: bytes) -> Any:
    try:
        return json.loads(body) if body else None
    except ValueError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m celery_fence.testing.provider",
        description="An idempotent provider stub on 127.0.0.1 (GET /stats shows what it did).",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--fail-first", type=int, default=0, metavar="N")
    parser.add_argument("--fail-status", type=int, default=503)
    parser.add_argument("--delay-first", type=float, default=0.0, metavar="SECONDS")
    args = parser.parse_args(argv)
    stub = ProviderStub(host=args.host, port=args.port)
    stub.fail_next(args.fail_first, status=args.fail_status)
    if args.delay_first > 0:
        stub.delay_next(args.delay_first)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(stub.start(), flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        stub.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
