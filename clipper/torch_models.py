"""Real torch models behind the container interface, profiled and steered by the wall clock (§2.2–2.3).

Three small `nn.Module`s with different shares of fixed cost, so their profiles differ the way the
lecture's toy models do, but measured rather than assumed:

- `mlp`: three layers of width 512: a small fixed cost and a moderate cost per input.
- `deep-narrow`: 32 layers of width 64: each layer's dispatch overhead is paid once per batch, the
  arithmetic per input is tiny -> a high fixed cost `a` (the kernel-launch/RPC cost of Clipper's day).
- `token-mlp`: each input is 32 tokens of width 64, every token through a 64-256-64 MLP: the
  arithmetic per input dominates and the weights are tiny -> a steep slope `b`. (A wide MLP would not
  do: at small batches it is bound by reading its weights, flat, like an LLM decode step.)

`measure_profile` times whole `predict_batch` calls (the input check, the forward pass, one output
row per input: a container's batch, as Clipper times it) and fits `a + b·B` (mean, median, tail quantile);
`run_online` lets a controller pick each batch size while the batches truly run, optionally with
`Interference` (threads doing matmuls) slowing the machine for part of the run, as a co-located job
would. Runs on CPU, or CUDA when asked (`device="cuda"`), timing with `synchronize()`.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from orca_torch.checks import (brief, check_callable, check_choice, check_device, check_fits_in_memory, check_instance,
    check_int, check_list, check_probability, check_real, check_seed, is_int)

from .closed_loop import ControllerTrace, run_closed_loop
from .container import ModelContainer, check_inputs, check_name, timed_predict
from .controllers import BatchController
from .profile import LatencyProfile, fit_profile


def _mlp(dims: Sequence[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:])):
        layers.append(nn.Linear(d_in, d_out))
        if i < len(dims) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class TokenMLP(nn.Module):
    """An MLP applied to each of an input's `n_tokens` tokens, mean-pooled, then a linear head."""

    def __init__(self, n_tokens: int = 32, dim: int = 64, hidden: int = 256, n_out: int = 10) -> None:
        super().__init__()
        self.n_tokens, self.dim = n_tokens, dim
        self.mlp = _mlp([dim, hidden, dim])
        self.head = nn.Linear(dim, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, n_tokens * dim]
        t = x.view(x.shape[0], self.n_tokens, self.dim)
        return self.head(self.mlp(t).mean(dim=1))


MODEL_BUILDERS: dict[str, tuple[Callable[[], nn.Module], int]] = {  # name -> (builder, input width)
    "mlp": (lambda: _mlp([128, 512, 512, 10]), 128),
    "deep-narrow": (lambda: _mlp([64] * 33), 64),
    "token-mlp": (lambda: TokenMLP(), 32 * 64),
}


