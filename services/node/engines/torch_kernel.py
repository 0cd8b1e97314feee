"""The torch engine's kernel: one iteration's pass through decoder layers over a paged KV cache.

`StepSpec` is an iteration as the cache sees it (which requests, from which position, how many
tokens); `reserve_step` / `abort_step` / `finish_step` take and settle its blocks; `open_attention`
gives the step's attention (prefill, extend, or a batched decode over ragged lengths gathered in
groups into a reused `Workspace`); `decoder_layer` runs one layer with it, LoRA rows included.
The engine (torch_engine.py), a split instance (split.py) and a layer stage (stage_server.py) all
run their layers with these.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from .kv_cache import PagedKVCache
from .lora import MLP, LoraBatch

DEFAULT_BLOCK_SIZE = 16
# K+V of one layer gathered at once by a decode step (see _DecodeAttention); not counted in
# MemoryReport, like activations. 64 MiB holds a batch of 32 x 2k tokens of llama-3.2-1b.
DECODE_WORKSPACE_BYTES = 64 << 20


def _project(layer: int, name: str, linear: torch.nn.Module, x: torch.Tensor,
             lora: LoraBatch | None) -> torch.Tensor:
    """A backbone projection, plus the LoRA updates of the rows whose adapter targets it."""
    y = linear(x)
    return y if lora is None else lora.apply(layer, name, x, y)


def _lora_mlp(layer: int, mlp: torch.nn.Module, x: torch.Tensor, lora: LoraBatch) -> torch.Tensor:
    """The Llama/Qwen2 MLP, down(act(gate(x)) * up(x)), with LoRA on each projection."""
    gate, up, down = (getattr(mlp, name) for name in MLP)
    h = mlp.act_fn(_project(layer, "gate_proj", gate, x, lora)) * \
        _project(layer, "up_proj", up, x, lora)
    return _project(layer, "down_proj", down, h, lora)


@dataclass(frozen=True)
class StepSpec:
    """One iteration as the KV cache sees it: which requests, how many tokens each had cached
    before (`starts`, also the first new token's position) and how many it adds (`counts`).
    Prefill and extend carry one request; decode one new token for each of its rows. A stage
    in another process (stage_server.py) gets the same spec with the hidden states."""

    kind: str  # "prefill" | "decode" | "extend"
    request_ids: tuple[str, ...]
    starts: tuple[int, ...]
    counts: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.kind not in ("prefill", "decode", "extend"):
            raise ValueError(f"unknown step kind {self.kind!r}")
        if not len(self.request_ids) == len(self.starts) == len(self.counts):
            raise ValueError("request_ids, starts and counts must have one entry per row")
        if self.kind != "decode" and len(self.request_ids) != 1:
            raise ValueError(f"a {self.kind} step runs one request")
        if self.kind == "decode" and any(c != 1 for c in self.counts):
            raise ValueError("a decode step adds one token per row")
        if self.kind == "prefill" and any(self.starts):
            raise ValueError("a prefill starts from an empty cache")
        if any(s < 0 for s in self.starts) or any(c <= 0 for c in self.counts):
            raise ValueError("starts must be >= 0 and counts > 0")

    def rows(self, rows: list[int]) -> StepSpec:
        """The same step for a subset of the batch's rows (a replica's share)."""
        return StepSpec(self.kind, tuple(self.request_ids[i] for i in rows),
                        tuple(self.starts[i] for i in rows), tuple(self.counts[i] for i in rows))

    def positions(self, device: torch.device) -> torch.Tensor:
        """Token positions as the model takes them: [1, m] for one request, [batch, 1] decode."""
        if self.kind == "decode":
            return torch.tensor(self.starts, device=device)[:, None]
        return torch.arange(self.starts[0], self.starts[0] + self.counts[0], device=device)[None]


def reserve_step(cache: PagedKVCache, spec: StepSpec) -> None:
    """The blocks the step writes, all or none (KVCacheFull)."""
    cache.reserve({rid: s + c for rid, s, c in zip(spec.request_ids, spec.starts, spec.counts)})


def abort_step(cache: PagedKVCache, spec: StepSpec) -> None:
    """Undo `reserve_step` after a failed step (a failed prefill frees the request)."""
    for rid, start in zip(spec.request_ids, spec.starts):
        cache.trim(rid, start)


def finish_step(cache: PagedKVCache, spec: StepSpec) -> None:
    for rid, start, count in zip(spec.request_ids, spec.starts, spec.counts):
        cache.set_length(rid, start + count)


def open_attention(cache: PagedKVCache, spec: StepSpec, workspace: Workspace):
    """The attention of the step's rows over `cache` (its blocks already reserved)."""
    if spec.kind == "prefill":
        rid, n = spec.request_ids[0], spec.counts[0]
        return _PrefillAttention(cache, cache.slots(rid, 0, n))
    if spec.kind == "extend":
        return _ExtendAttention(cache, spec.request_ids[0], spec.starts[0], spec.counts[0])
    return _DecodeAttention(cache, list(spec.request_ids), list(spec.starts), workspace)


