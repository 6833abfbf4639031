"""A TCP forwarder on 127.0.0.1 in front of a real server (PostgreSQL), which a test
can cut and restore: the database going away and coming back, as the hub sees it."""

from __future__ import annotations

import socket
import threading
from types import TracebackType


class TcpProxy:
    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._cut = False
        self._thread = threading.Thread(target=self._accept, name="tcp-proxy", daemon=True)

    def __enter__(self) -> TcpProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object | TracebackType) -> None:
        self._listener.close()
        self.cut()

    def cut(self) -> None:
        """Every connection reset now, and new ones refused until `restore`."""
        with self._lock:
            self._cut = True
            for sock in self._open:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00"
                                    b"\x00\x00\x00\x00")
                    sock.close()
                except OSError:
                    pass
            self._open.clear()

    def restore(self) -> None:
        with self._lock:
            self._cut = False

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._cut:
                    client.close()
                    continue
                try:
                    server = socket.create_connection(self._target, timeout=5)
                except OSError:
                    client.close()
                    continue
                server.settimeout(None)
                self._open += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=_pipe, args=(a, b), daemon=True).start()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (source, sink):
            try:
                sock.close()
            except OSError:
                pass
