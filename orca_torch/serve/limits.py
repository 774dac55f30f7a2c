"""What the server takes from one HTTP request: a leaf both the app and the server's config read
(the config without importing FastAPI)."""

MAX_BODY_BYTES = 4 * 2**20
"""The largest body taken (413 beyond it): a 128k-token prompt as token ids is under 1 MiB."""

BODY_TIMEOUT_S = 30.0
"""How long a request's body may take to arrive: 4 MiB (the most taken) at about 1 Mbit/s; and its
headers, from the connection's opening or, after an answer on it, their first byte. uvicorn has no such bound: a client
whose Content-Length promises more than it sends, or whose headers never end, is waited on for ever."""
