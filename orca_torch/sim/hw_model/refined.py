"""The refined cost model: one step priced GEMM by GEMM, with the kernels the roofline leaves out (beyond the lecture).

Same interface as the roofline `StepPricer` (`time`, `stage_time`, `cost`, `decode_run_times`; no
`decode_run_ends`, so a run of decodes is summed by `decode_runs.step_ends`), chosen with
`pricer(model, gpu, cost_model="refined")`. Per device and per pipeline stage a step costs

    GEMMs        sum over the layer's projections and the LM head (M tokens x N x K on this TP shard) of
                 (t_c^p + t_m^p)^(1/p),  t_c = 2 (M + ramp) N K / (peak x gemm_flop_ceiling),
                                         t_m = (M K + N K + M N) x dtype / (bw x gemm_bw_ceiling)
    attention    max(FLOPs of the tiles a causal FlashAttention-style kernel executes / (peak x
                 attention_flop_efficiency), K/V bytes / (bw x gemm_bw_ceiling))
    elementwise  kernels x kernel_floor_s + traffic of the unfused ops / (bw x elementwise_bw_efficiency):
                 norms, rotary, the MLP activation, residual adds, the K/V cache write's launch, the
                 embedding gather (one row per token, not the whole table) and the final norm
    comm         the roofline's TP all-reduces and PP transfers, unchanged
    overhead     launch_overhead_s + seq_overhead_s x requests, once per step

so a GEMM's efficiency rises with its size and arithmetic intensity toward the card's ceilings
instead of being one constant (the constants and their sources: `refined_params`).

Attention by tiles (`attention="causal-tiles"`): a query block of `tile` rows reads key blocks of
`tile` columns up to its last row's diagonal, so each query row beyond a request's first block pays
about (tile - 1) / 2 masked pairs on top of the causal ones; a request with at most `tile` new
tokens computes its whole `n_new x n_ctx` rectangle. From `StepTotals` alone this is
`causal + min(full - causal, (tile - 1) / 2 x n_tokens)`: exact for decodes and for a prompt whose
length is a multiple of the tile or at most one tile, within two tiles per row otherwise. `"full"` and
`"causal"` count as the roofline does; the default is the card's (`RefinedParams.attention`: "full"
for the torch model on a CPU).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from orca_torch.core.batch import SeqWork, StepTotals
from orca_torch.sim.hw_model.gpus import GPUSpec, get_gpu
from orca_torch.sim.hw_model.refined_params import ATTENTION_MODES, ELEMENTWISE_KERNELS_PER_LAYER, RefinedParams
from orca_torch.sim.hw_model.roofline import (StepCost, StepPricer, _as_totals, check_rates,
                                              finite_time)
from orca_torch.specs import ModelSpec, get_model_spec


@dataclass(frozen=True)
class _Gemm:
    """One device's GEMM `[M, k] @ [k, n]` (M = tokens, or requests for the LM head), `count` per step."""

    n: int
    k: int
    count: int
    a: float   # seconds per (row + ramp): 2 N K / compute rate
    w: float   # seconds of the weight read: N K dtype / memory rate
    b: float   # seconds per row of activations in and out: (K + N) dtype / memory rate


@dataclass(frozen=True)
class _Stage:
    layer_gemms: tuple[_Gemm, ...]
    head: _Gemm | None
    c_pair: float
    m_kv: float
    e_fixed: float
    e_tok: float
    e_seq: float
    e_bytes_tok: int
    e_bytes_seq: int
    k_c: float
    k_t: float
    p_c: float
    p_t: float