class TorchContainer:
    """An `nn.Module` behind `predict_batch`: one stacked forward per batch, one output row per input.

    `predict_batch` accepts a sequence of 1-D inputs or an already stacked `[B, in_dim]` tensor.
    Outputs come back on the CPU, as a served answer would. `n_batches` / `n_items` count what ran.
    The container takes the module over: it is moved to `device` and put in eval mode in place, as
    `nn.Module.to` does (a copy would double its memory).
    """

    def __init__(self, name: str, module: nn.Module, in_dim: int, device: str | torch.device = "cpu") -> None:
        self.name = check_name(name)
        check_instance("module", module, nn.Module)
        self.in_dim = check_int("in_dim", in_dim, 1)
        self.device = torch.device(check_device(device))
        self.module = module.to(self.device).eval()
        self.n_batches = 0
        self.n_items = 0

    def predict_batch(self, inputs: Sequence[Any] | torch.Tensor) -> list[torch.Tensor]:
        x = self._as_batch(inputs)
        with torch.inference_mode():
            y = self.module(x.to(self.device, torch.float32)).cpu()
        self.n_batches += 1
        self.n_items += x.shape[0]
        return [row.clone() for row in y]       # (a row of its own: a view would keep the batch alive)

    def _as_batch(self, inputs: Sequence[Any] | torch.Tensor) -> torch.Tensor:
        """The inputs as one `[B, in_dim]` tensor of real numbers: a str, a bool or a NaN fed to the
        module would come back as a torch error or a NaN answer instead of the caller's mistake."""
        want = f"{self.name}: inputs must be vectors of length {self.in_dim} of finite real numbers"
        if isinstance(inputs, torch.Tensor) and inputs.ndim != 2:
            raise ValueError(f"{want}, got shape {tuple(inputs.shape)}")
        check_inputs(self.name, inputs)
        if isinstance(inputs, torch.Tensor):
            x = inputs
        else:
            try:
                x = torch.stack([torch.as_tensor(v) for v in inputs])
            except (TypeError, ValueError, RuntimeError):
                kinds = ", ".join(sorted({type(v).__name__ for v in inputs}))
                raise ValueError(f"{want} (tensors, arrays or lists), got items of type {kinds} "
                                 "that do not stack into one tensor") from None
        if x.ndim != 2 or x.shape[1] != self.in_dim:
            raise ValueError(f"{want}, got shape {tuple(x.shape)}")
        if x.dtype == torch.bool or x.is_complex():
            raise ValueError(f"{want}, got dtype {x.dtype}")
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"{want}, got NaN or inf")
        return x

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def example_inputs(self, n: int, seed: int = 0) -> torch.Tensor:
        """`n` seeded random inputs, stacked `[n, in_dim]`; the first `k` of them are `example_inputs(k)`,
        so a caller can draw more as it needs them. (torch draws normals 16 at a time, a tail of fewer
        afresh: each row is drawn padded to a multiple of 16 floats.)"""
        g = torch.Generator().manual_seed(check_seed(seed))
        n = check_int("n", n, 1)
        padded = -(-self.in_dim // 16) * 16
        check_fits_in_memory(f"{self.name}: {n:,} example inputs of {self.in_dim} float32s", 4.0 * n * padded)
        x = torch.randn(n, padded, generator=g, dtype=torch.float32)
        return x if padded == self.in_dim else x[:, :self.in_dim].contiguous()


def make_model(name: str, seed: int = 0, device: str | torch.device = "cpu") -> TorchContainer:
    """One of `MODEL_BUILDERS`, with weights drawn from `seed`."""
    build, in_dim = MODEL_BUILDERS[check_choice("torch model", name, MODEL_BUILDERS)]
    seed = check_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = build()
    return TorchContainer(name, module, in_dim, device)


@dataclass
class MeasuredProfile:
    """Raw timings of real batches; the fitted lines are computed on access (each may raise
    `ValueError` if noise hides the slope, without losing the others)."""

    name: str
    batch_sizes: np.ndarray
    latencies_ms: np.ndarray
    quantile: float = 0.9

    @cached_property
    def mean(self) -> LatencyProfile:
        """Least squares: the mean latency line."""
        return fit_profile(self.batch_sizes, self.latencies_ms, name=self.name)

    @cached_property
    def median(self) -> LatencyProfile:
        """Quantile 0.5: robust to the odd descheduled batch of a shared machine."""
        return fit_profile(self.batch_sizes, self.latencies_ms, 0.5, name=self.name)

    @cached_property
    def tail(self) -> LatencyProfile:
        """The `quantile` line (P90 by default)."""
        return fit_profile(self.batch_sizes, self.latencies_ms, self.quantile, name=self.name)


def measure_profile(container: ModelContainer, batch_sizes: Sequence[int], *, reps: int = 5, warmup: int = 2,
                    quantile: float = 0.9, seed: int = 0, inputs: torch.Tensor | None = None) -> MeasuredProfile:
    """Time `reps` real `predict_batch` calls at each batch size (interleaved, in a seeded order, so slow
    spells of a shared machine spread over all sizes) and fit the mean, median and `quantile` lines."""
    check_instance("container", container, ModelContainer)
    if inputs is None and not isinstance(container, TorchContainer):
        raise ValueError(f"container {type(container).__name__} has no example inputs of its own (a "
                         "TorchContainer has); pass inputs=, one per input of the largest batch")
    sizes = sorted({check_int("batch size", b, 1) for b in check_list("batch_sizes", batch_sizes, "batch sizes")})
    if len(sizes) < 2:
        raise ValueError("a profile needs two or more distinct batch sizes")
    reps = check_int("reps", reps, 1)
    warmup = check_int("warmup", warmup, 0)
    quantile = check_probability("quantile", quantile, lo_open=True, hi_open=True)
    seed = check_seed(seed)
    if inputs is None:
        inputs = container.example_inputs(sizes[-1], seed)  # type: ignore[attr-defined]
    check_inputs(f"measure_profile's inputs for {container.name}", inputs)
    if len(inputs) < sizes[-1]:
        raise ValueError(f"need at least {sizes[-1]} inputs for the largest batch, got {len(inputs)}")
    for _ in range(warmup):
        for b in sizes:
            timed_predict(container, inputs[:b])
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for _ in range(reps):
        for b in rng.permutation(sizes):
            _, ms = timed_predict(container, inputs[:int(b)])
            xs.append(int(b))
            ys.append(ms)
    return MeasuredProfile(container.name, np.asarray(xs), np.asarray(ys), quantile)


class Interference:
    """Background threads doing matmuls: the machine slows while they run (a co-located job).

    Bounded: each thread stops at `stop()` or after `max_seconds`, whichever comes first, so a
    forgotten `stop()` cannot leave work running; it stops once the matmul it is in has ended (one
    cannot be interrupted), so `stop()` waits for that, and a `size` whose matmul outlasts
    `max_seconds` runs one matmul past it (size 2500 on one CPU thread: some 0.6 s). Usable as a
    context manager. What a thread raises is raised again by `stop()`, not lost with the thread.
    """

    MAX_THREADS = 1024

    def __init__(self, n_threads: int = 2, size: int = 384, max_seconds: float = 30.0) -> None:
        self.n_threads = check_int("n_threads", n_threads, 1, self.MAX_THREADS)
        self.size = check_int("size", size, 1)
        check_fits_in_memory(f"Interference({self.n_threads} threads of {self.size} x {self.size} matmuls)",
                             3 * 4 * self.size ** 2 * self.n_threads)      # a, a @ a and its tanh, in fp32
        self.max_seconds = check_real("max_seconds", max_seconds, 0.0, lo_open=True, unit="seconds")
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.n_matmuls = 0
        self._lock = threading.Lock()
        self._errors: list[BaseException] = []

    def _work(self) -> None:
        n = 0
        try:
            g = torch.Generator().manual_seed(0)
            a = torch.randn(self.size, self.size, generator=g, dtype=torch.float32)
            end = time.perf_counter() + self.max_seconds
            while not self._stop.is_set() and time.perf_counter() < end:
                a = torch.tanh(a @ a)  # tanh keeps the values bounded
                n += 1
        except BaseException as e:      # (kept for `stop()`: a thread's exception is otherwise only printed)
            with self._lock:
                self._errors.append(e)
        with self._lock:
            self.n_matmuls += n

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def start(self) -> None:
        if self.running:
            raise RuntimeError("interference is already running")
        self._stop.clear()
        self._threads = [threading.Thread(target=self._work, daemon=True, name=f"interference-{i}")
                         for i in range(self.n_threads)]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        """Stop and join the threads; raise the first error one of them met."""
        self._stop.set()
        for t in self._threads:
            t.join()
        errors, self._errors = self._errors, []
        if errors:
            raise RuntimeError(f"an interference thread failed: {errors[0]!r}") from errors[0]

    def __enter__(self) -> "Interference":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _check_window(interference: Interference, window: tuple[int, int], n_batches: int) -> None:
    """The interference must be able to start at batch `window[0]`: an Interference not yet running,
    and a window of whole batch indices `0 <= start < stop <= n_batches` (a start of 0.5 is no batch,
    so the threads would silently never run)."""
    check_instance("interference", interference, Interference)
    if interference.running:
        raise ValueError("interference is already running; give run_online one that is stopped, it starts "
                         "the threads at window[0]")
    ok = isinstance(window, (tuple, list)) and len(window) == 2 and all(is_int(v) for v in window)
    if not (ok and 0 <= window[0] < window[1] <= n_batches):
        raise ValueError(f"window must be two batch indices (start, stop), integers with 0 <= start < stop <= "
                         f"n_batches ({n_batches}), got {brief(window)}")


Measure = Callable[[ModelContainer, Any], tuple[list[Any], float]]


@dataclass
class OnlineRun:
    """A controller steering real batches: the trace and what the container actually executed."""

    trace: ControllerTrace
    items_executed: int
    interference_window: tuple[int, int] | None
    interference_matmuls: int = 0
    outputs_checked: int = 0


def run_online(container: TorchContainer, controller: BatchController, n_batches: int, *,
               interference: Interference | None = None, window: tuple[int, int] | None = None,
               measure: Measure = timed_predict, pool_size: int | None = None, seed: int = 0) -> OnlineRun:
    """Run `n_batches` real batches of the size `controller` proposes, feeding back measured latency.

    `interference` runs during batches `[window[0], window[1])`. `measure(container, inputs)` returns
    `(outputs, latency_ms)`: the wall clock by default; a test can wrap it to inject latencies while
    the batch still really executes. Each batch of `b` is the first `b` of the seeded inputs
    `container.example_inputs(n, seed)`, up to `pool_size` of them: by default the controller's `cap`
    where it has one (`AIMD`, `QuantileRegression`), else 1024; a batch past that is refused. They are
    drawn as the batches grow (doubling), so a cap far above the sizes the run reaches costs no memory.
    """
    check_instance("container", container, TorchContainer)
    check_instance("controller", controller, BatchController)
    check_callable("measure", measure, "(container, inputs) -> (outputs, latency in ms)")
    n_batches = check_int("n_batches", n_batches, 1)
    pool_size = None if pool_size is None else check_int("pool_size", pool_size, 1)
    if (interference is None) != (window is None):
        raise ValueError("give both an Interference and its window of batches, or neither")
    if window is not None:
        _check_window(interference, window, n_batches)
    seed = check_seed(seed)
    if pool_size is None:
        cap = getattr(controller, "cap", None)
        pool_size = 1024 if cap is None else check_int(
            f"{type(controller).__name__}.cap (run_online draws up to that many inputs to batch from; "
            "or give pool_size)", cap, 1)
    pool = container.example_inputs(1, seed)
    done = {"items": 0, "checked": 0}
    matmuls_before = interference.n_matmuls if interference else 0     # (an Interference may be reused)

    def execute(i: int, b: int) -> float:
        nonlocal pool
        if window is not None and i == window[0]:
            interference.start()  # type: ignore[union-attr]
        if window is not None and i == window[1]:
            interference.stop()  # type: ignore[union-attr]
        if b > pool_size:
            raise ValueError(f"controller asked for a batch of {b}, above the input pool of {pool_size}; "
                             "give the controller a cap, or run_online a larger pool_size")
        if b > len(pool):
            pool = container.example_inputs(min(pool_size, max(b, 2 * len(pool))), seed)
        before = container.n_items
        got = measure(container, pool[:b])
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            raise ValueError(f"measure must return (outputs, latency in ms), got {brief(got, 80)} for batch {i}")
        outputs, ms = got
        done["items"] += container.n_items - before
        done["checked"] += len(outputs)
        return ms

    try:
        trace = run_closed_loop(controller, execute, n_batches)
    finally:
        if interference is not None:
            interference.stop()
    return OnlineRun(trace, done["items"], window, interference.n_matmuls - matmuls_before if interference else 0,
                     done["checked"])
