"""One worker's slice of the model: Megatron-style tensor parallelism inside a layer, contiguous
layer slices across pipeline stages (lecture §4.4; Megatron-LM; Orca §4.4).

A worker at global rank `r` of a `tp x pp` group serves stage `r // tp` (layers
`[stage * L/pp, (stage + 1) * L/pp)`) as tensor-parallel rank `r % tp` of that stage:

- Q/K/V and gate/up are split by columns (output rows of the fused weights): the rank keeps
  `n_heads/tp` query heads, the `n_kv_heads/tp` K/V heads they share (grouped-query attention
  keeps its grouping on every rank) and `intermediate/tp` MLP columns. The output and down
  projections are split by rows (input columns), so each gives a partial sum of the residual
  update: two all-reduces per layer, after attention and after the MLP.
- The embedding and the LM head are split by vocabulary (vocab-parallel, as Megatron does): the
  first stage looks a token up only if it is in its `vocab/tp` rows (zeros otherwise) and one
  all-reduce assembles the rows (exact: each row has a single non-zero term); the last stage
  computes its `vocab/tp` logits and the greedy token is the best of the ranks' (max, index)
  pairs, gathered — the full `[B, vocab]` logits never exist on one rank. Why split rather than
  replicate: in `mini` the two vocabulary matrices are 40% of the parameters, and for a decode the
  head's matmul is as large as 2.7 layers; splitting divides both memory and the head's FLOPs by
  `tp`, at the price of one all-reduce on the first stage and one tiny gather on the last.
- Norms are replicated. K/V is stored per rank for its own heads and its own layers only: each
  worker's `KVManager` is built for its shard's shapes.
- Between stages: after its last all-reduce every tp rank of a stage holds the whole `[T, hidden]`
  activations, and sends them to the same tp rank of the next stage (`tp` point-to-point hops side
  by side; Megatron-LM's scatter/gather, which sends each rank `1/tp` of them and all-gathers after
  the hop, is not done here).

Both parallelisms are applied to the model from outside it, as gpt-fast applies tensor
parallelism: `OrcaModel` holds no rank, no process group and no collective. The shard is an
`OrcaModel` built for the shard's shapes (`ShardLayout.shard_spec`) with its weights copied from
the full model's slices (`slice_state`), so the selective-batching code is the model's own,
through its per-layer seam (`plan_step`, `attention_out`, `mlp_out`, `head`, either attention
path): only the collectives are added here (`StageShard.layers`, `embed`, `greedy`). gpt-fast
cuts the weights of the model in place and adds each all-reduce as a forward hook; here a model
of the shard's shapes is built and the all-reduces are written out in `StageShard.layers`, where
a reader sees them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Hashable, Sequence

import torch
import torch.nn.functional as F

from orca_torch.checks import brief, check_int
from orca_torch.core.batch import SeqWork
from orca_torch.model.kv_cache import KVManager
from orca_torch.model.orca_model import Block, OrcaModel
from orca_torch.model.torch_executor import ban_tokens
from orca_torch.specs import ModelSpec, get_model_spec

NOT_FINITE = -1
"""The token the last stage returns for a row whose largest logit is not finite: the engine refuses it."""


@dataclass(frozen=True)
class ShardLayout:
    """How `tp x pp` workers split a model; refuses a split that does not divide evenly."""

    spec: ModelSpec
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "spec", get_model_spec(self.spec))
        s = self.spec
        for name in ("tp", "pp"):
            object.__setattr__(self, name, check_int(name, getattr(self, name), 1))
        checks = [("tp", self.tp, "n_heads", s.n_heads), ("tp", self.tp, "n_kv_heads", s.n_kv_heads),
                  ("tp", self.tp, "intermediate", s.intermediate), ("tp", self.tp, "vocab", s.vocab),
                  ("pp", self.pp, "n_layers", s.n_layers)]
        for knob, v, field, n in checks:
            if n % v:
                ok = [d for d in range(1, n + 1) if n % d == 0 and (knob == "pp" or _divides_all(s, d))]
                raise ValueError(f"{knob}={v} does not divide {field}={n} of {brief(s.name)}: every rank must hold "
                                 f"whole heads, K/V heads, MLP columns, vocabulary rows and layers; "
                                 f"{knob} may be one of {ok}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def stage_of(self, rank: int) -> int:
        return rank // self.tp

    def tp_rank_of(self, rank: int) -> int:
        return rank % self.tp

    def stage_ranks(self, stage: int) -> list[int]:
        """Global ranks of one stage's tensor-parallel group."""
        return list(range(stage * self.tp, (stage + 1) * self.tp))

    @property
    def layers_per_stage(self) -> int:
        return self.spec.n_layers // self.pp

    def shard_spec(self) -> ModelSpec:
        """Shapes of one worker's shard: a stage's layers, a rank's heads, MLP columns and vocab rows."""
        s, tp = self.spec, self.tp
        return replace(s, name=f"{s.name}/tp{tp}pp{self.pp}", n_layers=self.layers_per_stage,
                       n_heads=s.n_heads // tp, n_kv_heads=s.n_kv_heads // tp,
                       intermediate=s.intermediate // tp, vocab=s.vocab // tp,
                       tied_embeddings=False)   # a tied head gets its own copy on the last stage


