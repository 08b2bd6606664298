"""uvicorn's h11 protocol with a bound on how long a client may take to send
one request (its head and body).

uvicorn closes a connection idle *between* requests after ``timeout_keep_alive``,
but not one that trickles a request in: a client sending half a header, a
byte at a time (slowloris), holds its connection, and the socket, for as
long as it likes. Here a timer starts when a connection opens, or when the
first byte of its next request arrives, and only the whole request arriving
stops it; if it fires first the connection is closed.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_REQUEST_READ_TIMEOUT_S = 30.0  # 1 MiB (the default body limit) at ~35 KB/s


class ReadTimeoutH11Protocol(H11Protocol):
    """``H11Protocol`` closing a connection whose request does not arrive whole
    within ``read_timeout_s`` (set by ``with_read_timeout``)."""

    read_timeout_s: float = DEFAULT_REQUEST_READ_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_read_timer()

    def data_received(self, data: bytes) -> None:
        if self._read_timer is None and self._between_requests():
            self._start_read_timer()  # the next request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR):
            self._stop_read_timer()  # the whole request is in (or the connection is done)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_read_timer()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        self._stop_read_timer()  # pipelined requests start their own timer on new data
        super().on_response_complete()

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _start_read_timer(self) -> None:
        self._read_timer = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _stop_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            self.logger.info("closing a connection that sent no whole request in %g s",
                             self.read_timeout_s)
            self.transport.close()


def with_read_timeout(seconds: float) -> type[ReadTimeoutH11Protocol]:
    """The protocol class for uvicorn's ``http=``, bound to ``seconds``."""
    return type("ReadTimeoutH11Protocol", (ReadTimeoutH11Protocol,), {"read_timeout_s": seconds})
