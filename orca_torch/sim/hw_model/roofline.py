"""The roofline cost model: the price of one step on the paper GPU over the shared FLOP/byte formula
(lecture §1.1, §2.6, §5.1).

A step is the `SeqWork` list the torch model executes (or its `StepTotals`). Its FLOPs and bytes
come from `ModelSpec.step_flops` / `step_bytes`, the formula the torch model's FlopCounterMode
count is checked against; nothing here counts FLOPs a second way. Per device and per stage:

    time = sum over stages of max(compute, memory) + TP all-reduces + PP transfers + overhead
    overhead = overhead_s + seq_overhead_s x requests in the step
    compute = FLOPs / tp / (peak_flops * flop_efficiency)
    memory  = (weights + K/V of every context token) / (mem_bw * bw_efficiency)

Choices, documented once:
- K/V traffic: each context token crosses HBM once per step, cached tokens read and new tokens
  written; the attention reads the new tokens' K/V from the same step's on-chip output. The charge
  is `n_past + n_new` tokens per request, which is `step_bytes()["kv_read"]`; `kv_write` is reported
  but not charged twice. This gives the lecture's 559 sequences at context 512 within 20 ms
  (charging read and write separately would give 558).
- Activations are reported (`ModelSpec.step_activation_bytes`, unfused) but not charged: at decode
  batch sizes one layer's activations (a few MB) stay in the 50 MB L2, and the lecture counts
  weights and K/V only. `count_activations=True` gives the unfused upper bound.
- Attention FLOPs count the full `n_new x n_ctx` rectangle (`attention="full"`, what a masked
  matmul or SDPA executes and FlopCounterMode counts); `"causal"` counts the pairs the mask keeps.
- Fixed per-step overhead defaults to 0: the anchors (5.99 ms at batch 1) are pure weight reads.
  Real engines add CPU scheduling and launch time (lecture §7); set `overhead_s` to model it.
  `seq_overhead_s` (default 0) is charged per request in the step: the cost of a per-request
  loop such as selective batching's Split/attention/Merge, which dominates eager torch on a CPU
  (`orca_torch.lab.calibrate` fits both from measured steps).
- Tensor parallelism: two all-reduces of the `[n_tokens, hidden]` activations per layer (after
  attention's output projection and after the MLP), ring cost `latency + 2(tp-1)/tp x bytes / link`.
  Pipeline parallelism: one `[n_tokens, hidden]` transfer per stage boundary, each TP rank sending
  its copy over its own link (NVLink when both stages share a node, InfiniBand otherwise). The
  step's latency runs through every stage in turn; `stage_s` is the slowest stage, the interval at
  which Orca's scheduler can inject batches when `n_workers >= pp` (lecture §4.4).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, NamedTuple

import numpy as np

from orca_torch.checks import brief, check_int
from orca_torch.core.batch import SeqWork, StepTotals
from orca_torch.sim.decode_runs import SHORT_RUN, step_ends, steps_to_price
from orca_torch.sim.hw_model.gpus import GPUSpec, get_gpu
from orca_torch.sim.hw_model.layout import Partition
from orca_torch.specs import Attention, ModelSpec, get_model_spec

MEMORY_SIDE_TABLE = 1 << 18
"""Context sums below this have a decode step's memory side looked up, not computed: a table of 2 MiB
at most per pricer (`cost.pricer` caches 128 of them: 256 MiB at the very most)."""

STEP_OVERHEAD_S = 0.0
"""Fixed time added to every step; 0 keeps the lecture's anchors (they are pure weight and K/V reads)."""


@dataclass(frozen=True)
class StepCost:
    """One step's price. `flops` and `bytes` are whole-step totals as the shared formula counts them;
    the times are per device, summed along the pipeline."""

    time_s: float
    stage_s: float
    compute_s: float
    memory_s: float
    comm_s: float
    tp_comm_s: float
    pp_comm_s: float
    overhead_s: float              # overhead_s + seq_overhead_s x requests
    bound: str
    flops: dict[str, int] = field(repr=False)
    bytes: dict[str, int] = field(repr=False)
    tp: int = 1
    pp: int = 1
    cost_model: str = "roofline"
    breakdown: dict[str, float] = field(default_factory=dict, repr=False)  # refined: gemm/attention/... seconds


