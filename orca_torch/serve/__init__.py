"""Orca's engine as a live OpenAI-compatible server (lecture §4.1: requests join a running batch).

A package above `core` and `model`: `live.py` runs the one `Engine` in a thread of its own on the
real clock, `app.py` is the HTTP face (FastAPI), `bodies.py` what a request body may hold and how
it is checked and turned into a `Generation`, `tokenizer.py` the presets' shipped tokenizer or a
checkpoint's own, `metrics.py` the Prometheus figures, `server.py` builds them all and
`__main__.py` is `python -m orca_torch.serve`. Needs the `serve` extra; see docs/serving.md.
"""
