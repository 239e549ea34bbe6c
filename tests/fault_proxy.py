"""A TCP proxy on loopback in front of a real server that misbehaves on the connections a test names.

Faults, per connection (numbered from 0 in the order they are accepted):

- ``refuse``: close the connection as soon as it is accepted (nothing reaches the server);
- ``drop_response``: forward the whole request, then close the client's side the moment the
  server starts answering (the server did the work; the client never hears of it);
- ``cut_after:N``: forward N bytes of the server's answer, then close both sides (a stream
  that breaks off mid-way);
- ``status:503``: answer 503 with an HTML body (a proxy's page) without asking the server.

Connections without a fault are forwarded untouched. ``requests`` keeps the first bytes each
connection sent, so a test can read the headers a client sent (``Last-Event-ID``, say).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

__all__ = ["FaultProxy"]


class FaultProxy:
    def __init__(self, upstream_port: int, faults: dict[int, str] | None = None) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.faults = dict(faults or {})
        self.requests: dict[int, bytes] = {}
        self.connections = 0
        self._lock = threading.Lock()
        self._server = socket.socket()
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(64)
        self.port = int(self._server.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._stopping = False
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._stopping = True
        with contextlib.suppress(OSError):
            self._server.close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            with self._lock:
                index = self.connections
                self.connections += 1
            threading.Thread(target=self._handle, args=(conn, index), daemon=True).start()

    def _handle(self, conn: socket.socket, index: int) -> None:
        fault = self.faults.get(index, "")
        if fault == "refuse":
            conn.close()
            return
        if fault.startswith("status:"):
            head = _read_head(conn)
            self.requests[index] = head
            body = b"<html><body>502 Bad Gateway (nginx)</body></html>"
            status = fault.split(":", 1)[1]
            conn.sendall(
                f"HTTP/1.1 {status} Unavailable\r\nContent-Type: text/html\r\nContent-Length: {len(body)}\r\n"
                f"Connection: close\r\n\r\n".encode()
                + body
            )
            conn.close()
            return
        up = socket.create_connection(self.upstream)
        limit = int(fault.split(":", 1)[1]) if fault.startswith("cut_after:") else None
        done = threading.Event()

        def client_to_server() -> None:
            first = True
            for chunk in _chunks(conn):
                if first:
                    self.requests[index] = chunk
                    first = False
                with contextlib.suppress(OSError):
                    up.sendall(chunk)
            with contextlib.suppress(OSError):
                up.shutdown(socket.SHUT_WR)

        threading.Thread(target=client_to_server, daemon=True).start()
        sent = 0
        try:
            for chunk in _chunks(up):
                if fault == "drop_response":
                    break
                if limit is not None and sent + len(chunk) >= limit:
                    conn.sendall(chunk[: limit - sent])
                    break
                conn.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass
        finally:
            done.set()
            for s in (conn, up):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()


def _chunks(sock: socket.socket) -> Iterator[bytes]:
    while True:
        try:
            data = sock.recv(65536)
        except OSError:
            return
        if not data:
            return
        yield data


def _read_head(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data