def decoder_layer(index: int, kv: int, layer, hidden: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, attention, lora: LoraBatch | None = None) -> torch.Tensor:
    """One decoder layer (pre-norm attention + MLP, residuals): `index` is the model's layer
    (LoRA weights are per model layer), `kv` the layer's slot in the cache `attention` writes."""
    hidden = hidden + _attention_block(index, kv, layer, hidden, cos, sin, attention, lora)
    x = layer.post_attention_layernorm(hidden)
    return hidden + (layer.mlp(x) if lora is None else _lora_mlp(index, layer.mlp, x, lora))


def _attention_block(index: int, kv: int, layer, hidden: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, attention, lora: LoraBatch | None) -> torch.Tensor:
    attn = layer.self_attn
    x = layer.input_layernorm(hidden)
    batch, seq, _ = x.shape
    head_dim = attn.head_dim
    q = _project(index, "q_proj", attn.q_proj, x, lora).view(batch, seq, -1, head_dim)
    k = _project(index, "k_proj", attn.k_proj, x, lora).view(batch, seq, -1, head_dim)
    v = _project(index, "v_proj", attn.v_proj, x, lora).view(batch, seq, -1, head_dim)
    q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)  # heads are dim 2 here
    out = attention(kv, q, k, v)  # [batch, seq, heads, head_dim]
    return _project(index, "o_proj", attn.o_proj, out.reshape(batch, seq, -1), lora)


class _PrefillAttention:
    """Causal self-attention of one fresh sequence; K/V go to the cache on the way."""

    def __init__(self, cache: PagedKVCache, slots: torch.Tensor) -> None:
        self.cache, self.slots = cache, slots

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> torch.Tensor:
        self.cache.write(layer, self.slots, k[0], v[0])
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            enable_gqa=True)
        return out.transpose(1, 2)


class _ExtendAttention:
    """m new tokens of one request against its n cached ones plus themselves (causal)."""

    def __init__(self, cache: PagedKVCache, request_id: str, n: int, m: int) -> None:
        self.cache = cache
        self.slots = cache.slots(request_id, n, n + m)
        self.table = cache.table_tensor([request_id])
        keys = torch.arange(self.table.shape[1] * cache.block_size, device=cache.device)
        queries = torch.arange(n, n + m, device=cache.device)
        self.mask = (keys[None, :] <= queries[:, None])[None, None]  # [1, 1, m, keys]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> torch.Tensor:
        self.cache.write(layer, self.slots, k[0], v[0])
        keys, values = self.cache.gather(layer, self.table)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=self.mask, enable_gqa=True)
        return out.transpose(1, 2)


