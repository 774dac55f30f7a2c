"""A live server in a thread of the test process, for the tests that talk to it over HTTP, the
lines of one run as a process, for the tests that signal it, and a tiny checkpoint to serve."""
from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import IO

import pytest

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


class Lines:
    """A process's output, read line by line on a thread of its own, so that waiting for a line is
    bounded: a server that hangs without exiting fails the test instead of holding it up. `wait_s`
    is only that guard, far above a loaded machine's delays, never a timing check."""

    def __init__(self, stream: IO[str], wait_s: float = 300.0) -> None:
        self.wait_s = wait_s
        self.seen: list[str] = []
        self._ended = False
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._reader.start()

    def _read(self, stream: IO[str]) -> None:
        for line in iter(stream.readline, ""):
            self._lines.put(line)
        self._lines.put(None)

    def first_with(self, text: str) -> str:
        """The next line that holds `text`; the test fails if the output ends, or `wait_s` passes,
        before one comes."""
        deadline = time.monotonic() + self.wait_s
        while not self._ended:
            try:
                line = self._lines.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                pytest.fail(f"no line with {text!r} within {self.wait_s:g} s; the output so far:\n{self._drained()}")
            if line is None:
                self._ended = True
                break
            self.seen.append(line)
            if text in line:
                return line
        pytest.fail(f"the output ended with no line with {text!r}:\n{self._drained()}")

    def text(self) -> str:
        """All of the output of a process that has exited (what came within `wait_s`, if a process
        it started still holds the pipe open)."""
        self._reader.join(self.wait_s)
        return self._drained()

    def _drained(self) -> str:
        while not self._lines.empty():
            line = self._lines.get()
            if line is None:
                self._ended = True
            else:
                self.seen.append(line)
        return "".join(self.seen)


def tiny_checkpoint(path):
    """A small random Llama checkpoint saved in `path` (eos id 2), and its word-level tokenizer ("<s>" 1,
    "</s>" 2, "w0" 3, ...), not saved: the caller adds what its test needs first."""
    pytest.importorskip("transformers")
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                 bos_token_id=1, eos_token_id=2)).eval().save_pretrained(path)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(297)]
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
