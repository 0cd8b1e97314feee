"""A split instance: which of a torch engine's decoder layers run where, and one forward pass
across them (λScale's execution pipelines, CoCoServe's module replication and migration).

Each layer has one primary executor (this process, or a stage link); a range of local layers may
also have replica stages (CoCoServe): each request is assigned to one executor of the range when
it is first computed, and keeps it (its K/V of those layers live there), so a decode batch is
split among the replicas, which run concurrently. Layers move with their K/V: `shed` (local -> a
stage that has loaded them: migration under memory pressure), `take` (stage -> local once this
process has the weights: λScale's mode switch), `replicate` / `drop_replica`.

Mode switch choice: the local instance *receives* the remote layers' K/V (export_kv) rather than
recomputing it from the tokens. Receiving is exact (the bytes the stage computed, so greedy output
cannot change at the switch) and costs one transfer of n tokens x the moved layers' K/V over a
link that already carries activations, while recomputing is a prefill of every request's whole
context through those layers on the node's own cores, during which nothing decodes.

The split reaches its engine only through `SplitHost`: the model, the KV cache, the requests'
computed lengths, and the attention of a step's rows.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from .kv_cache import PagedKVCache
from .stage_client import StageClient
from .stage_wire import StageError, export_kv, import_kv
from .torch_kernel import StepSpec, decoder_layer
from .weights import assign_layers, drop_layers

log = logging.getLogger("slinfer.stages")


class Computed(Protocol):
    computed: int  # tokens whose K/V are in the cache; 0 until prefilled


class SplitHost(Protocol):
    """What a split instance uses of its engine."""

    model_dir: Path  # a stage must hold layers of this model
    model: torch.nn.Module
    cache: PagedKVCache  # a stage's pool mirrors its block count
    block_size: int  # ... and a stage must have its block size, dtype and device
    dtype: torch.dtype
    device: torch.device
    requests: Mapping[str, Computed]

    def attention_for(self, spec: StepSpec):
        """The attention of `spec`'s rows over the engine's cache (its blocks reserved)."""


@dataclass
class _Link:
    client: StageClient
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1))

    @property
    def start(self) -> int:
        return self.client.start

    @property
    def end(self) -> int:
        return self.client.end

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.client.close()


@dataclass(frozen=True)
class _Run:
    start: int
    end: int
    link: _Link | None  # None: this process
    replicas: tuple[_Link, ...] = ()  # (local runs only) stages holding the same layers


@dataclass(frozen=True)
class Layout:
    """Where an instance's layers run (for the node's reports and the core)."""

    layers: int
    local: tuple[tuple[int, int], ...]  # ranges run in this process
    remote: tuple[tuple[int, int, str], ...]  # (start, end, stage address)
    replicas: tuple[tuple[int, int, str], ...]  # local ranges also on these stages
    assigned: dict[str, int] = field(default_factory=dict)  # requests per replica address


class Split:
    """Which of a torch engine's layers run where, and the runs of one forward pass."""

    def __init__(self, engine: SplitHost, layers: int) -> None:
        self.engine = engine
        self.layers = layers
        self.owner: list[_Link | None] = [None] * layers
        self.kv_index: list[int | None] = list(range(layers))
        self.replicas: dict[tuple[int, int], list[_Link]] = {}
        self.assigned: dict[str, dict[tuple[int, int], _Link | None]] = {}
        self.runs: list[_Run] = [_Run(0, layers, None)]

    # -- layout ---------------------------------------------------------------------------------

    def local_layers(self) -> list[int]:
        return [i for i in range(self.layers) if self.owner[i] is None]

    def links(self) -> list[_Link]:
        seen: dict[int, _Link] = {}
        for link in [*self.owner, *(r for rs in self.replicas.values() for r in rs)]:
            if link is not None:
                seen[id(link)] = link
        return list(seen.values())

    def layout(self) -> Layout:
        local, remote = [], []
        for run in self.runs:
            if run.link is None:
                local.append((run.start, run.end))
            else:
                remote.append((run.start, run.end, run.link.client.address))
        reps = tuple((a, b, r.client.address) for (a, b), rs in self.replicas.items() for r in rs)
        counts: dict[str, int] = {}
        for per in self.assigned.values():
            for link in per.values():
                if link is not None:
                    counts[link.client.address] = counts.get(link.client.address, 0) + 1
        return Layout(self.layers, _merge(local), tuple(remote), reps, counts)

    def _rebuild_runs(self) -> None:
        runs: list[_Run] = []
        i = 0
        while i < self.layers:
            link = self.owner[i]
            rng = next((r for r in self.replicas if r[0] <= i < r[1]), None) if link is None \
                else None
            j = i + 1
            if rng is not None:
                j = rng[1]
            else:
                while j < self.layers and self.owner[j] is link and \
                        (link is not None or not any(r[0] <= j < r[1] for r in self.replicas)):
                    j += 1
            reps = tuple(self.replicas[rng]) if rng is not None else ()
            runs.append(_Run(i, j, link, reps))
            i = j
        self.runs = runs

    # -- a forward pass -------------------------------------------------------------------------

    def forward(self, layers, spec: StepSpec, hidden: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, attention, last_only: bool = True) -> torch.Tensor:
        """The hidden states after every layer; a last run on a stage sends back only the last
        position's where `last_only` (all that sampling needs)."""
        for k, run in enumerate(self.runs):
            last = k == len(self.runs) - 1
            if run.link is not None:
                hidden = run.link.client.forward(spec, hidden, last_only=last and last_only)
            elif run.replicas:
                hidden = self._replicated(layers, run, spec, hidden, cos, sin, attention)
            else:
                hidden = self._local(layers, run, hidden, cos, sin, attention)
        return hidden

    def _local(self, layers, run: _Run, hidden, cos, sin, attention) -> torch.Tensor:
        for index in range(run.start, run.end):
            hidden = decoder_layer(index, self.kv_index[index], layers[index], hidden, cos, sin,
                                   attention)
        return hidden

    def _replicated(self, layers, run: _Run, spec: StepSpec, hidden, cos, sin, attention
                    ) -> torch.Tensor:
        """The batch split among the range's executors, each row where its K/V lives; the
        replicas' shares run in their processes while this one computes its own."""
        key = (run.start, run.end)
        owners = [self._executor(rid, key, run) for rid in spec.request_ids]
        groups: dict[int, list[int]] = {}
        for row, owner in enumerate(owners):
            groups.setdefault(id(owner), []).append(row)
        if len(groups) == 1 and owners[0] is None:
            return self._local(layers, run, hidden, cos, sin, attention)
        futures: list[tuple[list[int], Future]] = []
        mine: list[int] = []
        for rows in groups.values():
            owner = owners[rows[0]]
            if owner is None:
                mine = rows
                continue
            part = hidden if len(rows) == len(owners) else hidden[rows]
            futures.append((rows, owner.pool.submit(owner.client.forward, spec.rows(rows),
                                                    part.contiguous(), False)))
        out = torch.empty_like(hidden) if len(futures) > 1 or mine else None
        if mine:
            index = torch.tensor(mine, device=hidden.device)
            sub = self.engine.attention_for(spec.rows(mine))
            local = self._local(layers, run, hidden.index_select(0, index),
                                cos.index_select(0, index), sin.index_select(0, index), sub)
            out.index_copy_(0, index, local)
        for rows, future in futures:
            result = future.result()
            if out is None:
                return result
            out.index_copy_(0, torch.tensor(rows, device=hidden.device), result)
        return out

    def _executor(self, rid: str, key: tuple[int, int], run: _Run) -> _Link | None:
        per = self.assigned.setdefault(rid, {})
        if key in per:
            return per[key]
        request = self.engine.requests.get(rid)
        if request is not None and request.computed:  # its K/V of these layers is here
            per[key] = None
            return None
        load = {id(r): 0 for r in run.replicas}
        mine = 0
        for other in self.assigned.values():
            owner = other.get(key, False)
            if owner is None:
                mine += 1
            elif owner is not False and id(owner) in load:
                load[id(owner)] += 1
        best = min(run.replicas, key=lambda r: load[id(r)])
        per[key] = None if mine <= load[id(best)] else best
        return per[key]

    # -- requests -------------------------------------------------------------------------------

    def release(self, rid: str) -> None:
        per = self.assigned.pop(rid, {})
        targets = {id(link): link for link in self.owner if link is not None}
        targets.update({id(link): link for link in per.values() if link is not None})
        for link in targets.values():
            try:
                link.client.release([rid])
            except StageError as exc:  # the request is gone here; a lost stage frees itself
                log.warning("release of %s on a stage failed: %s", rid, exc)

    def resize(self, blocks: int) -> None:
        for link in self.links():
            link.client.resize(blocks)

    def check_stage(self, client: StageClient) -> None:
        info, engine = client.info, self.engine
        if Path(info["model_dir"]).resolve() != engine.model_dir.resolve() and \
                Path(info["model_dir"]).name != engine.model_dir.name:
            raise ValueError(f"stage {client.address} serves {info['model_dir']}, "
                             f"not {engine.model_dir}")
        if info["block_size"] != engine.block_size or \
                info["dtype"] != str(engine.dtype).removeprefix("torch."):
            raise ValueError(f"stage {client.address} has block size {info['block_size']} / "
                             f"dtype {info['dtype']}, the engine {engine.block_size} / "
                             f"{engine.dtype}")

    def _prefilled(self) -> tuple[list[str], list[int]]:
        ids = [rid for rid, r in self.engine.requests.items() if r.computed]
        return ids, [self.engine.requests[rid].computed for rid in ids]

    # -- moves ----------------------------------------------------------------------------------

    def attach(self, client: StageClient) -> None:
        """A stage that holds layers this process never loaded (a split from the start)."""
        self.check_stage(client)
        link = _Link(client)
        client.resize(self.engine.cache.num_blocks)
        for i in range(client.start, client.end):
            self.owner[i] = link
            self.kv_index[i] = None
        self._rebuild_runs()

    def compact(self) -> None:
        """Local layers in order at the cache's slots 0..n-1 (a split from the start)."""
        slot = 0
        for i in range(self.layers):
            if self.owner[i] is None:
                self.kv_index[i] = slot
                slot += 1
            else:
                self.kv_index[i] = None

    def shed(self, client: StageClient) -> None:
        """Migration: the stage's layers (local, not replicated) move to it with their K/V;
        this process drops their weights and K/V pools."""
        self.check_stage(client)
        rng = range(client.start, client.end)
        if any(self.owner[i] is not None for i in rng) or \
                any(a < client.end and client.start < b for a, b in self.replicas):
            raise ValueError(f"layers {client.start}:{client.end} are not all local and "
                             f"unreplicated")
        if len(self.local_layers()) == len(rng):
            raise ValueError("an instance keeps at least one decoder layer in its own process")
        cache = self.engine.cache
        client.resize(cache.num_blocks)
        ids, lengths = self._prefilled()
        kv = [self.kv_index[i] for i in rng]
        client.import_kv(ids, lengths, export_kv(cache, kv, ids, lengths))
        link = _Link(client)
        for i in rng:
            self.owner[i] = link
        self._remove_local_kv(kv)
        drop_layers(self.engine.model, rng)
        self._rebuild_runs()

    def take(self, start: int, end: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Mode switch: layers [start, end), now loaded here (`tensors`), run in this process;
        their K/V comes from the stages that ran them, which are then let go."""
        links = {id(self.owner[i]): self.owner[i] for i in range(start, end)}
        if None in links.values() or not links:
            raise ValueError(f"layers {start}:{end} are not all remote")
        if any(link.start < start or link.end > end for link in links.values()):
            raise ValueError(f"layers {start}:{end} cut a stage's range; take whole stages")
        engine = self.engine
        assign_layers(engine.model, tensors, engine.device, engine.dtype)
        if any(p.is_meta for i in range(start, end)
               for p in engine.model.model.layers[i].parameters()):
            raise ValueError(f"tensors for layers {start}:{end} are incomplete")
        ids, lengths = self._prefilled()
        for link in links.values():
            got, kv = link.client.export_kv(ids)
            if got != lengths:
                raise StageError(f"stage {link.client.address} holds {got} tokens, the engine "
                                 f"{lengths}")
            new = engine.cache.add_layers(link.end - link.start)
            import_kv(engine.cache, new, ids, lengths, kv)
            for i, slot in zip(range(link.start, link.end), new):
                self.kv_index[i] = slot
                self.owner[i] = None
            link.client.release(ids)
            link.close()
        self._rebuild_runs()

    def replicate(self, client: StageClient) -> None:
        """CoCoServe replication: the stage holds copies of local layers; requests first
        computed from now on are spread over this process and the replicas."""
        self.check_stage(client)
        key = (client.start, client.end)
        if any(self.owner[i] is not None for i in range(*key)):
            raise ValueError(f"layers {key[0]}:{key[1]} are not all local")
        if any(r != key and r[0] < key[1] and key[0] < r[1] for r in self.replicas):
            raise ValueError(f"layers {key[0]}:{key[1]} overlap another replicated range")
        client.resize(self.engine.cache.num_blocks)
        self.replicas.setdefault(key, []).append(_Link(client))
        self._rebuild_runs()

    def drop_replica(self, address: str) -> None:
        """The replica's requests get their K/V of its layers back here; it is let go."""
        for key, links in self.replicas.items():
            link = next((r for r in links if r.client.address == address), None)
            if link is not None:
                break
        else:
            raise ValueError(f"no replica at {address}")
        ids = [rid for rid, per in self.assigned.items() if per.get(key) is link]
        if ids:
            lengths, kv = link.client.export_kv(ids)
            cache = self.engine.cache
            slots = [self.kv_index[i] for i in range(*key)]
            import_kv(cache, slots, ids, lengths, kv)
            for rid in ids:
                self.assigned[rid][key] = None
            link.client.release(ids)
        links.remove(link)
        if not links:
            del self.replicas[key]
        link.close()
        self._rebuild_runs()

    def _remove_local_kv(self, kv: list[int]) -> None:
        remap = self.engine.cache.remove_layers(kv)
        self.kv_index = [None if k is None or k in kv else remap[k] for k in self.kv_index]

    def close(self) -> None:
        for link in self.links():
            link.close()


def _merge(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)