class StageCoefficients(NamedTuple):
    """Seconds per unit for one device of one pipeline stage: what `StepPricer.time` multiplies.

    For a step with totals T (tokens), P (attention pairs), S (requests), K (context tokens):
    compute = c_tok T + c_pair P + c_seq S; memory = m_fixed + m_kv K + m_tok T + m_seq S;
    the stage costs max(compute, memory) + tp_fixed + tp_tok T + pp_fixed + pp_tok T (`seconds`).
    """

    c_tok: float
    c_pair: float
    c_seq: float
    m_fixed: float
    m_kv: float
    m_tok: float
    m_seq: float
    tp_fixed: float
    tp_tok: float
    pp_fixed: float
    pp_tok: float

    def sides(self, n_tok, pairs, n_seq, n_kv) -> tuple:
        """`(compute, memory)`: one device's seconds of arithmetic and of HBM traffic in this stage for
        a step with these totals, the roofline's two sides, written once: `seconds`, and
        `StepPricer.stage_time` and `StepPricer.cost`, which keep the sides apart, read them here."""
        c_tok, c_pair, c_seq, m_c, m_kv, m_tok, m_seq, _, _, _, _ = self
        return c_tok * n_tok + c_pair * pairs + c_seq * n_seq, m_c + m_kv * n_kv + m_tok * n_tok + m_seq * n_seq

    def links(self, n_tok) -> tuple:
        """`(tp, pp)`: the seconds of this stage's TP all-reduces and of its PP transfer to the next."""
        return self.tp_fixed + self.tp_tok * n_tok, self.pp_fixed + self.pp_tok * n_tok

    def seconds(self, n_tok, pairs, n_seq, n_kv, maximum: Callable | None = None):
        """One device's time in this stage for a step with these totals: the larger of the two
        `sides`, then the links, added left to right. `StepPricer.time` sums it over the stages; the
        decode runs' loops (`decode_run_times`, `decode_run_ends`) are it with `n_tok = n_seq = k` and
        `pairs = n_kv = x`, the products that do not change along a run taken once (the same floats:
        `tests/test_hw_model.py`). Totals are numbers, or numpy arrays with `maximum=np.maximum` (the
        larger side, element-wise)."""
        c, mem = self.sides(n_tok, pairs, n_seq, n_kv)
        _, _, _, _, _, _, _, k_c, k_t, p_c, p_t = self
        return ((c if c > mem else mem) if maximum is None else maximum(c, mem)) + k_c + k_t * n_tok + p_c + p_t * n_tok


TOTALS_LIMIT = 2**63
"""Every total of a priced step is below this (numpy's int64 range): a larger one overflows a float's product."""

_TOTALS_FIELDS = ("n_seqs", "n_tokens", "kv_read_tokens", "attn_pairs_full", "attn_pairs_causal")


def check_totals(t: StepTotals, where: str = "") -> StepTotals:
    """`t` with every field a plain `int`, if it could be the totals of a real step.

    Each field is an integer in [0, 2**63) (not a bool). Every request feeds at least one token and reads
    at least its new ones, and keeps at least the pairs on its causal diagonal, never more than its
    full rectangle (n p + n (n + 1) / 2 <= n (p + n)); so n_seqs <= n_tokens <= kv_read_tokens,
    n_tokens <= attn_pairs_causal <= attn_pairs_full, and an empty step has every field 0.
    `where` ("row 3") starts the error message.
    """
    at = f"{where}: " if where else ""
    if not isinstance(t, StepTotals):
        raise ValueError(f"{at}the step's totals must be a StepTotals, got {brief(t)} ({type(t).__name__})")
    vals = (t.n_seqs, t.n_tokens, t.kv_read_tokens, t.attn_pairs_full, t.attn_pairs_causal)
    if not all(type(v) is int for v in vals) or min(vals) < 0 or max(vals) >= TOTALS_LIMIT:
        vals = tuple(check_int(f"{at}StepTotals.{f}", v, 0) for f, v in zip(_TOTALS_FIELDS, vals))
        for f, v in zip(_TOTALS_FIELDS, vals):
            if v >= TOTALS_LIMIT:
                raise ValueError(f"{at}StepTotals.{f} must be below 2**63, got an integer of {v.bit_length()} bits")
        t = StepTotals(*vals)
    s, n, kv, full, causal = vals
    if not (s <= n <= kv and n <= causal <= full) or (s == 0 and max(vals) > 0):
        raise ValueError(f"{at}inconsistent {t}: need n_seqs <= n_tokens <= kv_read_tokens, "
                         "n_tokens <= attn_pairs_causal <= attn_pairs_full, and every field 0 when n_seqs == 0")
    return t