class RefinedPricer:
    """Prices steps of one (model, GPU, tp, pp, refined parameters) setting; see the module docstring.

    `cost.pricer` builds it and checks every setting first (the door), as does calibration with
    `params` (a `RefinedParams`, checked when made); the constructor trusts them."""

    cost_model = "refined"

    def __init__(self, model: ModelSpec | str, gpu: GPUSpec | str, *, tp: int = 1, pp: int = 1,
                 comm_efficiency: float | None = None, overhead_s: float | None = None,
                 attention: str | None = None, attention_tile: int | None = None,
                 seq_overhead_s: float | None = None, params: RefinedParams | None = None) -> None:
        m, g = get_model_spec(model), get_gpu(gpu)
        prm = g.refined if params is None else params
        attention = prm.attention if attention is None else attention
        assert isinstance(prm, RefinedParams) and attention in ATTENTION_MODES, (prm, attention)
        overhead_s = prm.launch_overhead_s if overhead_s is None else overhead_s
        seq_overhead_s = prm.seq_overhead_s if seq_overhead_s is None else seq_overhead_s
        tile = prm.attention_tile if attention_tile is None else attention_tile
        roof = StepPricer(m, g, tp=tp, pp=pp, comm_efficiency=comm_efficiency)
        part = roof.partition
        tp, pp = part.tp, part.pp
        self.model, self.gpu, self.partition, self.params = m, g, part, prm
        self.tp, self.pp, self.attention = tp, pp, attention
        self.tile = tile
        self._half_tile = (min(tile, m.max_context) - 1) / 2     # (a tile past every sequence prices as one that long)
        self.overhead_s, self.seq_overhead_s = overhead_s, seq_overhead_s
        self._p, self._ramp = float(prm.overlap), float(prm.gemm_ramp_tokens)

        check_rates(g, ("peak_flops x gemm_flop_ceiling", g.peak_flops, prm.gemm_flop_ceiling, "FLOP/s"),
                    ("mem_bw x gemm_bw_ceiling", g.mem_bw, prm.gemm_bw_ceiling, "bytes/s"),
                    ("peak_flops x attention_flop_efficiency", g.peak_flops, prm.attention_flop_efficiency, "FLOP/s"),
                    ("mem_bw x elementwise_bw_efficiency", g.mem_bw, prm.elementwise_bw_efficiency, "bytes/s"))
        flop_rate = g.peak_flops * prm.gemm_flop_ceiling
        byte_rate = g.mem_bw * prm.gemm_bw_ceiling
        attn_rate = g.peak_flops * prm.attention_flop_efficiency
        elem_rate = g.mem_bw * prm.elementwise_bw_efficiency
        dt = m.dtype_bytes

        def gemm(n: int, k: int, count: int) -> _Gemm:
            return _Gemm(n, k, count, 2 * n * k / flop_rate, n * k * dt / byte_rate, (n + k) * dt / byte_rate)

        kvpd, n_up = part.kv_heads_per_device, (2 if m.mlp == "swiglu" else 1)
        shard = ((m.q_dim // tp + 2 * kvpd * m.head_dim, m.hidden), (m.hidden, m.q_dim // tp),
                 (n_up * m.intermediate // tp, m.hidden), (m.hidden, m.intermediate // tp))
        # Shapes at tp=1, for the FLOP count (the torch model's four matmuls per block).
        self._full_shapes = ((m.q_dim + 2 * m.kv_dim, m.hidden), (m.hidden, m.q_dim),
                             (n_up * m.intermediate, m.hidden), (m.hidden, m.intermediate))
        rotary = not m.learned_positions
        h, q_dev, kv_dev = m.hidden, m.q_dim // tp, kvpd * m.head_dim
        act = (3 if m.mlp == "swiglu" else 2) * m.intermediate // tp
        per_layer_elems = 2 * (2 * h) + (2 * (q_dev + kv_dev) if rotary else 0) + act + 2 * (3 * h)
        kernels_per_layer = ELEMENTWISE_KERNELS_PER_LAYER - (0 if rotary else 1)
        stages = []
        for s, n_layers in enumerate(part.stage_layers):
            first, last = s == 0, s == pp - 1
            rc = roof.stages[s]
            kernels = kernels_per_layer * n_layers
            e_tok = per_layer_elems * n_layers
            if first:  # the gather: read one table row per token, write it (+ learned positions, added)
                kernels += 2 if m.learned_positions else 1
                e_tok += 2 * h + (3 * h if m.learned_positions else 0)
            e_seq = 2 * h if last else 0  # the final norm on the LM head's rows
            kernels += 1 if last else 0
            stages.append(_Stage(
                tuple(gemm(n, k, n_layers) for n, k in shard),
                gemm(-(-m.vocab // tp), h, 1) if last else None,
                4 * n_layers * (m.n_heads // tp) * m.head_dim / attn_rate,
                part.kv_share(s) * m.kv_bytes_per_token / byte_rate,
                kernels * prm.kernel_floor_s, e_tok * dt / elem_rate, e_seq * dt / elem_rate,
                e_tok * dt, e_seq * dt, rc.tp_fixed, rc.tp_tok, rc.pp_fixed, rc.pp_tok))
        self._stages = tuple(stages)
        self._memo: dict[tuple[int, int], tuple[float, ...]] = {}

    # ---- the pieces ---------------------------------------------------------------------------------
    def _gemm_one(self, gm: _Gemm, rows: int) -> tuple[float, float, float]:
        """(time, compute part, memory part) of `gm.count` GEMMs on `rows` tokens."""
        c = gm.a * (rows + self._ramp)
        mem = gm.w + gm.b * rows
        hi = c if c > mem else mem
        p = self._p
        t = hi * ((c / hi) ** p + (mem / hi) ** p) ** (1.0 / p)
        return gm.count * t, gm.count * c, gm.count * mem

    def _fixed(self, st: _Stage, n_tok: int, n_seq: int) -> float:
        """Everything of one stage except attention, for a step of `n_tok` tokens and `n_seq` requests.
        The communication is summed left to right, not as `stage_time`'s (TP) + (PP): `time` keeps its last bit."""
        g, _, e, k, _ = self._parts(st, n_tok, n_seq, 0, 0)
        return g + e + (k + st.p_c + st.p_t * n_tok)

    def _parts(self, st: _Stage, n_tok: int, n_seq: int, pairs: float, n_kv: int) -> tuple[float, ...]:
        """One stage's seconds in a step, by kind: (GEMMs, attention, elementwise, TP all-reduces, PP
        transfers), the formulas of the module docstring; `stage_time` adds them in this order, `cost`
        reports them."""
        g = 0.0
        for gm, rows in self._gemm_rows(st, n_tok, n_seq):
            g = g + self._gemm_one(gm, rows)[0]
        return (g, self._attention(st, pairs, n_kv), st.e_fixed + st.e_tok * n_tok + st.e_seq * n_seq,
                st.k_c + st.k_t * n_tok, st.p_c + st.p_t * n_tok)

    @staticmethod
    def _attention(st: _Stage, pairs: float, n_kv: int) -> float:
        """One stage's attention seconds: its FLOPs' or its K/V reads', the larger."""
        a, b = st.c_pair * pairs, st.m_kv * n_kv
        return a if a > b else b

    def _pairs(self, t: StepTotals):
        if self.attention == "full":
            return t.attn_pairs_full
        if self.attention == "causal":
            return t.attn_pairs_causal
        extra, cap = t.attn_pairs_full - t.attn_pairs_causal, self._half_tile * t.n_tokens
        return t.attn_pairs_causal + (extra if extra < cap else cap)

    # ---- the StepPricer interface -------------------------------------------------------------------
    def time(self, t: StepTotals) -> float:
        """Seconds for one step (no validation)."""
        if t.n_seqs == 0:
            return 0.0
        n_tok, n_seq, n_kv = t.n_tokens, t.n_seqs, t.kv_read_tokens
        pairs = self._pairs(t)
        total = self.overhead_s + self.seq_overhead_s * n_seq
        for st, fixed in zip(self._stages, self._fixed_all(n_tok, n_seq)):
            total += fixed + self._attention(st, pairs, n_kv)
        return total

    def _fixed_all(self, n_tok: int, n_seq: int) -> tuple[float, ...]:
        """`_fixed` of every stage, remembered per (tokens, requests): a run repeats few shapes."""
        key = (n_tok, n_seq)
        hit = self._memo.get(key)
        if hit is None:
            if len(self._memo) >= 1 << 16:
                self._memo.clear()
            hit = self._memo[key] = tuple(self._fixed(st, n_tok, n_seq) for st in self._stages)
        return hit

    def decode_run_times(self, k: int, ctx_sum: int, m: int) -> np.ndarray:
        """Seconds of each of `m` consecutive pure-decode steps of the same `k` sequences, entry `j`
        exactly `time(StepTotals(k, k, c, c, c))` with `c = ctx_sum + k (j + 1)` (as `StepPricer`).

        Only attention changes from step to step, and for decodes it is `max(c_pair c, m_kv c)`:
        the rest of each stage is computed once by the code `time` uses, and the same float64
        operations run element-wise in the same order.
        """
        assert type(k) is int and type(ctx_sum) is int and type(m) is int and min(k, ctx_sum, m) >= 0
        if k == 0:
            return np.zeros(m)
        if m < 12:
            return np.array([self.time(StepTotals(k, k, c, c, c))
                             for c in range(ctx_sum + k, ctx_sum + k * (m + 1), k)], dtype=float)
        ctx = np.arange(ctx_sum + k, ctx_sum + k * (m + 1), k, dtype=np.int64)
        total = np.full(m, self.overhead_s + self.seq_overhead_s * k)
        for st, fixed in zip(self._stages, self._fixed_all(k, k)):
            attn = np.maximum(st.c_pair * ctx, st.m_kv * ctx)
            total += fixed + attn
        return total

    @staticmethod
    def _gemm_rows(st, n_tok: int, n_seq: int) -> list:
        """A stage's GEMMs with the rows each multiplies: the layers' on every token, the LM head's
        on one row per sequence."""
        return [(gm, n_tok) for gm in st.layer_gemms] + ([(st.head, n_seq)] if st.head else [])

    def stage_time(self, t: StepTotals) -> float:
        """Seconds the slowest pipeline stage is busy in one step (`cost(t).stage_s`), unvalidated."""
        if t.n_seqs == 0:
            return 0.0
        n_tok, n_seq, n_kv = t.n_tokens, t.n_seqs, t.kv_read_tokens
        pairs = self._pairs(t)
        slowest = 0.0
        for st in self._stages:
            g, a, e, k, p = self._parts(st, n_tok, n_seq, pairs, n_kv)
            slowest = max(slowest, g + a + e + k + p)
        return slowest + (self.overhead_s + self.seq_overhead_s * n_seq)

    def cost(self, works: Iterable[SeqWork] | StepTotals):
        """The full breakdown of one step (a price past the largest float refused); `breakdown` holds GEMMs, attention,
        elementwise, communication and overhead seconds (summed along the pipeline)."""
        t = _as_totals(works)
        m = self.model
        pairs = self._pairs(t)
        pairs_n = int(pairs) if pairs == int(pairs) else pairs  # the tile estimate can end in a half pair
        lin = sum(2 * t.n_tokens * n * k for n, k in self._full_shapes) * m.n_layers
        head = 2 * t.n_seqs * m.hidden * m.vocab
        attn_flops = 4 * m.n_layers * m.n_heads * m.head_dim * pairs_n
        flops = {"linear": lin, "attention": attn_flops, "lm_head": head, "total": lin + attn_flops + head,
                 "attention_pairs": pairs_n}
        sb = m.step_bytes(t)
        table = m.vocab * m.hidden * m.dtype_bytes
        gathered = min(t.n_tokens, m.vocab) * m.hidden * m.dtype_bytes if t.n_seqs else 0
        weights = sb["weights"] - (table - gathered if t.n_seqs and m.lm_head_params else 0)
        elem = sum(st.e_bytes_tok * t.n_tokens + st.e_bytes_seq * t.n_seqs for st in self._stages) * self.tp
        by = {"weights": weights, "kv_read": sb["kv_read"], "kv_write": sb["kv_write"], "elementwise": elem,
              "total": weights + sb["kv_read"] + elem}
        zero = {"gemm_s": 0.0, "attention_s": 0.0, "elementwise_s": 0.0, "comm_s": 0.0, "overhead_s": 0.0}
        if t.n_seqs == 0:
            return StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, "memory", flops, by, self.tp, self.pp,
                            cost_model=self.cost_model, breakdown=zero)
        n_tok, n_seq, n_kv = t.n_tokens, t.n_seqs, t.kv_read_tokens
        over = self.overhead_s + self.seq_overhead_s * n_seq
        comp = mem_s = g_s = a_s = e_s = tp_c = pp_c = 0.0
        for st in self._stages:
            for gm, rows in self._gemm_rows(st, n_tok, n_seq):      # (the compute and memory sides, apart)
                _, cc, mm = self._gemm_one(gm, rows)
                comp, mem_s = comp + cc, mem_s + mm
            comp, mem_s = comp + st.c_pair * pairs, mem_s + st.m_kv * n_kv + st.e_tok * n_tok + st.e_seq * n_seq
            gt, at, et, kc, pc = self._parts(st, n_tok, n_seq, pairs, n_kv)
            g_s, a_s, e_s, tp_c, pp_c = g_s + gt, a_s + at, e_s + et, tp_c + kc, pp_c + pc
        breakdown = {"gemm_s": g_s, "attention_s": a_s, "elementwise_s": e_s, "comm_s": tp_c + pp_c,
                     "overhead_s": over}
        return StepCost(time_s=finite_time(self, t, self.time(t)), stage_s=self.stage_time(t), compute_s=comp,
                        memory_s=mem_s, comm_s=tp_c + pp_c, tp_comm_s=tp_c, pp_comm_s=pp_c, overhead_s=over,
                        bound="compute" if comp > mem_s else "memory", flops=flops, bytes=by, tp=self.tp,
                        pp=self.pp, cost_model=self.cost_model, breakdown=breakdown)