class _DecodeAttention:
    """One new token per request against its cached K/V, batched over ragged lengths.

    Requests are sorted by length and split into groups whose padded K/V gather ([rows, widest
    row's blocks]) fits the engine's decode workspace; each group is gathered into that
    workspace and masked. Padding the whole batch to its longest request instead made the
    per-layer temporaries grow with batch x longest context: on the llama-3.2-1b shape, 31
    requests of 128 tokens beside one of 8192 gathered 32 x 8192 tokens per layer (+513 MB of
    peak RSS and a 4.9 s step instead of 0.7 s; bench/results/torch_decode_memory.json). Now
    they cost the sum of the groups' tokens, and nothing is allocated per layer."""

    def __init__(self, cache: PagedKVCache, request_ids: list[str], lengths: list[int],
                 workspace: Workspace) -> None:
        bs = cache.block_size
        self.cache = cache
        tables = [cache.block_tables[rid] for rid in request_ids]
        # Where each new token's K/V goes: position n of a request holding n tokens.
        self.slots = torch.tensor([t[n // bs] * bs + n % bs for t, n in zip(tables, lengths)],
                                  device=cache.device)
        widths = [len(t) for t in tables]
        groups = plan_groups(widths, workspace.budget_blocks)
        self.buffers = workspace.buffers(max(len(g) * max(widths[i] for i in g) for g in groups))
        self.groups = [_Group.build(cache, [tables[i] for i in g], [lengths[i] for i in g], g,
                                    len(tables)) for g in groups]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> torch.Tensor:
        self.cache.write(layer, self.slots, k[:, 0], v[:, 0])
        if len(self.groups) == 1 and self.groups[0].rows is None:
            return self._attend(layer, self.groups[0], q)
        out = torch.empty_like(q)
        for group in self.groups:
            rows = group.rows
            out.index_copy_(0, rows, self._attend(layer, group, q.index_select(0, rows)))
        return out

    def _attend(self, layer: int, group: _Group, q: torch.Tensor) -> torch.Tensor:
        keys, values = self.cache.gather(layer, group.tables, out=self.buffers)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=group.mask, enable_gqa=True)
        return out.transpose(1, 2)


@dataclass
class _Group:
    """Requests whose K/V are gathered together: padded block tables and the mask of the pad."""

    tables: torch.Tensor  # [rows, width] block ids, right-padded with block 0
    mask: torch.Tensor  # [rows, 1, 1, width * block_size]: True where a key is real
    rows: torch.Tensor | None  # the group's rows in the batch; None: the whole batch, in order

    @classmethod
    def build(cls, cache: PagedKVCache, tables: list[list[int]], lengths: list[int],
              rows: list[int], batch: int) -> _Group:
        width = max(len(t) for t in tables)
        device = cache.device
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device)
        keys = torch.arange(width * cache.block_size, device=device)
        positions = torch.tensor(lengths, device=device)
        mask = (keys[None, :] <= positions[:, None])[:, None, None, :]
        whole = rows == list(range(batch))
        return cls(padded, mask, None if whole else torch.tensor(rows, device=device))


def plan_groups(widths: list[int], budget_blocks: int) -> list[list[int]]:
    """Batch rows grouped for the padded gather: rows sorted by width (blocks), a new group
    whenever rows x widest would pass `budget_blocks` (a row wider than the budget is a group of
    its own). Sorting keeps the padding small; the budget bounds the gather's memory."""
    order = sorted(range(len(widths)), key=lambda i: widths[i])
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and (len(current) + 1) * widths[i] > budget_blocks:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


class Workspace:
    """The decode gather's K and V buffers, kept across steps and layers and grown on demand
    (to fit one request wider than the budget): a step allocates nothing per layer."""

    def __init__(self, cache: PagedKVCache, budget_bytes: int) -> None:
        self.cache = cache
        self.budget_blocks = max(1, budget_bytes // (2 * cache.layer_block_bytes))
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def buffers(self, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._buffers is None or self._buffers[0].shape[0] < blocks:
            self._buffers = None  # free the old pair before allocating the new one
            self._buffers = self.cache.new_buffers(max(blocks, 1))
        return self._buffers

    @property
    def nbytes(self) -> int:
        return 0 if self._buffers is None else 2 * self._buffers[0].numel() * \
            self._buffers[0].element_size()
