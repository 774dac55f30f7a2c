"""What the server takes from one HTTP request: a leaf both the app and the server's config read
(the config without importing FastAPI)."""

MAX_BODY_BYTES = 4 * 2**20
"""The largest body taken (413 beyond it): a 128k-token prompt as token ids is under 1 MiB."""

MAX_HEAD_BYTES = 64 * 2**10
"""The most a request's line and headers may take (431 past it, give or take what one read of the
socket brings): uvicorn's httptools parser has no bound of its own, so one connection sending
header lines for `BODY_TIMEOUT_S` could grow the server's memory by gigabytes. (Its h11 parser
has one: 16 KiB, then a plain 400.)"""

BODY_MEMORY_MIB = 64
"""How many MiB of request bodies the server holds at once, being read or waiting for the one
parse thread (503 with Retry-After past it): 16 of the largest, thousands of ordinary ones. A burst
of clients each sending the largest body would otherwise have every body held until the parse
thread reached it, without bound."""

BODY_TIMEOUT_S = 30.0
"""How long a request's body may take to arrive: 4 MiB (the most taken) at about 1 Mbit/s; and its
headers, from the connection's opening or, after an answer on it, their first byte. uvicorn has no such bound: a client
whose Content-Length promises more than it sends, or whose headers never end, is waited on for ever."""

MAX_CONNECTIONS = 1000
"""How many connections the server serves at once unless told (`--max-connections`), fewer where
the process's open-file limit leaves room for fewer (`connection_room`): a request on a connection
past it is answered 503 (uvicorn's `limit_concurrency`, which has no bound of its own) and its
connection closed, while the server goes on. Each connection holds a file descriptor and its
buffers; without a bound, clients opening connections faster than they close them would take
every descriptor, and then the server could open no file and accept no connection at all."""

FD_RESERVE = 64
"""File descriptors kept for the server's own use (its listening socket, the model's and tokenizer's
files, the event loop's own) beside its connections."""


def connection_room() -> int | None:
    """The most connections this process's open-file limit (`ulimit -n`, its soft limit) leaves
    room for beside `FD_RESERVE` (at least 1); None where it sets none (or none is known)."""
    try:
        import resource
    except ImportError:                         # (no such limit to read on this system)
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else max(soft - FD_RESERVE, 1)


def default_connections() -> int:
    """The connections served at once where `--max-connections` is not given: `MAX_CONNECTIONS`, or
    fewer where the open-file limit leaves room for fewer (`connection_room`)."""
    room = connection_room()
    return MAX_CONNECTIONS if room is None else min(MAX_CONNECTIONS, room)
