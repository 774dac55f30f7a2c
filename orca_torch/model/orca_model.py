"""A small Llama-style decoder that runs Orca's selective batching (lecture §4.2, §5.1).

One forward call executes one iteration for any mix of requests, each described by a
`SeqWork(n_new, n_past)`: a whole prompt, a later chunk of a prompt, or a one-token decode.

- Every op that treats tokens independently (embedding, RMSNorm, the Q/K/V and output projections,
  rotary positions, SwiGLU MLP, residual adds) runs once on the flat `[sum L, H]` matrix of all
  new tokens (the LM head too, on the rows it needs: below): the weights are read once for the
  whole step, which is all batching buys (on a CPU the MLP of a step longer than `MLP_ROWS` rows
  runs block by block: its weights are read once per block of that many rows, and its
  temporaries stay in cache).
- Attention is the only op that needs to know which request a token belongs to. With
  `attention="split"` (the default, the lecture's reference, what a debugger steps through) the
  flat Q and the new K/V are `torch.split` per request, each request writes its new K/V into its
  own slots of the `KVManager` (in place) and attends to its own K/V only (causal within its new
  tokens), and the per-request outputs are `torch.cat` back to `[sum L, H]` (Orca's Split / Merge).
  With `attention="fused"` one call per layer serves many requests (`fused_attention.py`): on CUDA
  in fp16/bf16 a variable-length kernel over every row of the step (reading paged K/V through the
  block tables where the kernel takes the blocks, else over a flat gathered copy); elsewhere the
  one-token rows attend as one padded batch and longer rows go through the split loop.
  `OrcaModel.step_path` is the one place that picks among these.
- The LM head runs on one row per work item, the last new token of each request: the convention
  of `ModelSpec.step_flops`, so the FLOPs counted on this forward equal the shared formula
  (for the fused path, over the rectangle `executed_works` names).

All access to stored K/V goes through the view the store gives the step (`KVStore.step_view`, a
`kv_views.StepView`), so a K/V store of one's own plugs in without a change here; one layer's work
on the flat activations is `run_layer(layer, x, plan)`, so a sharded or pipelined executor can run
layers one by one with the same plan.

Tensor and pipeline parallelism (lecture §4.4) are not in this file: they are applied to the model
from outside it, as gpt-fast applies tensor parallelism to its model, so this code knows nothing
of ranks. `orca_torch.distributed.shard` builds an `OrcaModel` of one rank's shapes (a stage's
layers, a rank's heads, MLP columns and vocabulary rows), copies that rank's slices of the
weights in, and calls `plan_step`, `attention_out`, `mlp_out` and `head` with an all-reduce after
each branch (`StageShard.layers`); the pipeline's stages are those shards on other processes.

`forward_padded` is the reference the lecture argues against: every request padded to
`[B, L_max, H]`, and attention to `[B, L_max, K_max]`. It gives the same logits and exists to
show, by counting, what padding wastes (§3.2, exercise 4).

The architecture follows Llama (RMSNorm, rotary positions with optional Llama 3 / linear
scaling, grouped-query attention, SwiGLU, untied or tied LM head); Q/K/V and gate/up are each
stored as one fused matrix, as gpt-fast does, which changes neither the parameter count nor the
FLOPs. `OrcaModel.from_hf` loads a transformers Llama checkpoint into it (`hf_llama.py`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Hashable, Literal, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from orca_torch.checks import (GOT_LIMIT, brief, check_device, check_fits_in_memory, check_flag, check_instance,
                               check_int, check_seed)
from orca_torch.core.batch import SeqWork, padded_shape
from orca_torch.model.fused_attention import (BLOCK_TABLE_ARGS, VarlenKernel, batched_decode_attention,
                                              block_table_attention, torch_varlen_kernel, varlen_attention)
from orca_torch.model.hf_llama import check_range, load_weights, read_hf
from orca_torch.model.kv_cache import KVManager, KVStore, check_dtype, check_spec
from orca_torch.model.kv_views import BlockTableKV, FlatKV, PaddedKV, StepView
from orca_torch.model.paged_kv_cache import PagedKVManager
from orca_torch.model.sampling import check_finite
from orca_torch.specs import PRESETS, ModelSpec

AttentionPath = Literal["split", "fused"]
ATTENTION_PATHS = ("split", "fused")
StepPath = Literal["split", "batched", "varlen", "block_table"]


@dataclass
class StepPlan:
    """Everything about a step's layout that does not change from layer to layer."""

    sizes: list[int]                 # n_new per request: the split sizes of the flat matrix
    past: list[int]                  # n_past per request
    cos: torch.Tensor                # [sum L, 1, d/2] rotary tables of every new token
    sin: torch.Tensor
    last_rows: torch.Tensor          # [B] row of each request's last new token in the flat matrix
    kv: StepView                     # the step's K/V, in the layouts below
    split_idx: list[int]             # requests that go through the split loop
    split_views: list[tuple]         # per split request: per-layer (slots, K^T, V) views
    masks: list[torch.Tensor | None] # per split request [group*L, n_ctx] True = masked; None for L == 1
    decodes: PaddedKV | None = None  # fused: the one-token rows, batched
    decode_rows: torch.Tensor | None = None  # [B_d] their rows in the flat matrix
    split_rows: torch.Tensor | None = None   # rows of the split requests (when decodes is set)
    flat: FlatKV | None = None       # fused with a variable-length kernel: every row
    blocks: BlockTableKV | None = None  # fused with a block-table kernel on paged K/V: every row