def _divides_all(s: ModelSpec, d: int) -> bool:
    return not (s.n_heads % d or s.n_kv_heads % d or s.intermediate % d or s.vocab % d)


def state_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Each key of the whole model's `state_dict` (`OrcaModel(spec).state_dict()`) and its shape; the
    layers' are read off the model's own `Block`, built on the meta device (no memory)."""
    with torch.device("meta"):
        layer = {name: tuple(p.shape) for name, p in Block(spec).named_parameters()}
    shapes = {"embed": (spec.vocab, spec.hidden), "final_norm": (spec.hidden,),
              "lm_head.weight": (spec.vocab, spec.hidden)}
    for g in range(spec.n_layers):
        shapes.update({f"layers.{g}.{name}": shape for name, shape in layer.items()})
    return shapes


def check_state(state: dict, spec: ModelSpec) -> None:
    """Refuse a `state` (a dict) that is not the whole model of `spec`'s weights: each key of
    `state_shapes` (the LM head's may be left out where the spec ties it to the embedding, as
    `slice_state` reads it), a floating-point tensor of its shape, and no other key. Every worker
    cuts its shard from it (`slice_state`), where a key missing, one of another shape or a value that
    is no tensor failed with a traceback in every worker."""
    want = state_shapes(spec)
    optional = {"lm_head.weight"} if spec.tied_embeddings else set()
    problems = []
    for what, keys in (("lacks", [k for k in want if k not in state and k not in optional]),
                       ("holds keys the model has not:", [k for k in state if k not in want])):
        if keys:
            shown = ", ".join(brief(k) for k in keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
            problems.append(f"it {what} {shown}")
    for k, v in state.items():
        if k not in want:
            continue
        if not isinstance(v, torch.Tensor):
            problems.append(f"{k} is {brief(v)}, not a tensor")
        elif tuple(v.shape) != want[k] or not v.is_floating_point():
            problems.append(f"{k} is a {v.dtype} tensor of shape {list(v.shape)}, not a floating-point one of "
                            f"shape {list(want[k])}")
    if problems:
        raise ValueError(f"state must be the whole {brief(spec.name)} model's state_dict (OrcaModel.state_dict(), the "
                         f"model the layout splits): " + "; ".join(problems[:4])
                         + (f"; and {len(problems) - 4} more" if len(problems) > 4 else ""))


def slice_state(state: dict[str, torch.Tensor], layout: ShardLayout, rank: int) -> dict[str, torch.Tensor]:
    """The full model's `state_dict` cut to one rank's shard (keys as the shard `OrcaModel`'s)."""
    s, tp = layout.spec, layout.tp
    stage, tp_rank = layout.stage_of(rank), layout.tp_rank_of(rank)
    qd, kd, idim, vd = s.q_dim // tp, s.kv_dim // tp, s.intermediate // tp, s.vocab // tp
    cols = lambda n: slice(tp_rank * n, (tp_rank + 1) * n)  # noqa: E731  (this rank's block of size n)
    out: dict[str, torch.Tensor] = {}
    first, last = stage == 0, stage == layout.pp - 1
    empty = state["embed"].new_empty(0, s.hidden)
    head = state.get("lm_head.weight", state["embed"])         # tied: the head is the embedding
    out["embed"] = state["embed"][cols(vd)] if first else empty
    out["lm_head.weight"] = head[cols(vd)] if last else empty
    out["final_norm"] = state["final_norm"]
    for local in range(layout.layers_per_stage):
        g = stage * layout.layers_per_stage + local
        src, dst = f"layers.{g}.", f"layers.{local}."
        wqkv = state[src + "wqkv"]                              # output rows: [q | k | v]
        out[dst + "wqkv"] = torch.cat([wqkv[:s.q_dim][cols(qd)], wqkv[s.q_dim:s.q_dim + s.kv_dim][cols(kd)],
                                       wqkv[s.q_dim + s.kv_dim:][cols(kd)]])
        out[dst + "wo"] = state[src + "wo"][:, cols(qd)]
        gu = state[src + "w_gate_up"]                          # output rows: [gate | up]
        out[dst + "w_gate_up"] = torch.cat([gu[:s.intermediate][cols(idim)], gu[s.intermediate:][cols(idim)]])
        out[dst + "w_down"] = state[src + "w_down"][:, cols(idim)]
        out[dst + "attn_norm"] = state[src + "attn_norm"]
        out[dst + "mlp_norm"] = state[src + "mlp_norm"]
    return out


AllReduce = Callable[[torch.Tensor], torch.Tensor]
AllGather = Callable[[torch.Tensor], torch.Tensor]


class StageShard:
    """One rank's weights and forward; `all_reduce` / `all_gather` are the stage's TP collectives
    (identity / a 1-row stack when `tp == 1`), so the same code runs on one process or many."""

    def __init__(self, state: dict[str, torch.Tensor], layout: ShardLayout, rank: int,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 attention: str = "split") -> None:
        self.layout, self.rank = layout, rank
        self.stage, self.tp_rank = layout.stage_of(rank), layout.tp_rank_of(rank)
        self.first, self.last = self.stage == 0, self.stage == layout.pp - 1
        self.model = OrcaModel(layout.shard_spec(), seed=0, device=device, dtype=dtype, attention=attention)
        shard = slice_state(state, layout, rank)
        with torch.no_grad():
            for name in ("embed", "lm_head.weight"):   # unused vocabulary matrices hold no rows
                mod, _, attr = name.rpartition(".")
                owner = self.model.get_submodule(mod) if mod else self.model
                setattr(owner, attr, torch.nn.Parameter(shard.pop(name).to(device, dtype).clone(),
                                                        requires_grad=False))
            for name, p in self.model.named_parameters():
                if name in shard:
                    p.copy_(shard.pop(name))
        assert not shard, f"shard weights left unplaced: {sorted(shard)}"
        self.vocab_lo = self.tp_rank * (layout.spec.vocab // layout.tp)

    def new_kv(self, n_slots: int) -> KVManager:
        """K/V storage for this rank's heads of this stage's layers."""
        return self.model.new_kv(n_slots)

    def plan(self, works: Sequence[SeqWork], ids: Sequence[Hashable], kv: KVManager):
        """The step's layout (positions, masks, K/V views): everything that needs only the control
        message, so a worker prepares it before the activations arrive."""
        assert all(kv.can_append(r, w.n_past, w.n_new) for r, w in zip(ids, works)), "the step does not fit the K/V"
        return self.model.plan_step(works, ids, kv)

    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor, all_reduce: AllReduce) -> torch.Tensor:
        """Vocab-parallel lookup `[T] -> [T, hidden]` (first stage)."""
        m = self.model
        if self.layout.tp == 1:
            return F.embedding(token_ids, m.embed)
        local = token_ids - self.vocab_lo
        inside = (local >= 0) & (local < m.embed.shape[0])
        x = F.embedding(local.clamp(0, m.embed.shape[0] - 1), m.embed)
        return all_reduce(x.masked_fill(~inside[:, None], 0.0))

    @torch.inference_mode()
    def layers(self, x: torch.Tensor, plan, all_reduce: AllReduce) -> torch.Tensor:
        """This stage's decoder layers over the flat `[T, hidden]` activations, two all-reduces each."""
        m = self.model
        for layer in range(m.spec.n_layers):
            x = x + all_reduce(m.attention_out(layer, x, plan))        # row-parallel: partial sums
            x = x + all_reduce(m.mlp_out(layer, x))
        return x

    @torch.inference_mode()
    def greedy(self, x: torch.Tensor, plan, all_gather: AllGather, bans: Sequence[tuple[int, int]] = (),
               returned: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Greedy tokens `[B]` of each request's last new row (last stage): vocab-parallel argmax,
        each `(row, token id)` of `bans` left out (a stop id before its request's `min_tokens`, as
        `torch_executor.ban_stops` does on the whole row), by the rank that holds that token's logit;
        `NOT_FINITE` for a row whose largest logit is not finite (`sampling.check_finite`).
        Also the whole raw logits rows `[len(returned), vocab]` of the `returned` rows, before the
        bans (None if none), for the engine to pick those requests' tokens from, or take their log
        probabilities from (`DistributedExecutor.wait`): both need every logit of the row, so only
        those rows are gathered."""
        logits = self.model.head(x, plan)                               # [B, vocab / tp]
        rows = None
        if returned:
            rows = logits[list(returned)]
            if self.layout.tp > 1:                                      # [tp, R, vocab / tp] -> [R, vocab]
                rows = all_gather(rows.contiguous()).permute(1, 0, 2).reshape(len(returned), -1)
        n = logits.shape[-1]
        logits = ban_tokens(logits, [(row, t - self.vocab_lo) for row, t in bans if 0 <= t - self.vocab_lo < n])
        idx = logits.argmax(dim=-1)
        best = logits.gather(-1, idx[:, None])[:, 0]                    # (NaN where the row holds one)
        if self.layout.tp > 1:
            vals = all_gather(best)                                     # [tp, B]
            idxs = all_gather(idx + self.vocab_lo)                      # [tp, B]
            winner = vals.argmax(dim=0)[None]                           # first (lowest-vocab) rank on ties
            idx, best = idxs.gather(0, winner)[0], vals.gather(0, winner)[0]
        return idx.masked_fill(~torch.isfinite(best), NOT_FINITE), rows

    @staticmethod
    def commit(plan) -> None:
        """The step's new K/V is stored (copied back from a gathered layout) and counted."""
        plan.kv.finish()
