"""A loopback TCP proxy in front of a database, for outages as the client sees them: connections
refused and cut (:meth:`TcpProxy.down`, :meth:`TcpProxy.refuse`), left open and silent
(:meth:`TcpProxy.stall`), or one statement's answer lost after the server ran it
(:meth:`TcpProxy.lose_answer_to`: a crash between a COMMIT and its reply). Used by the chaos
harness's ``db-outage`` scenario and by the tests of bounded database waits and of a completion
in doubt; it stops with every process the harness started
(:func:`~celery_fence.testing.groups.cleanup`).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time

from celery_fence.testing.groups import register_closer
from celery_fence.testing.waiting import free_port


class TcpProxy:
    """A loopback TCP proxy in front of a database: :meth:`down` refuses new connections and cuts
    the open ones (a real outage as the client sees it); :meth:`up` listens again on the same
    port. :meth:`stall` stops forwarding without closing anything (a peer that has gone silent:
    connections stay open, packets are acknowledged, no answer ever comes); :meth:`unstall`
    forwards again. :meth:`refuse` cuts the open connections and resets every new one until
    :meth:`accept_again`, counting them in :attr:`refused`: the store calls made inside the
    outage."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = free_port()
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stalled = threading.Event()
        self._refusing = False
        self.refused = 0  # connections reset while refusing
        self._lose_marker: bytes | None = None
        self._muted: set[socket.socket] = set()  # servers whose answers are dropped
        self.answers_lost = 0  # statements run by the server whose answer never reached the client
        register_closer(self.down)

    def refuse(self) -> None:
        with self._lock:
            self._refusing = True
            conns, self._conns = self._conns, set()
        for conn in conns:
            _reset(conn)

    def accept_again(self) -> None:
        with self._lock:
            self._refusing = False

    def lose_answer_to(self, marker: bytes) -> None:
        """The next request that contains ``marker`` reaches the server, which runs it; its
        answer never comes back: the connection is reset (after 0.5 s, the statement committed)
        with nothing of the reply forwarded."""
        with self._lock:
            self._lose_marker = marker

    def stall(self) -> None:
        self._stalled.set()

    def unstall(self) -> None:
        self._stalled.clear()

    def up(self) -> None:
        with self._lock:
            if self._listener is not None:
                return
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", self.port))
            listener.listen(64)
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, set()
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for conn in conns:
            _reset(conn)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            with self._lock:
                refusing = self._refusing
                self.refused += refusing
            if refusing:
                _reset(client)
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:  # went down meanwhile
                    client.close()
                    server.close()
                    return
                self._conns.update((client, server))
            threading.Thread(target=self._pump, args=(client, server, server), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client), daemon=True).start()

    def _pump(
        self, src: socket.socket, dst: socket.socket, server: socket.socket | None = None
    ) -> None:
        """Forward ``src`` to ``dst``; ``server``: given for the client's direction."""
        try:
            while True:
                while self._stalled.is_set():  # stop reading: nothing is forwarded or closed
                    time.sleep(0.02)
                data = src.recv(65536)
                if not data:
                    break
                while self._stalled.is_set():  # read during the stall: held back, not sent
                    time.sleep(0.02)
                if src in self._muted:  # the answer to a statement whose reply is lost
                    continue
                if server is not None and self._lose(data, server):
                    dst.sendall(data)
                    time.sleep(0.5)  # the server runs (and commits) it; its reply is dropped
                    with self._lock:
                        self.answers_lost += 1
                    _reset(src)
                    _reset(server)
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._conns.discard(src)
                self._conns.discard(dst)
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()

    def _lose(self, data: bytes, server: socket.socket) -> bool:
        with self._lock:
            if self._lose_marker is None or self._lose_marker not in data:
                return False
            self._lose_marker = None
            self._muted.add(server)
            return True


def _reset(conn: socket.socket) -> None:
    """Close with a TCP reset (what a peer that went away leaves the client with)."""
    with contextlib.suppress(OSError):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        conn.close()
