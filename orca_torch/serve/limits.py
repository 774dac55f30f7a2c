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
