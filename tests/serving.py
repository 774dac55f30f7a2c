"""A live server in a thread of the test process, for the tests that talk to it over HTTP."""
from __future__ import annotations

import contextlib
import threading
import time

from orca_torch.serve.server import ServeConfig, make_server


@contextlib.contextmanager
def serving(cfg: ServeConfig):
    """A server for `cfg` (its port 0: the one the system picks as it binds, read back from
    `on_start`) in a thread of this process: (its URL, its live engine, its app)."""
    bound: list[int] = []
    srv, live = make_server(cfg, on_start=lambda host, port: bound.append(port))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 30
        while not bound:
            assert time.time() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{bound[0]}", live, srv.config.app
    finally:
        srv.should_exit = True
        thread.join(10)
        live.stop()
