"""Model multicast plans (λScale §4.2-4.3), as data: who sends which block to whom at each step,
in what order the blocks travel, and which nodes can form execution pipelines meanwhile.

- `binomial_schedule`: one source, n nodes, b blocks. Nodes are the corners of a hypercube of
  d = ceil(log2 n) dimensions; at step s every node is paired with its neighbour along dimension
  s mod d and each pair exchanges one block each way. Every node that already has a block
  forwards it, so all n nodes hold all b blocks after b + d - 1 steps (n a power of two; a few
  more otherwise) instead of the n - 1 full transfers of sending the model to each node in turn.
- `kway_orders` (Algorithm 1): with k sources, the nodes split into k sub-groups, one source
  each; the blocks are cut into k chunks and sub-group i sends them starting from chunk i, so
  different sub-groups hold different parts early and can serve together. `kway_schedule` is
  the whole plan: one binomial pipeline per sub-group in its order.
- `execution_pipelines` (Algorithm 2): pipelines take one node from every sub-group that still
  has unassigned nodes (a full model across them), the last sub-group's leftovers one pipeline.
- `whole_steps`: the step after which each node of a k-way plan holds every block, from the
  schedule itself (memoized): what the core prices an arrival with. `binomial_steps` is λScale's
  b + ceil(log2 n) - 1, exact for n a power of two and one or two steps short otherwise.
- `step_seconds`: one step, block bytes / link bandwidth + per-step latency;
  `multicast_seconds`: the steps until every node holds the model, times that.
- `cut_blocks`: the model's bytes (the checkpoint's partitions) cut into about `DEFAULT_BLOCKS`
  contiguous blocks, at tensor boundaries where one is near, so each block is one bulk transfer
  (λScale §5's tensor packing: the loader's partitions already are contiguous memory).
- `repair_schedule`: after a node is lost mid-multicast, transfers that complete the surviving
  nodes from whatever each of them holds (one block in and one out per node per step).

Pure: plain data in, plain data out; the node workers carry a plan out over TCP and the
simulator times it.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass

# One step's time is a cost: the one formula is the cost model's (every link moves one block).
from shared.core.cost import multicast_step_s as step_seconds

# λScale §7.6 (Fig. 18): 16 blocks gave the lowest transfer time; fewer make each step longer,
# more add per-block overhead. The node workers cut a checkpoint into this many by default.
DEFAULT_BLOCKS = 16
TENSOR_SNAP = 0.25  # a cut moves to a tensor boundary within this fraction of a block's size


@dataclass(frozen=True)
class Transfer:
    step: int  # 0-based step of the schedule (all transfers of one step run in parallel)
    src: int  # node index within the group (0 = the source)
    dst: int
    block: int  # block index in the model's block order


def dimensions(n: int) -> int:
    return max(1, math.ceil(math.log2(n))) if n > 1 else 0


def binomial_steps(n: int, blocks: int) -> int:
    """λScale's bound for 1 -> n with b blocks: b + ceil(log2 n) - 1 steps (0 for one node).
    The schedule meets it for n a power of two only: price arrivals with `whole_steps`."""
    return 0 if n <= 1 else blocks + dimensions(n) - 1


def binomial_schedule(n: int, order: list[int]) -> list[Transfer]:
    """The transfers that bring every block of `order` from node 0 to nodes 1..n-1.

    At step s each node is paired with its hypercube neighbour along dimension s mod d; the
    source sends its next block in `order` while it has new ones (one new block per step enters
    the group), and every pair then exchanges the latest block (in `order`) the partner lacks.
    For n a power of two this completes in exactly b + d - 1 steps (tests check it for n <= 64).
    For other n some nodes have no neighbour along some dimensions: a sender left idle in a step
    serves a node that receives nothing in it (fewest blocks first), which stays within a few
    steps of the bound (measured in tests/core/test_multicast.py).
    """
    if n <= 1 or not order:
        return []
    rank = {block: i for i, block in enumerate(order)}
    newest = lambda blocks: max(blocks, key=rank.__getitem__)  # noqa: E731
    have = [set(order)] + [set() for _ in range(n - 1)]
    d = dimensions(n)
    out: list[Transfer] = []
    step = 0
    while any(len(h) < len(order) for h in have):
        bit = 1 << (step % d)
        sends: list[Transfer] = []
        for a in range(n):
            b = a ^ bit
            missing = have[a] - have[b] if b < n else set()
            if missing:
                injecting = a == 0 and step < len(order) and order[step] in missing
                sends.append(Transfer(step, a, b, order[step] if injecting else newest(missing)))
        sends += _fill_idle(have, sends, step, newest)
        for t in sends:  # a step's transfers happen at once: receive after everyone sent
            have[t.dst].add(t.block)
        out.extend(sends)
        step += 1
        if step > 4 * (len(order) + d) + 16:  # a plan that does not converge is a bug
            raise RuntimeError(f"binomial schedule for n={n}, b={len(order)} does not finish")
    return out


def _fill_idle(have: list[set[int]], sends: list[Transfer], step: int, newest) -> list[Transfer]:
    """Senders with no neighbour (or nothing to give) this step serve nodes that would receive
    nothing, the node with the fewest blocks first."""
    sending = {t.src for t in sends}
    receiving = {t.dst for t in sends}
    total = len(have[0])
    extra: list[Transfer] = []
    for r in sorted((r for r in range(len(have)) if r not in receiving and len(have[r]) < total),
                    key=lambda r: (len(have[r]), r)):
        donors = [s for s in range(len(have)) if s != r and s not in sending and have[s] - have[r]]
        if donors:
            s = min(donors, key=lambda s: (len(have[s]), s))
            extra.append(Transfer(step, s, r, newest(have[s] - have[r])))
            sending.add(s)
    return extra


def steps_of(schedule: list[Transfer]) -> int:
    return max((t.step for t in schedule), default=-1) + 1


def kway_orders(blocks: int, k: int, first: tuple[int, ...] = ()) -> list[list[int]]:
    """Algorithm 1: the block order of each of k sub-groups (chunks circularly shifted).
    `first`: blocks every sub-group sends before the others, in this order (the blocks of a
    pipeline head's tensors, `head_first`); the chunks are cut from the rest."""
    if k < 1 or blocks < 1:
        raise ValueError("need k >= 1 and blocks >= 1")
    if len(set(first)) != len(first) or any(not 0 <= b < blocks for b in first):
        raise ValueError(f"first must be distinct blocks of 0..{blocks - 1}, got {first}")
    rest = [b for b in range(blocks) if b not in set(first)]
    size = math.ceil(len(rest) / k) if rest else 1
    chunks = [rest[size * i:size * (i + 1)] for i in range(k)]
    return [[*first, *(b for j in range(k) for b in chunks[(i + j) % k])] for i in range(k)]


def kway_schedule(n: int, k: int, blocks: int, first: tuple[int, ...] = ()) -> list[Transfer]:
    """k sources (nodes 0..k-1) to the other n - k nodes: one binomial pipeline per sub-group
    (`subgroups`), sub-group i sending the blocks in `kway_orders(blocks, k)[i]`, all at once
    (the sub-groups share no node, so a step still moves at most one block in and out of each
    node). With k = 1 this is `binomial_schedule(n, range(blocks))`. `first`: `kway_orders`'."""
    out: list[Transfer] = []
    for group, order in zip(subgroups(n, k), kway_orders(blocks, k, first)):
        out += [Transfer(t.step, group[t.src], group[t.dst], t.block)
                for t in binomial_schedule(len(group), order)]
    return sorted(out, key=lambda t: (t.step, t.src))


def subgroups(n: int, k: int) -> list[list[int]]:
    """n nodes (0..k-1 are the sources) split evenly into k sub-groups, each led by a source."""
    if not 1 <= k <= n:
        raise ValueError("need 1 <= k <= n")
    dests = list(range(k, n))
    groups = [[i] for i in range(k)]
    for j, node in enumerate(dests):
        groups[j % k].append(node)
    return groups


def execution_pipelines(groups: list[list[int]]) -> list[list[int]]:
    """Algorithm 2 over the destination nodes of each sub-group (sources excluded: they hold the
    whole model): one node from each sub-group with nodes left, while two or more have some;
    then the nodes of the last sub-group form one pipeline."""
    remaining = [list(g[1:]) for g in groups]
    pipelines: list[list[int]] = []
    while True:
        live = [g for g in remaining if g]
        if not live:
            return pipelines
        if len(live) == 1:
            pipelines.append(list(live[0]))
            live[0].clear()
            continue
        for _ in range(min(len(g) for g in live)):
            pipelines.append([g.pop(0) for g in live])


def arrival_steps(schedule: list[Transfer]) -> dict[int, dict[int, int]]:
    """node -> block -> the step in which the block reaches the node (held after that step)."""
    out: dict[int, dict[int, int]] = {}
    for t in schedule:
        got = out.setdefault(t.dst, {})
        got[t.block] = min(got.get(t.block, t.step), t.step)
    return out


def head_first(blocks: list[Block], head_spans: list[tuple[str, int, int]]) -> tuple[int, ...]:
    """The blocks holding any byte of the pipeline head's tensors ((file, start, end) spans: the
    embeddings, the final norm, the LM head), in block order: a multicast that sends these first
    (`kway_orders`' `first`) lets a receiver head an execution pipeline after a few blocks,
    instead of after the block with the final norm, which the layout puts last."""
    return tuple(b.index for b in blocks
                 if any(f == b.file and s < b.end and b.start < e for f, s, e in head_spans))


@functools.lru_cache(maxsize=2048)
def whole_steps(n: int, k: int, blocks: int) -> tuple[int, ...]:
    """Per node of `kway_schedule(n, k, blocks)`, the steps after which it holds every block (0
    for the k sources). Memoized: a placement prices many arrivals over a few group shapes, and
    the schedule is what the node workers run (the block order, head-first or not, does not
    change when a node is complete: each step still brings every node at most one block)."""
    got = arrival_steps(kway_schedule(n, k, blocks))
    return tuple(max(got[i].values()) + 1 if i in got else 0 for i in range(n))


def multicast_seconds(model_bytes: int, blocks: int, n: int, link_bytes_per_s: float,
                      step_latency_s: float = 0.0, k: int = 1) -> float:
    """k -> n (sources included) until every node holds the model, by the schedule's steps."""
    steps = max(whole_steps(n, k, blocks)) if n > k else 0
    return steps * step_seconds(model_bytes, blocks, link_bytes_per_s, step_latency_s)


@dataclass(frozen=True)
class Block:
    index: int  # position in the model's block order (0 = the first bytes of the first partition)
    file: str  # the partition the block lies in (a block never spans two partitions)
    start: int  # byte offset in that partition, a multiple of the alignment
    end: int  # exclusive; the partition's size for its last block

    @property
    def size(self) -> int:
        return self.end - self.start


def cut_blocks(partitions: list[tuple[str, int]], tensor_starts: dict[str, list[int]],
               blocks: int = DEFAULT_BLOCKS, alignment: int = 4096) -> list[Block]:
    """Cut partitions (file, size) into about `blocks` blocks of about equal size.

    Each partition gets blocks in proportion to its size (at least one), so the total is within
    a partition count of `blocks`. A cut lands on the tensor start (`tensor_starts[file]`) nearest
    its ideal position when one is within TENSOR_SNAP of a block's size, else at the aligned
    ideal position inside a tensor (an embedding larger than a block would otherwise make one
    block, and so every step of the pipeline, several times longer). Every byte of every
    partition is in exactly one block.
    """
    if blocks < 1:
        raise ValueError("need blocks >= 1")
    total = sum(size for _, size in partitions)
    if total <= 0:
        return []
    target = total / blocks
    out: list[Block] = []
    for file, size in partitions:
        if size <= 0:
            continue
        n = max(1, round(size / target))
        starts = sorted(s for s in tensor_starts.get(file, ()) if 0 < s < size)
        cuts = [0]
        for i in range(1, n):
            ideal = i * size / n
            cut = (int(ideal) // alignment) * alignment
            j = bisect.bisect_left(starts, ideal)
            near = [starts[x] for x in (j - 1, j) if 0 <= x < len(starts)]
            if near:
                best = min(near, key=lambda s: abs(s - ideal))
                if abs(best - ideal) <= TENSOR_SNAP * size / n:
                    cut = best
            if cuts[-1] < cut < size:
                cuts.append(cut)
        cuts.append(size)
        out += [Block(len(out) + i, file, a, b) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    return out


def repair_schedule(have: list[set[int]], order: list[int]) -> list[Transfer]:
    """Transfers that give every node every block of `order`, starting from any holdings (what
    the survivors of a multicast hold when a node was lost). Per step each node sends at most one
    block and receives at most one; nodes with the fewest blocks choose first, each taking the
    block held by the fewest nodes (so copies of rare blocks spread, and more nodes can forward
    them next step) from an idle holder, the one with the fewest blocks first (leaving the
    richer holders free for the others). Raises ValueError when a block is held by no node."""
    held = set().union(*have) if have else set()
    lost = [b for b in order if b not in held]
    if lost:
        raise ValueError(f"blocks {lost} are held by no node")
    rank = {block: i for i, block in enumerate(order)}
    have = [set(h) & set(order) for h in have]
    full = len(order)
    out: list[Transfer] = []
    step = 0
    while any(len(h) < full for h in have):
        sending: set[int] = set()
        sends: list[Transfer] = []
        copies = {b: sum(b in h for h in have) for b in order}
        for r in sorted((r for r in range(len(have)) if len(have[r]) < full),
                        key=lambda r: (len(have[r]), r)):
            options = [(copies[b], rank[b], s, b) for b in order if b not in have[r]
                       for s in [min((s for s in range(len(have)) if s != r and s not in sending
                                      and b in have[s]), key=lambda s: (len(have[s]), s),
                                     default=None)] if s is not None]
            if options:
                _, _, src, block = min(options)
                sends.append(Transfer(step, src, r, block))
                sending.add(src)
        if not sends:  # cannot happen while every missing block has a holder
            raise RuntimeError("repair schedule made no progress")
        for t in sends:
            have[t.dst].add(t.block)
        out.extend(sends)
        step += 1
    return out