def _as_totals(works: Iterable[SeqWork] | StepTotals) -> StepTotals:
    """A step's totals: a `StepTotals` as given, a `SeqWork` list summed (the caller's own step;
    `check_totals` is the check for totals from outside)."""
    return works if isinstance(works, StepTotals) else StepTotals.of(works)


def check_rates(gpu: GPUSpec, *rates: tuple[str, float | None, float, str]) -> None:
    """Each `(what, peak, share, unit)` rate a step runs at, `peak x share`, must be at least 1 per second:
    a slower one prices a step of any size past the largest float (and no card is that slow). A link
    the spec lacks (`peak` None) is no link to price a transfer over."""
    for what, peak, share, unit in rates:
        if peak is None:
            raise ValueError(f"{brief(gpu.name)} has no interconnect in its spec; tp and pp must be 1 on it")
        if not peak * share >= 1.0:
            raise ValueError(f"{what} on {brief(gpu.name)} must be at least 1 {unit}, got {peak:g} x {share:g} = "
                             f"{peak * share:g}")


def finite_time(pr, t: StepTotals, seconds):
    """`seconds` (a step's price, or an array of them), if finite; else a ValueError saying what overflowed.

    With rates of at least 1 per second and totals below 2**63, what overflows is the overheads (or
    the link latencies)."""
    if np.all(np.asarray(seconds) < math.inf):
        return seconds
    over = pr.overhead_s + pr.seq_overhead_s * t.n_seqs
    why = (f"overhead_s={pr.overhead_s:g} + seq_overhead_s={pr.seq_overhead_s:g} x {t.n_seqs} requests"
           if not over < math.inf else f"its work at {brief(pr.gpu.name)}'s rates and link latencies")
    raise ValueError(f"the step {t} would take {np.max(seconds)} s: {why} is past the largest float; "
                     "allowed: settings that price it in finite time")


