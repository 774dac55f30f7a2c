"""The server's Prometheus figures, named as vLLM names them (`vllm:...`), plus Orca's own
(`orca:...`: K/V slots reserved and used, the batch size of every iteration).

Counters and histograms are updated by the engine thread and read by `/metrics`, under one lock;
the gauges (requests running and waiting, K/V slots) are read off the engine when asked. They
cover the server's whole life in a fixed size: a count per bucket, no record per request.
"""
from __future__ import annotations

import bisect
import math
import threading
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass
class Histogram:
    """Cumulative-bucket histogram, as Prometheus exposes one."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.total += v
        self.n += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, cum = [], 0
        for le, c in zip(list(self.buckets) + [math.inf], self.counts):
            cum += c
            le_s = "+Inf" if le == math.inf else repr(float(le))
            out.append(f'{name}_bucket{{{labels},le="{le_s}"}} {cum}')
        return out + [f"{name}_sum{{{labels}}} {self.total!r}", f"{name}_count{{{labels}}} {self.n}"]


class Metrics:
    """What `/metrics` reports: the engine loop (`live.py`) updates the counts and histograms under
    `lock`, and `render` reads them with the gauges of the moment."""

    HISTOGRAMS = {
        "vllm:time_to_first_token_seconds": ("Time to first token (s).", LATENCY_BUCKETS),
        "vllm:inter_token_latency_seconds": ("Time between two tokens of a request (s).", LATENCY_BUCKETS),
        "vllm:e2e_request_latency_seconds": ("Arrival to last token (s).", LATENCY_BUCKETS),
        "vllm:iteration_tokens_total": ("Tokens fed per engine iteration.", TOKEN_BUCKETS),
        "orca:batch_size": ("Requests per engine iteration.", BATCH_BUCKETS),
        "orca:iteration_seconds": ("Wall time of one engine iteration (schedule, forward, record) (s).",
                                   LATENCY_BUCKETS),
    }

    def __init__(self, model_name: str) -> None:
        escaped = model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        self.labels = f'model_name="{escaped}"'
        self.lock = threading.Lock()
        self.hist = {name: Histogram(b) for name, (_, b) in self.HISTOGRAMS.items()}
        self.prompt_tokens = self.generation_tokens = self.iterations = self.preemptions = 0
        self.finished: dict[str, int] = {"length": 0, "stop": 0, "abort": 0}

    def render(self, gauges: dict[str, tuple[str, float]]) -> str:
        """Prometheus text format; `gauges` maps name -> (help, value), read off the engine now."""
        lab = self.labels
        out: list[str] = []
        for name, (help_, v) in gauges.items():
            out += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name}{{{lab}}} {v}"]
        with self.lock:
            counters = {"vllm:prompt_tokens_total": ("Prompt tokens taken in, once per request whatever its n "
                                                     "(as its usage counts them).", self.prompt_tokens),
                        "vllm:generation_tokens_total": ("Tokens generated.", self.generation_tokens),
                        "vllm:num_preemptions_total": ("Preemptions.", self.preemptions),
                        "orca:iterations_total": ("Engine iterations run.", self.iterations)}
            for name, (help_, v) in counters.items():
                out += [f"# HELP {name} {help_}", f"# TYPE {name} counter", f"{name}{{{lab}}} {v}"]
            out += ["# HELP vllm:request_success_total Requests ended, by finish reason.",
                    "# TYPE vllm:request_success_total counter"]
            out += [f'vllm:request_success_total{{{lab},finished_reason="{k}"}} {v}' for k, v in self.finished.items()]
            for name, (help_, _) in self.HISTOGRAMS.items():
                out += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"] + self.hist[name].lines(name, lab)
        return "\n".join(out) + "\n"