MLP_ROWS = 512  # CPU: the MLP runs on blocks of this many token rows (see `OrcaModel.mlp_out`)


class Block(nn.Module):
    """One decoder layer's weights: RMSNorm -> GQA attention -> RMSNorm -> SwiGLU MLP."""

    def __init__(self, spec: ModelSpec, **where) -> None:
        super().__init__()
        s = spec
        self.attn_norm = nn.Parameter(torch.ones(s.hidden, **where))
        self.wqkv = nn.Parameter(torch.empty(s.q_dim + 2 * s.kv_dim, s.hidden, **where))
        self.wo = nn.Parameter(torch.empty(s.hidden, s.q_dim, **where))
        self.mlp_norm = nn.Parameter(torch.ones(s.hidden, **where))
        self.w_gate_up = nn.Parameter(torch.empty(2 * s.intermediate, s.hidden, **where))
        self.w_down = nn.Parameter(torch.empty(s.hidden, s.intermediate, **where))


class LMHead(nn.Module):
    """The output projection, a submodule so FlopCounterMode can attribute its FLOPs. Its weight is
    the embedding table itself when the spec ties them. (`nn.Linear` would draw its default init
    from the global RNG; this one is filled by the seed.)"""

    def __init__(self, hidden: int, vocab: int, **where) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, hidden, **where))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """Rotary inverse frequencies `[d/2]` (float64), with the spec's context scaling applied.

    Float64, as are the angles `position x frequency` (`OrcaModel._set_rope_tables`), so each table
    entry is the cosine or sine of the exact angle rounded once. Transformers' Llama computes both in
    float32, and its tables drift from these as the position grows: by up to 2e-6 within 40 positions,
    1.4e-4 at 2,048, 5.8e-4 at 8,192 and 9.3e-3 at 131,072 (head_dim 128, theta 5e5). Its logits do
    too. On tests/test_from_hf.py's two models at their 40 positions, ours differ from its by 2.7e-7
    and 3.6e-7, and by 2.1e-7 and 3.0e-7 with its float32 tables (bit for bit): other rounding, so
    matching it would not tighten that test. With attention made sharp (q and k weights x 8) over
    2,048 positions, ours differ from its by 6.5e-6 and 4.1e-6, where ours are 2.6e-7 and 3.6e-7 from
    a float64 run and its 6.4e-6 and 4.1e-6: the gap is transformers' rounding, not ours. A side-by-side
    comparison with it at long contexts should allow for that much."""
    d = spec.head_dim
    inv = 1.0 / spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    sc = spec.rope_scaling
    if sc is None:
        return inv
    if sc.kind == "linear":
        return inv / sc.factor
    wavelen = 2 * math.pi / inv
    low_wl = sc.original_max_position / sc.low_freq_factor     # longer than this: divided by factor
    high_wl = sc.original_max_position / sc.high_freq_factor   # shorter than this: kept
    smooth = (sc.original_max_position / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
    blended = (1 - smooth) * inv / sc.factor + smooth * inv
    return torch.where(wavelen > low_wl, inv / sc.factor, torch.where(wavelen < high_wl, inv, blended))


def rope_table_bytes(spec: ModelSpec) -> int:
    """Host memory `OrcaModel` takes to build its rotary tables: per position and frequency, the
    float64 angle and the float64 cos or sin being computed, beside the two float32 tables kept. A
    long `max_context` makes them outweigh a small model's weights, so the memory check counts them."""
    return spec.max_context * (spec.head_dim // 2) * (8 + 8 + 2 * 4)


def check_attention(value) -> AttentionPath:
    """`value` itself if it names an attention path ("split" or "fused")."""
    if value not in ATTENTION_PATHS:
        raise ValueError(f"attention must be one of {ATTENTION_PATHS}, got {brief(value)}")
    return value


def check_buildable(spec: ModelSpec | str) -> ModelSpec:
    """The spec (a preset by name) if `OrcaModel` can build it: Llama-style, an even head_dim.
    Checks only the shapes, so a command-line tool can refuse a preset before allocating anything. An
    unknown name is told the presets it builds, not every preset: the others would be refused next."""
    if isinstance(spec, str) and spec.lower() not in PRESETS:      # (as `get_model_spec` looks a name up)
        raise ValueError(f"unknown model preset {brief(spec)}; known presets: {', '.join(buildable_presets())} "
                         "(the Llama-style ones, which the torch model builds)")
    spec = check_spec(spec)
    if (spec.mlp, spec.norm) != ("swiglu", "rmsnorm") or spec.learned_positions or spec.bias:
        raise ValueError(f"OrcaModel builds Llama-style specs only (SwiGLU, RMSNorm, rotary positions, no bias); "
                         f"{brief(spec.name)} is not one")
    if spec.head_dim % 2:
        raise ValueError(f"rotary positions need an even head_dim, got {spec.head_dim}")
    return spec


def buildable_presets() -> list[str]:
    """The presets `check_buildable` passes, sorted: the ones a tool's `--model` takes and names."""
    out = []
    for name in sorted(PRESETS):
        try:
            check_buildable(name)
        except ValueError:
            continue
        out.append(name)
    return out


def torch_spec(model: OrcaModel | ModelSpec | str) -> ModelSpec:
    """An `OrcaModel`'s spec, or the buildable spec (a preset by name) one would be built from: what
    a call taking either checks its other arguments against before it builds the model."""
    if isinstance(model, OrcaModel):
        return model.spec
    return check_buildable(check_instance("model", model, (OrcaModel, ModelSpec, str)))


class OrcaModel(nn.Module):
    """Llama-style decoder built from a `ModelSpec`, randomly initialised from `seed`.

    Call `forward_batch` (or the module itself) with the flat token ids of one step, the step's
    `SeqWork` list, the request ids and the K/V store holding their K/V (a `KVManager`, a
    `PagedKVManager`, or any `KVStore` of one's own: `check_kv`). `attention` ("split" or "fused")
    picks the attention path and may be switched between steps. `varlen_kernel` (flat K/V) and
    `block_table_kernel` (paged K/V) are torch's `varlen_attn` where it runs, else None; either may be
    replaced by any function with its signature (a CPU reference in the tests).

    The weights are made where they live, in their dtype (no fp32 copy on the host first); on the
    CPU a model larger than the memory available is refused before any is allocated, and on any
    device rotary tables for a `max_context` the host cannot hold (`rope_table_bytes`). `spec` is
    the spec given with `dtype_bytes` set to `dtype`'s, so every byte count taken from it (weights,
    K/V per token, `step_bytes`) is that of the tensors the model holds.
    `init_weights=False` leaves them unset, for a caller that loads its own (`from_hf`).
    """

    def __init__(self, spec: ModelSpec | str, seed: int = 0, device: str | torch.device = "cpu",
                 dtype: torch.dtype | str = torch.float32, attention: AttentionPath = "split", *,
                 init_weights: bool = True) -> None:
        super().__init__()
        seed = check_seed(seed)
        spec = check_buildable(spec)
        dtype = check_dtype(dtype)
        device = torch.device(check_device(device))
        # Off the CPU the weights take no host memory; the rotary tables are built on the host in any case.
        weight_bytes = spec.n_params * dtype.itemsize if device.type == "cpu" else 0
        weights = f"{spec.n_params:,} parameters in {dtype}, " if weight_bytes else ""
        check_fits_in_memory(f"OrcaModel {brief(spec.name)} ({weights}rotary tables for "
                             f"max_context={spec.max_context:,} positions)", weight_bytes + rope_table_bytes(spec))
        self.spec = spec.with_dtype_bytes(dtype.itemsize)
        self.group = spec.n_heads // spec.n_kv_heads
        self.attention = attention
        where = {"device": device, "dtype": dtype}      # built in place: no fp32 copy on the host first
        self.embed = nn.Parameter(torch.empty(spec.vocab, spec.hidden, **where))
        self.layers = nn.ModuleList(Block(spec, **where) for _ in range(spec.n_layers))
        self.final_norm = nn.Parameter(torch.ones(spec.hidden, **where))
        self.lm_head = LMHead(spec.hidden, spec.vocab, **where)
        if spec.tied_embeddings:
            self.lm_head.weight = self.embed
        if check_flag("init_weights", init_weights):
            self._init_weights(seed)
        self.requires_grad_(False)

        self._set_rope_tables()
        self._set_kernels()
        n = sum(p.numel() for p in self.parameters())
        assert n == spec.n_params, f"model has {n} parameters but ModelSpec.n_params says {spec.n_params}"

    def _set_rope_tables(self) -> None:
        """The rotary tables on the weights' device, holding what the weights' dtype can; the rotation
        itself runs in fp32. The angles are float64 (`rope_inv_freq` says why, and what that differs by)."""
        s, dtype = self.spec, self.dtype
        angles = torch.arange(s.max_context, dtype=torch.float64)[:, None] * rope_inv_freq(s)[None, :]
        for name, fn in (("rope_cos", torch.cos), ("rope_sin", torch.sin)):     # one at a time (its memory check)
            self.register_buffer(name, fn(angles).float().to(dtype).to(self.device, torch.float32), persistent=False)

    def _set_kernels(self, keep: tuple[bool, bool] = (False, False)) -> None:
        """Torch's kernels for the weights' device and dtype, but where `keep` says one was replaced."""
        if not keep[0]:
            self.varlen_kernel: VarlenKernel | None = torch_varlen_kernel(self.device, self.dtype)
        if not keep[1]:
            self.block_table_kernel: VarlenKernel | None = torch_varlen_kernel(self.device, self.dtype,
                                                                               BLOCK_TABLE_ARGS)
        self._torch_kernels = (self.varlen_kernel, self.block_table_kernel)

    def _apply(self, fn, recurse: bool = True) -> "OrcaModel":
        """`.to()`, `.half()`, `.cuda()` and the like convert the weights; where their dtype or device
        changed, what the constructor derives from them follows, so the model is the one built with
        them: the spec's `dtype_bytes`, the rotary tables (rebuilt, not converted: they stay fp32) and
        each of torch's kernels not replaced by hand. (`.share_memory()` and the like change neither,
        and leave the tables as they made them.) A dtype or device the constructor refuses (complex,
        float8, 'meta'), or a dtype a weight would overflow (`hf_llama.check_range`, as `from_hf`
        checks a checkpoint), is refused here, before any weight is converted: the conversion is
        tried on an empty tensor first."""
        target = fn(torch.empty(0, dtype=self.dtype, device=self.device))
        try:
            check_dtype(target.dtype)
            check_device(target.device)
            if target.dtype != self.dtype:
                check_range(dict(self.named_parameters()), target.dtype, "", "keep a wider dtype (bfloat16 or float32)")
        except ValueError as e:
            raise ValueError(f"OrcaModel cannot be converted, and is left as it was: {e}") from None
        was = (self.dtype, self.device)
        replaced = tuple(k is not d for k, d in zip((self.varlen_kernel, self.block_table_kernel), self._torch_kernels))
        super()._apply(fn, recurse)
        if (self.dtype, self.device) != was:
            self.spec = self.spec.with_dtype_bytes(self.dtype.itemsize)
            self._set_rope_tables()
            self._set_kernels(keep=replaced)
        return self

    @property
    def attention(self) -> AttentionPath:
        """"split" (per-request loop, the reference) or "fused" (one attention call per layer)."""
        return self._attention

    @attention.setter
    def attention(self, value: AttentionPath) -> None:
        self._attention = check_attention(value)

    @classmethod
    def from_hf(cls, model_or_path, *, device: str | torch.device = "cpu", dtype: torch.dtype | str | None = None,
                attention: AttentionPath = "split") -> "OrcaModel":
        """An `OrcaModel` holding a transformers Llama's weights: a `LlamaForCausalLM` (or
        `MistralForCausalLM`) instance or a local checkpoint directory (config.json + safetensors).
        `dtype=None` keeps the checkpoint's dtype; else float32, bfloat16, float16 or float64 (by name
        or torch dtype). See `hf_llama`."""
        check_device(device)                         # refuse bad arguments before loading the checkpoint
        if dtype is not None:
            dtype = check_dtype(dtype)
        check_attention(attention)
        checkpoint = read_hf(model_or_path, dtype)
        model = cls(checkpoint.spec, device=device, dtype=checkpoint.dtype, attention=attention, init_weights=False)
        load_weights(model, checkpoint.state)
        return model

    def _init_weights(self, seed: int) -> None:
        """Seeded init, variance-preserving, so activations and logits stay O(1) at any depth."""
        g = torch.Generator().manual_seed(seed)
        s = self.spec
        out_scale = 1.0 / math.sqrt(2 * s.n_layers)

        def normal_(p: torch.Tensor, std: float) -> None:     # drawn in fp32 on the CPU, whatever the dtype and device
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std)

        normal_(self.embed, 1.0)
        for blk in self.layers:
            normal_(blk.wqkv, 1 / math.sqrt(s.hidden))
            normal_(blk.wo, out_scale / math.sqrt(s.q_dim))
            normal_(blk.w_gate_up, 1 / math.sqrt(s.hidden))
            normal_(blk.w_down, out_scale / math.sqrt(s.intermediate))
        if not s.tied_embeddings:
            normal_(self.lm_head.weight, 1 / math.sqrt(s.hidden))

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def new_kv(self, n_slots: int) -> KVManager:
        """A `KVManager` for this model's shapes, device and dtype."""
        return KVManager(self.spec, n_slots, device=self.device, dtype=self.dtype)

    def check_kv(self, kv: KVStore) -> None:
        """Raise ValueError unless `kv` is a K/V store (a `KVStore`) that defines what the model calls
        on it (`KVStore.MODEL_CALLS`), for this model's spec, dtype and device type, naming the store,
        what it lacks or what differs (the spec's fields, where two specs share a name) and how to make
        the right one."""
        check_instance("kv", kv, KVStore)
        store = type(kv).__name__
        if not all(hasattr(kv, name) for name in ("spec", "dtype", "device")):
            raise ValueError(f"the {store} has no spec, dtype or device: its constructor must call "
                             "super().__init__(spec, device, dtype) (KVStore's) first")
        missing = kv.undefined(KVStore.MODEL_CALLS)
        if missing:
            raise ValueError(f"the {store} does not define {', '.join(missing)}, which the model calls on a K/V store "
                             "(KVStore.MODEL_CALLS; docs/extending.md, \"A K/V store\")")
        remedy = {KVManager: "model.new_kv(n_slots)", PagedKVManager: "PagedKVManager.mirroring(memory, model)"}.get(
            type(kv), f"{store} given the model's spec, device and dtype")
        if kv.spec != self.spec and kv.spec.with_dtype_bytes(self.spec.dtype_bytes) != self.spec:  # (dtype: next)
            differ = [f"{f.name} {brief(getattr(kv.spec, f.name), GOT_LIMIT)} "
                      f"(the model's {brief(getattr(self.spec, f.name), GOT_LIMIT)})"
                      for f in fields(self.spec) if f.name not in ("name", "dtype_bytes")
                      and getattr(kv.spec, f.name) != getattr(self.spec, f.name)]
            what = (f"{brief(kv.spec.name)}, the model is {brief(self.spec.name)}" if kv.spec.name != self.spec.name
                    else f"another spec named {brief(kv.spec.name)}: {', '.join(differ)}")
            raise ValueError(f"the {store} is for {what}; make it with {remedy}")
        if (kv.dtype, kv.device.type) != (self.dtype, self.device.type):
            raise ValueError(f"the {store} holds {kv.dtype} on {kv.device}, the model runs {self.dtype} on "
                             f"{self.device}; make it with {remedy}")

    def step_path(self, kv: KVStore | None = None,
                  attention: AttentionPath | None = None) -> StepPath:
        """How a step's attention runs on `kv` (default: the model's `attention` setting).

        "split": the per-request loop. With "fused": "block_table" where a `block_table_kernel` is
        set and `kv` serves it its blocks (`KVStore.serves_block_tables`: paged, of a block size the
        kernel takes): the kernel reads the blocks in place; else "varlen" where a `varlen_kernel` is set (every
        request's K/V gathered into one flat copy); else "batched" (the one-token rows as one padded
        batch, longer rows through the split loop).
        """
        attention = self.attention if attention is None else check_attention(attention)
        if attention == "split":
            return "split"
        if kv is not None and self.block_table_kernel is not None and kv.serves_block_tables:
            return "block_table"
        return "varlen" if self.varlen_kernel is not None else "batched"

    def executed_works(self, works: Sequence[SeqWork],
                       kv: KVStore | None = None) -> list[SeqWork]:
        """The `SeqWork`s whose full attention rectangle is what the path run on `kv` computes, so that
        `spec.step_flops(model.executed_works(works, kv))` equals the FLOPs counted on the forward.

        Split: `works` itself. Fused with batched decodes: every one-token row is padded to the
        longest context among them (`K_max` keys each), longer rows unchanged. Fused with the
        variable-length kernel, flat or through block tables: each request's own causal rectangle,
        so `works`; a Flash kernel skips fully masked tiles, so for it `works` is the bound.
        """
        works = list(works)
        if self.step_path(kv) != "batched":
            return works
        ones = [w for w in works if w.n_new == 1]
        if not ones:
            return works
        k_max = max(w.n_ctx for w in ones)
        return [SeqWork(1, k_max - 1) if w.n_new == 1 else w for w in works]

    # ---- selective batching ----------------------------------------------------------------------
    def forward(self, token_ids: torch.Tensor, works: Sequence[SeqWork], req_ids: Sequence[Hashable],
                kv: KVStore, padded: bool = False) -> torch.Tensor:
        """`forward_batch` (or `forward_padded` if `padded`); calling the module goes through here."""
        if padded:
            return self.forward_padded(token_ids, works, req_ids, kv)
        return self.forward_batch(token_ids, works, req_ids, kv)

    @torch.inference_mode()
    def forward_batch(self, token_ids: torch.Tensor, works: Sequence[SeqWork],
                      req_ids: Sequence[Hashable], kv: KVStore) -> torch.Tensor:
        """One iteration over a mix of requests: Orca's selective batching (lecture §4.2). Every layer
        runs on the flat `[sum L, H]` matrix (`run_layer`); attention alone splits it per request
        (`_split_attention`, or a fused path: `step_path`).

        `token_ids` holds every request's new tokens back to back (`sum(n_new)` of them, in the order
        of `works`); request `req_ids[i]` must hold a reservation in `kv` with exactly
        `works[i].n_past` tokens stored and room for `n_new` more. Returns the logits
        `[len(works), vocab]` of each request's last new token and appends the new tokens' K/V to
        `kv`. A `kv` made for another model, dtype or device raises ValueError; the step itself the
        engine built: a bad one fails an assertion before anything is written.
        """
        token_ids = self._step_ids(token_ids, works, req_ids, kv)
        plan = self.plan_step(works, req_ids, kv)
        x = F.embedding(token_ids, self.embed)                       # [T, H]
        for layer in range(self.spec.n_layers):
            x = self.run_layer(layer, x, plan)
        logits = self.head(x, plan)
        plan.kv.finish()
        return logits

    def run_layer(self, layer: int, x: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """Decoder layer `layer` on the step's flat activations `x` `[sum L, H]`: two residual adds
        of `attention_out` and `mlp_out`. A tensor-parallel shard all-reduces each first, from outside
        the model (`orca_torch.distributed.shard.StageShard.layers`, lecture §4.4)."""
        x = x + self.attention_out(layer, x, plan)
        return x + self.mlp_out(layer, x)

    def attention_out(self, layer: int, x: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """Layer `layer`'s attention branch, norm to output projection: `[sum L, H]` -> `[sum L, H]`."""
        s, blk = self.spec, self.layers[layer]
        h = F.rms_norm(x, (s.hidden,), blk.attn_norm, s.norm_eps)
        q, kv_new = self._qkv_heads(F.linear(h, blk.wqkv), plan.cos, plan.sin)
        return F.linear(self._attention_step(layer, q, kv_new, plan), blk.wo)

    def mlp_out(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s MLP branch, norm to down projection. On a CPU a long step runs it on
        blocks of `MLP_ROWS` rows (every row is independent, so the values are the same): a
        prefill's `[T, 2 FFN]` temporary would not stay in cache between the matmul and SwiGLU."""
        blk = self.layers[layer]
        if x.shape[0] <= MLP_ROWS or x.device.type != "cpu":
            return self._mlp(x, blk)
        return torch.cat([self._mlp(rows, blk) for rows in x.split(MLP_ROWS)])

    def head(self, x: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """Final norm and LM head on each request's last new token: logits `[B, vocab]`."""
        return self._logits(x[plan.last_rows])

    def _logits(self, last: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head on the rows `last` `[B, H]`, one a request: logits `[B, vocab]`."""
        s = self.spec
        return self.lm_head(F.rms_norm(last, (s.hidden,), self.final_norm, s.norm_eps))

    def _mlp(self, x: torch.Tensor, blk: Block) -> torch.Tensor:
        h = F.rms_norm(x, (self.spec.hidden,), blk.mlp_norm, self.spec.norm_eps)
        gate, up = F.linear(h, blk.w_gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate).mul_(up), blk.w_down)        # one [T, FFN] temporary, not two

    def _qkv_heads(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotate Q and K of the fused projection `[..., q + 2 kv]` in place, pre-scale Q by
        1/sqrt(d); return Q `[..., n_heads, d]` and the new K/V `[..., 2, n_kv, d]` (a view)."""
        s = self.spec
        qk = qkv[..., : s.q_dim + s.kv_dim].unflatten(-1, (s.n_heads + s.n_kv_heads, s.head_dim))
        half = s.head_dim // 2
        x1, x2 = qk[..., :half], qk[..., half:]
        qk.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))
        q = qk[..., : s.n_heads, :] * (1.0 / math.sqrt(s.head_dim))
        kv_new = qkv[..., s.q_dim:].unflatten(-1, (2, s.n_kv_heads, s.head_dim))
        return q, kv_new

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope_cos[positions].unsqueeze(-2), self.rope_sin[positions].unsqueeze(-2)

    def _attention_step(self, layer: int, q: torch.Tensor, kv_new: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """q `[T, n_heads, d]`, kv_new `[T, 2, n_kv, d]` -> attention output `[T, q_dim]` by the plan's path."""
        if plan.blocks is not None:
            return block_table_attention(layer, q, kv_new, plan.blocks, self.block_table_kernel)
        if plan.flat is not None:
            return varlen_attention(layer, q, kv_new, plan.flat, self.varlen_kernel)
        if plan.decodes is None:
            return self._split_attention(layer, q, kv_new, plan)
        dec = batched_decode_attention(plan.kv.load_padded(layer), q.index_select(0, plan.decode_rows),
                                       kv_new.index_select(0, plan.decode_rows), plan.decodes, self.group)
        if not plan.split_idx:
            return dec
        out = q.new_empty(q.shape[0], self.spec.q_dim)
        out.index_copy_(0, plan.decode_rows, dec)
        out.index_copy_(0, plan.split_rows, self._split_attention(layer, q, kv_new, plan))
        return out

    def _split_attention(self, layer: int, q: torch.Tensor, kv_new: torch.Tensor,
                         plan: StepPlan) -> torch.Tensor:
        """Orca's Split -> per-request attention -> Merge (lecture §4.2), over the plan's split requests. Each
        request first writes its new K/V into its own slots, so its queries see its new tokens
        (under the causal mask) after its stored ones.

        q `[T, n_heads, d]`, kv_new `[T, 2, n_kv, d]`. Grouped-query attention is done without
        repeating K/V: the `group` query heads that share a K/V head are stacked as extra query
        rows, so a request's attention is two bmm's of `[n_kv, group*L, *]` against its own K/V.
        """
        s, g = self.spec, self.group
        qs, kvs = q.split(plan.sizes), kv_new.split(plan.sizes)
        outs = []
        for i, (slots, k_t, v), mask in zip(plan.split_idx, plan.split_views, plan.masks):
            qi, L = qs[i], plan.sizes[i]
            slots[layer].copy_(kvs[i].permute(1, 2, 0, 3))          # write this step's K/V in place
            if L == 1:
                qg = qi.view(s.n_kv_heads, g, s.head_dim)
            else:
                qg = qi.view(L, s.n_kv_heads, g, s.head_dim).permute(1, 2, 0, 3).reshape(
                    s.n_kv_heads, g * L, s.head_dim)
            scores = torch.bmm(qg, k_t[layer])                       # [n_kv, g*L, n_ctx]
            if mask is not None:
                scores = scores.masked_fill(mask, float("-inf"))
            o = torch.bmm(scores.softmax(dim=-1), v[layer])          # [n_kv, g*L, d]
            if L == 1:
                outs.append(o.view(1, s.q_dim))
            else:
                outs.append(o.view(s.n_kv_heads, g, L, s.head_dim).permute(2, 0, 1, 3).reshape(L, s.q_dim))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    # ---- the padded reference ----------------------------------------------------------------------
    @torch.inference_mode()
    def forward_padded(self, token_ids: torch.Tensor, works: Sequence[SeqWork],
                       req_ids: Sequence[Hashable], kv: KVStore) -> torch.Tensor:
        """The same step with every request padded to `[B, L_max, H]` and attention to
        `[B, L_max, K_max]`: what request-level batching would have to compute (§3.2).

        Same inputs, outputs and K/V side effects as `forward_batch`; only real tokens' K/V are
        stored. Padded query rows see every real key of their request (so no row is all -inf);
        their outputs are thrown away.
        """
        token_ids = self._step_ids(token_ids, works, req_ids, kv)
        plan = self.plan_step(works, req_ids, kv, attention="split")
        s, g = self.spec, self.group
        B, Lmax, Kmax = padded_shape(works)
        dev = self.device
        ids = torch.zeros(B, Lmax, dtype=torch.long, device=dev)
        pos = torch.zeros(B, Lmax, dtype=torch.long, device=dev)
        for i, tok in enumerate(token_ids.split(plan.sizes)):
            ids[i, : plan.sizes[i]] = tok
            pos[i] = torch.arange(plan.past[i], plan.past[i] + Lmax, device=dev).clamp_(max=s.max_context - 1)
        j = torch.arange(Kmax, device=dev)
        t = torch.arange(Lmax, device=dev)
        past = torch.tensor(plan.past, device=dev)[:, None, None]
        ctx = torch.tensor([p + L for p, L in zip(plan.past, plan.sizes)], device=dev)[:, None, None]
        last_key = torch.minimum(past + t[None, :, None], ctx - 1)           # [B, Lmax, 1]
        mask = (j[None, None, :] > last_key).repeat(1, g, 1)[:, None]        # [B, 1, g*Lmax, Kmax]

        x = F.embedding(ids, self.embed)                                      # [B, Lmax, H]
        cos, sin = self._rope_tables(pos)
        for layer, blk in enumerate(self.layers):
            h = F.rms_norm(x, (s.hidden,), blk.attn_norm, s.norm_eps)
            q, kv_new = self._qkv_heads(F.linear(h, blk.wqkv), cos, sin)   # [B, Lmax, 2, n_kv, d]
            k_pad = torch.zeros(B, s.n_kv_heads, Kmax, s.head_dim, device=dev, dtype=x.dtype)
            v_pad = torch.zeros_like(k_pad)
            for i, (L, (slots, k_t, v)) in enumerate(zip(plan.sizes, plan.split_views)):
                slots[layer].copy_(kv_new[i, :L].permute(1, 2, 0, 3))
                n = plan.past[i] + L
                k_pad[i, :, :n] = k_t[layer].transpose(1, 2)
                v_pad[i, :, :n] = v[layer]
            qg = q.view(B, Lmax, s.n_kv_heads, g, s.head_dim).permute(0, 2, 3, 1, 4).reshape(
                B, s.n_kv_heads, g * Lmax, s.head_dim)
            scores = torch.matmul(qg, k_pad.transpose(-1, -2)).masked_fill(mask, float("-inf"))
            o = torch.matmul(scores.softmax(dim=-1), v_pad)                   # [B, n_kv, g*Lmax, d]
            attn = o.view(B, s.n_kv_heads, g, Lmax, s.head_dim).permute(0, 3, 1, 2, 4).reshape(B, Lmax, s.q_dim)
            x = x + F.linear(attn, blk.wo)
            x = x + self._mlp(x, blk)
        logits = self._logits(x[torch.arange(B, device=dev), torch.tensor(plan.sizes, device=dev) - 1])
        plan.kv.finish()
        return logits

    # ---- the step's layout ------------------------------------------------------------------------
    def _step_ids(self, token_ids: torch.Tensor, works: Sequence[SeqWork], req_ids: Sequence[Hashable],
                  kv: KVStore) -> torch.Tensor:
        """The step's token ids as `torch.long` on the model's device. A K/V store made for another
        model, dtype or device is refused (`check_kv`: the caller chose it, and the forward would
        fail inside torch after writing into it). The engine built the step, so its
        shape, and that each work fits its request's K/V (`can_append`), are asserted, not refused,
        and with no device sync per step: the ids' range is asserted where they are on the CPU (as
        the executors build them; on CUDA an id past the vocabulary would end the process in a
        device-side assert), ids already on the device are trusted."""
        self.check_kv(kv)
        ids = torch.as_tensor(token_ids)
        integer = not ids.dtype.is_floating_point and ids.dtype != torch.bool
        assert ids.dim() == 1 and ids.numel() == sum(w.n_new for w in works) and integer, \
            f"token_ids must be 1-D, sum(n_new) integer ids; got {ids.dtype} {tuple(ids.shape)}"
        if ids.device.type == "cpu" and ids.numel():
            lo, hi = (int(v) for v in torch.aminmax(ids))
            assert 0 <= lo and hi < self.spec.vocab, \
                f"token ids must lie in [0, {self.spec.vocab}), got ids from {lo} to {hi}"
        assert works and len(works) == len(req_ids) == len(set(req_ids)), "one SeqWork per request, each once"
        assert all(w.n_ctx <= self.spec.max_context and kv.can_append(r, w.n_past, w.n_new)
                   for r, w in zip(req_ids, works)), \
            f"a step's SeqWorks {list(works)} do not fit what the K/V of {list(req_ids)} holds and can hold"
        return ids.to(self.device, torch.long)

    def plan_step(self, works: Sequence[SeqWork], req_ids: Sequence[Hashable], kv: KVStore,
                  attention: AttentionPath | None = None) -> StepPlan:
        """The step's layout for the path `step_path(kv, attention)` picks; K/V through the view the
        store gives the step (`kv.step_view`)."""
        path = self.step_path(kv, attention)
        dev, g = self.device, self.group
        sizes = [w.n_new for w in works]
        past = [w.n_past for w in works]
        step_kv = kv.step_view(req_ids, past, sizes)
        sizes_t = torch.tensor(sizes)
        ends = sizes_t.cumsum(0)
        if all(L == 1 for L in sizes):
            positions = torch.tensor(past)
        else:
            offsets = torch.tensor(past) - (ends - sizes_t)      # position = row + offset of its request
            positions = torch.arange(int(ends[-1])) + offsets.repeat_interleave(sizes_t)
        cos, sin = self._rope_tables(positions.to(dev))
        plan = StepPlan(sizes, past, cos, sin, (ends - 1).to(dev), step_kv, [], [], [])
        if path == "block_table":
            plan.blocks = step_kv.block_table_layout()
            return plan
        if path == "varlen":
            plan.flat = step_kv.gather_flat()
            return plan
        ones = [i for i, L in enumerate(sizes) if L == 1] if path == "batched" else []
        plan.split_idx = [i for i, L in enumerate(sizes) if L != 1] if ones else list(range(len(sizes)))
        if ones:
            plan.decodes = step_kv.gather_padded(ones)
            plan.decode_rows = (ends - 1)[ones].to(dev)
            if plan.split_idx:
                starts = (ends - sizes_t).tolist()
                plan.split_rows = torch.cat([torch.arange(starts[i], starts[i] + sizes[i])
                                             for i in plan.split_idx]).to(dev)
        for i in plan.split_idx:
            p, L = past[i], sizes[i]
            if L == 1:
                plan.masks.append(None)
            else:
                t = torch.arange(L, device=dev).repeat(g)                     # query row -> offset
                plan.masks.append(torch.arange(p + L, device=dev)[None, :] > (p + t)[:, None])
            plan.split_views.append(step_kv.split_views(i))
        return plan


@torch.inference_mode()
def generate_alone(model: OrcaModel, prompt: Sequence[int], n_new_tokens: int) -> list[int]:
    """Greedy generation for one request on its own: the reference every batched run must equal.
    The prompt and the tokens made fit the model's context as a request's do in the engine
    (`Request.check_context`: prompt + output <= max_context, vLLM's `max_model_len` rule), though
    the last token is never fed back and so its K/V never stored: one rule for what a run may make.
    Logits that are not finite (weights or activations that overflowed) raise `NonFiniteLogits`, as a
    step of `TorchExecutor` does, rather than make token 0 or whichever holds the NaN."""
    check_instance("model", model, OrcaModel)
    ids = prompt.tolist() if isinstance(prompt, (torch.Tensor, np.ndarray)) else prompt
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"prompt must be a list of token ids in [0, {model.spec.vocab}), got {brief(ids)} "
                         f"({type(ids).__name__})")
    if not ids:
        raise ValueError("prompt must hold at least one token")
    prompt = [check_int("a prompt token id", t, 0, model.spec.vocab - 1) for t in ids]
    n_new_tokens = check_int("n_new_tokens", n_new_tokens, 1)
    if len(prompt) + n_new_tokens > model.spec.max_context:
        raise ValueError(f"prompt ({len(prompt)}) + n_new_tokens ({n_new_tokens}) = {len(prompt) + n_new_tokens} "
                         f"exceeds max_context {model.spec.max_context}: a run holds at most max_context tokens, "
                         "the tokens it makes included, as the engine admits a request")
    stored = len(prompt) + n_new_tokens - 1                      # the last token is never fed back
    kv = model.new_kv(stored)
    kv.reserve(0, stored)
    logits = model.forward_batch(torch.tensor(prompt), [SeqWork(len(prompt), 0)], [0], kv)
    out: list[int] = []
    while True:
        check_finite(logits)            # as the executor does: argmax would take a NaN for the largest logit
        out.append(int(logits[0].argmax()))
        if len(out) == n_new_tokens:
            return out
        logits = model.forward_batch(torch.tensor([out[-1]]), [SeqWork(1, kv.length(0))], [0], kv)