class StepPricer:
    """Prices steps of one (model, GPU, tp, pp, efficiencies) setting in O(1) per step.

    The per-unit costs (FLOPs per token, per attention pair, per request; bytes per context token)
    are read off the shared formula by evaluating it on unit `StepTotals`: the formula is linear in
    those totals, so `time(t)` is a few multiply-adds per pipeline stage. Build one per run and call
    `time` in the simulator's loop; `cost` gives the full breakdown. `cost.pricer` builds it and
    checks every setting first (the door); the constructor trusts them, but for the rates a step
    runs at (`check_rates`: a card's peak times its share, and a link where tp x pp > 1), which
    only the card and the shares together give.
    """

    def __init__(self, model: ModelSpec | str, gpu: GPUSpec | str, *, tp: int = 1, pp: int = 1,
                 flop_efficiency: float | None = None, bw_efficiency: float | None = None,
                 comm_efficiency: float | None = None, overhead_s: float = STEP_OVERHEAD_S,
                 attention: Attention = "full", count_activations: bool = False,
                 seq_overhead_s: float = 0.0) -> None:
        m, g = get_model_spec(model), get_gpu(gpu)
        part = Partition(m, tp, pp)
        tp, pp = part.tp, part.pp
        fe = g.flop_efficiency if flop_efficiency is None else flop_efficiency
        be = g.bw_efficiency if bw_efficiency is None else bw_efficiency
        ce = g.comm_efficiency if comm_efficiency is None else comm_efficiency
        assert attention in ("full", "causal"), attention
        self.model, self.gpu, self.partition = m, g, part
        self.tp, self.pp, self.attention, self.overhead_s = tp, pp, attention, overhead_s
        self.seq_overhead_s = seq_overhead_s
        self.count_activations = count_activations

        # Per-unit costs from the shared formula (linear in the StepTotals fields).
        f_tok = m.step_flops(StepTotals(n_tokens=1), attention)["linear"]
        f_pair = m.step_flops(StepTotals(attn_pairs_full=1, attn_pairs_causal=1), attention)["attention"]
        f_seq = m.step_flops(StepTotals(n_seqs=1), attention)["lm_head"]
        kv_tok = m.step_bytes(StepTotals(kv_read_tokens=1))["kv_read"]
        a_tok = m.step_activation_bytes(StepTotals(n_tokens=1)) if count_activations else 0
        a_seq = m.step_activation_bytes(StepTotals(n_seqs=1)) if count_activations else 0

        flop_rate, byte_rate = g.peak_flops * fe, g.mem_bw * be
        links = (("nvlink_bw x comm_efficiency", g.nvlink_bw, ce, "bytes/s"),
                 ("ib_bw x comm_efficiency", g.ib_bw, ce, "bytes/s")) if part.n_devices > 1 else ()
        check_rates(g, ("peak_flops x flop_efficiency", g.peak_flops, fe, "FLOP/s"),
                    ("mem_bw x bw_efficiency", g.mem_bw, be, "bytes/s"), *links)
        act_bytes = m.hidden * m.dtype_bytes  # one token's [hidden] activation row
        stages = []
        for s, n_layers in enumerate(part.stage_layers):
            phi, last = n_layers / m.n_layers, s == pp - 1
            comm_c = comm_t = 0.0
            if tp > 1:  # 2 ring all-reduces per layer
                bw, lat = self._link(s * tp, s * tp + tp - 1)
                comm_c += 2 * n_layers * lat
                comm_t += 2 * n_layers * 2 * (tp - 1) / tp * act_bytes / (bw * ce)
            pp_c = pp_t = 0.0
            if not last:  # activations to the next stage
                bw, lat = self._link(s * tp, (s + 1) * tp)
                pp_c, pp_t = lat, act_bytes / (bw * ce)
            stages.append(StageCoefficients(
                phi * f_tok / tp / flop_rate, phi * f_pair / tp / flop_rate,
                (f_seq / tp / flop_rate) if last else 0.0,
                part.stage_weight_traffic(s) / byte_rate, part.kv_share(s) * kv_tok / byte_rate,
                phi * a_tok / tp / byte_rate, (a_seq / tp / byte_rate) if last else 0.0,
                comm_c, comm_t, pp_c, pp_t,
            ))
        self._stages = tuple(stages)
        # decode_run_times' vector form: per stage, only the terms whose coefficient is not 0.0.
        self._decode_terms = tuple(
            (s.c_tok, s.c_pair, s.c_seq, s.m_fixed, s.m_kv, tuple(a for a in (s.m_tok, s.m_seq) if a),
             tuple((a, per_tok) for a, per_tok in ((s.tp_fixed, False), (s.tp_tok, True),
                                                   (s.pp_fixed, False), (s.pp_tok, True)) if a))
            for s in self._stages)
        self._short_run_terms: dict[int, tuple[float, list[tuple[float, ...]], np.ndarray]] = {}
        self._memory_side = np.empty(0)          # `_memory_bound_times`' table
        self._one_card = len(stages) == 1 and not (        # one stage, no memory term but m_c and m_kv, no link
            any(s.m_tok or s.m_seq or s.tp_fixed or s.tp_tok or s.pp_fixed or s.pp_tok for s in stages)
            or not (stages[0].c_pair >= 0.0 and stages[0].m_kv >= 0.0))   # (both sides grow with the context)

    @property
    def stages(self) -> tuple[StageCoefficients, ...]:
        """The per-stage coefficients, for callers that vectorise `time` (e.g. over numpy arrays)."""
        return self._stages

    def _link(self, gpu_a: int, gpu_b: int) -> tuple[float, float]:
        """(bandwidth, latency) between two global GPU indices: NVLink inside a node, else InfiniBand."""
        g = self.gpu
        if gpu_a // g.gpus_per_node == gpu_b // g.gpus_per_node:
            return g.nvlink_bw, g.nvlink_latency_s
        return g.ib_bw, g.ib_latency_s

    def time(self, t: StepTotals) -> float:
        """Seconds for one step: the hot path (no validation, no dicts)."""
        if t.n_seqs == 0:
            return 0.0
        n_tok, n_seq, n_kv = t.n_tokens, t.n_seqs, t.kv_read_tokens
        pairs = t.attn_pairs_full if self.attention == "full" else t.attn_pairs_causal
        total = self.overhead_s + self.seq_overhead_s * n_seq
        for stage in self._stages:
            total += stage.seconds(n_tok, pairs, n_seq, n_kv)
        return total

    def stage_time(self, t: StepTotals) -> float:
        """Seconds the slowest pipeline stage is busy in one step (`cost(t).stage_s`): the time
        between two batches entering a pipelined engine. A hot path like `time` (no validation).
        Summed max + (tp terms) + (pp terms), not left to right as `seconds`: code 07's figures keep its last bit."""
        if t.n_seqs == 0:
            return 0.0
        n_tok, n_seq, n_kv = t.n_tokens, t.n_seqs, t.kv_read_tokens
        pairs = t.attn_pairs_full if self.attention == "full" else t.attn_pairs_causal
        slowest = 0.0
        for stage in self._stages:
            c, mem = stage.sides(n_tok, pairs, n_seq, n_kv)
            tp_s, pp_s = stage.links(n_tok)
            slowest = max(slowest, max(c, mem) + tp_s + pp_s)
        return slowest + (self.overhead_s + self.seq_overhead_s * n_seq)

    def decode_run_times(self, k: int, ctx_sum: int, m: int) -> np.ndarray:
        """Seconds for each of `m` consecutive pure-decode steps of the same `k` sequences.

        Before step 0 the sequences' stored contexts sum to `ctx_sum`; every step decodes one token
        per sequence, so step `j` has totals `StepTotals(k, k, c, c, c)` with `c = ctx_sum + k (j + 1)`
        and entry `j` is exactly `time` of those totals. The fast engine (`sim/fast_engine.py`)
        prices a stretch of identical decode iterations (lecture §4.1's steps, with no one joining
        or leaving) in one call, so a simulated run takes milliseconds, instead of `m` calls to
        `time`.

        Exactness: the same float64 operations in the same order as `time`, element-wise over a
        numpy array of the `m` context sums; terms whose coefficient is 0.0 are skipped
        (x + 0.0 == x) and the overhead (`overhead_s + seq_overhead_s * k`, computed as in `time`)
        is added to the first stage rather than the first stage to it (addition commutes exactly).
        Runs of up to 20 steps take a scalar loop, cheaper than numpy's cost per call.
        Returns a new float64 array of length `m` (callers may modify it). `k`, `ctx_sum` and `m`
        are the engine's own counts, plain ints >= 0: not checked again.
        """
        assert type(k) is int and type(ctx_sum) is int and type(m) is int and min(k, ctx_sum, m) >= 0
        if k == 0:
            return np.zeros(m)
        if m <= 20:
            over, stages, _ = self._short_run_terms.get(k) or self._short_run_terms_for(k)
            out = []
            xs = range(ctx_sum + k, ctx_sum + k * (m + 1), k)
            for x in xs:
                total = over
                for a, c_pair, b, m_c, m_kv, mt, ms, k_c, kt, p_c, pt in stages:
                    c = a + c_pair * x + b
                    mem = m_c + m_kv * x + mt + ms
                    total += (c if c > mem else mem) + k_c + kt + p_c + pt
                out.append(total)
            return np.array(out)
        if len(self._stages) == 1:
            over, ((a, c_pair, b, m_c, m_kv, mt, ms, k_c, kt, p_c, pt),), _ = \
                self._short_run_terms.get(k) or self._short_run_terms_for(k)
            if _memory_bound_throughout(a, c_pair, b, m_c, m_kv, mt, ms, ctx_sum + k, ctx_sum + k * m):
                out = np.arange(ctx_sum + k, ctx_sum + k * m + 1, k, dtype=np.int64) * m_kv
                out += m_c
                for term in (mt, ms, k_c, kt, p_c, pt, over):
                    if term:
                        out += term
                return out
        over = self.overhead_s + self.seq_overhead_s * k
        n = float(k)
        ctx = np.arange(ctx_sum + k, ctx_sum + k * (m + 1), k, dtype=np.int64)
        total = None
        for c_tok, c_pair, c_seq, m_c, m_kv, m_add, s_add in self._decode_terms:
            c = c_pair * ctx
            c += c_tok * n
            if c_seq:
                c += c_seq * n
            mem = m_kv * ctx
            mem += m_c
            for a in m_add:
                mem += a * n
            np.maximum(c, mem, out=c)
            for a, per_tok in s_add:
                c += a * n if per_tok else a
            if total is None:
                total = c + over if over else c
            else:
                total += c
        return total

    def decode_run_ends(self, k: int, ctx_sum: int, m: int, t: float, stop_at: float | None = None
                        ) -> list[float] | np.ndarray:
        """When each of those `m` decode steps ends if the first starts at `t`, up to and including
        the first end at or after `stop_at`: `t + d0`, `t + d0 + d1`, ..., each `d` exactly
        `decode_run_times`' entry and the sum the step-by-step loop's `t += time(...)`.

        Steps only get longer along a run, so the cut comes within the steps that
        `decode_runs.steps_to_price` guesses from `d0`. A run of up to `SHORT_RUN` steps (after that
        bound) is priced and summed in one Python loop; a longer one goes through numpy, which costs
        more per call but less per step.
        `k`, `ctx_sum` and `m` are the engine's own counts (plain ints, `m >= 1`), `t` and
        `stop_at` its finite numbers of seconds: not checked again. No step is lost against the
        clock (`t + d == t`, `durations.check_clock`) when the first is longer than the last end's
        ulp, and no sum overflows when the last end is finite; otherwise the sums are redone by
        `decode_runs.step_ends`, where every one is checked. The durations are the pricer's own
        (finite, >= 0), so either path sums them without checking each again.
        """
        if len(self._stages) != 1 or k == 0:
            return step_ends(self.decode_run_times(k, ctx_sum, m), m, t, stop_at)
        over, ((a, c_pair, b, m_c, m_kv, mt, ms, k_c, kt, p_c, pt),), over_0d = \
            self._short_run_terms.get(k) or self._short_run_terms_for(k)
        x = ctx_sum + k
        c = a + c_pair * x + b
        mem = m_c + m_kv * x + mt + ms
        d = over + ((c if c > mem else mem) + k_c + kt + p_c + pt)
        m = steps_to_price(m, d, t, stop_at)
        simple = self._one_card                 # (then the terms below are 0.0)
        memory_bound = simple and a + c_pair * (x + k * (m - 1)) + b < mem    # (`_memory_bound_throughout`)
        if m > SHORT_RUN:                      # numpy: the durations summed in order
            if memory_bound:
                ends = self._memory_bound_times(x, k, m, over_0d)
            else:
                ends = self.decode_run_times(k, ctx_sum, m)
            ends[0] += t
            ends = np.add.accumulate(ends)     # (the same sums as `cumsum`, in order; less to call)
            last = float(ends[-1])
            if stop_at is not None and last >= stop_at:
                ends = ends[:ends.searchsorted(stop_at) + 1]
                last = float(ends[-1])
            if not (last < math.inf and d > math.ulp(last)):    # an overflow, or a step that may be lost: checked
                return step_ends(self.decode_run_times(k, ctx_sum, len(ends)), len(ends), t, stop_at)
            return ends
        stop = math.inf if stop_at is None else stop_at
        start = t
        t += d
        ends = [t]
        if memory_bound:
            for _ in range(m - 1):              # the same sums without the compute side, which never wins
                if t >= stop:
                    break
                x += k
                t += over + (m_c + m_kv * x)
                ends.append(t)
        elif not simple:
            for _ in range(m - 1):
                if t >= stop:
                    break
                x += k
                c = a + c_pair * x + b
                mem = m_c + m_kv * x + mt + ms
                t += over + ((c if c > mem else mem) + k_c + kt + p_c + pt)
                ends.append(t)
        else:                                   # the same sums without the terms that are 0.0 (x + 0.0 == x)
            for _ in range(m - 1):
                if t >= stop:
                    break
                x += k
                c = a + c_pair * x + b
                mem = m_c + m_kv * x
                t += over + (c if c > mem else mem)
                ends.append(t)
        if not d > math.ulp(t):                 # a step may be lost against the clock: sum them where it is checked
            return step_ends(self.decode_run_times(k, ctx_sum, len(ends)), len(ends), start, stop_at)
        return ends

    def _memory_bound_times(self, x: int, k: int, m: int, over: np.ndarray) -> np.ndarray:
        """`decode_run_times` of a one-stage run that stays memory-bound, with no term but the
        stage's `m_fixed`, `m_kv` and `over` (its own sums, without its checks: the common case,
        called often). `m_fixed + m_kv x` is read from a table of it by context sum `x`, built by
        the same products and sums and grown as larger sums come (up to `MEMORY_SIDE_TABLE`
        entries): one slice and one add a run. `over` is a 0-d array (numpy adds it to an array for
        less than a Python float costs it)."""
        m_c, m_kv = self._stages[0].m_fixed, self._stages[0].m_kv
        last = x + k * (m - 1)
        if last >= MEMORY_SIDE_TABLE:
            out = np.arange(x, last + 1, k, dtype=np.int64) * m_kv
            out += m_c
            out += over
            return out
        table = self._memory_side
        if last >= len(table):
            size = min(max(last + 1, 2 * len(table), 4096), MEMORY_SIDE_TABLE)
            table = np.arange(size, dtype=np.int64) * m_kv
            table += m_c
            self._memory_side = table           # (whole before it is shared: the pricer is cached)
        return table[x:last + 1:k] + over

    def _short_run_terms_for(self, k: int) -> tuple[float, list[tuple[float, ...]], np.ndarray]:
        """`time`'s overhead and per-stage terms for a decode step of `k` sequences, with the
        products that do not change along a run taken once (the same products, added in the same
        order: the same floats), and the overhead again as a 0-d array for the numpy path. Kept per
        `k`: a run's batch size recurs all through a simulation."""
        over = self.overhead_s + self.seq_overhead_s * k
        stages = [(c_tok * k, c_pair, c_seq * k, m_c, m_kv, m_tok * k, m_seq * k, k_c, k_t * k, p_c, p_t * k)
                  for c_tok, c_pair, c_seq, m_c, m_kv, m_tok, m_seq, k_c, k_t, p_c, p_t in self._stages]
        self._short_run_terms[k] = terms = over, stages, np.array(over)
        return terms

    def cost(self, works: Iterable[SeqWork] | StepTotals) -> StepCost:
        """The full breakdown of one step (a price past the largest float refused)."""
        t = _as_totals(works)
        m = self.model
        flops = m.step_flops(t, self.attention)
        b = m.step_bytes(t)
        act = m.step_activation_bytes(t)
        by = {"weights": b["weights"], "kv_read": b["kv_read"], "kv_write": b["kv_write"],
              "activations": act, "total": b["total"] + act,
              "hbm": b["weights"] + b["kv_read"] + (act if self.count_activations else 0)}
        over = self.overhead_s + self.seq_overhead_s * t.n_seqs
        if t.n_seqs == 0:
            return StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, "memory", flops, by, self.tp, self.pp)
        n_tok, n_seq, n_kv = t.n_tokens, t.n_seqs, t.kv_read_tokens
        pairs = t.attn_pairs_full if self.attention == "full" else t.attn_pairs_causal
        comp = mem_s = tp_c = pp_c = 0.0
        for stage in self._stages:
            c, mem = stage.sides(n_tok, pairs, n_seq, n_kv)
            k, p = stage.links(n_tok)
            comp, mem_s, tp_c, pp_c = comp + c, mem_s + mem, tp_c + k, pp_c + p
        return StepCost(time_s=finite_time(self, t, self.time(t)), stage_s=self.stage_time(t), compute_s=comp,
                        memory_s=mem_s, comm_s=tp_c + pp_c, tp_comm_s=tp_c, pp_comm_s=pp_c,
                        overhead_s=over, bound="compute" if comp > mem_s else "memory",
                        flops=flops, bytes=by, tp=self.tp, pp=self.pp)


def _memory_bound_throughout(a: float, c_pair: float, b: float, m_c: float, m_kv: float, mt: float, ms: float,
                             x_first: int, x_last: int) -> bool:
    """Is the memory side of one stage's decode step (`m_c + m_kv x + mt + ms`) the larger at every
    context sum `x` from `x_first` to `x_last`? Both sides only grow with `x` (coefficients >= 0,
    and rounding keeps the order), so the compute side at the last step below the memory side at
    the first settles it for every step: `time`'s `max` is then the memory side, the same float."""
    return (c_pair >= 0.0 and m_kv >= 0.0
            and a + c_pair * x_last + b < m_c + m_kv * x_first + mt + ms)
