"""The paper's baselines (SLINFER §IX-A): ServerlessLLM and two extensions.

- sllm:      GPUs only. Each instance owns a whole GPU. A model scales out (a new instance, cold
             start) when every instance of it already holds its concurrency limit.
- sllm+c:    sllm plus the CPU nodes; existing CPU instances are tried first and new instances go
             to a free CPU node first.
- sllm+c+s:  sllm+c with static sharing: every instance gets half a node (half its memory, half
             its compute) -- except 13B models on CPU, which take a whole CPU node.

Concurrency limits (§IX-A, for 3B/7B/13B): sllm and sllm+c CPU (59, 15, 6), GPU (160, 32, 16);
sllm+c+s CPU (23, 4, 6), GPU (71, 12, 4). Keep-alive 1 s. A request that finds no instance under
its limit and no free slot waits in a FIFO queue and is dropped once it has waited its whole TTFT
SLO (queueing alone breaks it). A request that waits for a cold start gets the remaining load time
as TTFT grace (§IX-A).

Inside an instance, iterations run back to back like vLLM's continuous batching: a waiting request
is prefilled alone (if its prompt fits the KV cache), and then joins the decode batch. Iteration
times come from the same profiles as SLINFER. The KV cache is static: whatever memory the slot has
after the weights. If a decode step would overflow it, the newest request is evicted and later
recomputed (vLLM's recompute preemption).

Half-node slowdown. A half-node instance runs an iteration HALF_NODE_SLOWDOWN = 2x slower than on
the whole node while the other half of the node is busy (an iteration of the neighbour in flight
when it starts): they time-share the node's cores (CPU) or SMs (GPU) and its memory bandwidth.
With the other half idle it has the whole node, as time-sharing gives it. With the CPU profile this factor reproduces SLINFER
Table II: 7B on half a CPU node reaches 9 concurrent requests at 2K and 4 at 4K (Table II: 2x9 and
2x4); on half an A100 the limit is memory (40 GB - weights), also as in Table II.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from shared.core.perf_model import Profile
from shared.core.types import Hardware, first_token_due
from sim.engine import Event, EventLoop, IterationNoise, Recorder, SimRequest, Usage
from sim.scaleout import Multicaster, start_load
from sim.storage import NodeStorage

HALF_NODE_SLOWDOWN = 2.0

SIZES = ("3b", "7b", "13b")
SLLM_LIMITS = {Hardware.CPU: dict(zip(SIZES, (59, 15, 6))),
               Hardware.GPU: dict(zip(SIZES, (160, 32, 16)))}
SHARED_LIMITS = {Hardware.CPU: dict(zip(SIZES, (23, 4, 6))),
                 Hardware.GPU: dict(zip(SIZES, (71, 12, 4)))}


@dataclass(frozen=True)
class BaselineConfig:
    name: str  # "sllm", "sllm+c" or "sllm+c+s"
    use_cpu: bool  # CPU nodes take instances (and are tried first)
    half_sharing: bool  # every instance gets half a node (except 13B on CPU)
    keep_alive_s: float = 1.0  # §IX-A
    half_slowdown: float = HALF_NODE_SLOWDOWN

    @classmethod
    def named(cls, name: str, keep_alive_s: float = 1.0) -> BaselineConfig:
        table = {"sllm": (False, False), "sllm+c": (True, False), "sllm+c+s": (True, True)}
        if name not in table:
            raise ValueError(f"unknown baseline {name!r}; one of {sorted(table)}")
        use_cpu, half = table[name]
        if keep_alive_s < 0:
            raise ValueError("keep_alive_s must be >= 0")
        return cls(name, use_cpu, half, keep_alive_s)

    def limit(self, hw: Hardware, size: str) -> int:
        return (SHARED_LIMITS if self.half_sharing else SLLM_LIMITS)[hw][size]

    def slots_needed(self, hw: Hardware, size: str) -> int:
        """Half-node slots an instance takes: 2 = the whole node."""
        if not self.half_sharing or (hw is Hardware.CPU and size == "13b"):
            return 2
        return 1


@dataclass(frozen=True)
class Deployment:
    """A deployed model as the simulator knows it."""

    name: str
    size: str  # "3b" | "7b" | "13b": picks the concurrency limit
    weight_bytes: int
    kv_bytes_per_token: int
    profiles: dict[Hardware, Profile]


@dataclass
class BNode:
    node_id: str
    hardware: Hardware
    memory_bytes: int
    free_slots: int = 2  # half-node slots; an exclusive instance takes both
    instances: list[BInstance] = field(default_factory=list)
    storage: NodeStorage | None = None  # checkpoint tiers (None: the profile's load time)


@dataclass
class BInstance:
    iid: str
    dep: Deployment
    node: BNode
    slots: int
    limit: int  # concurrency limit: requests assigned (waiting + running) never exceed it
    kv_capacity_tokens: int
    ready_at: float
    created_at: float
    waiting: deque[SimRequest] = field(default_factory=deque)  # not yet (re)prefilled
    running: list[SimRequest] = field(default_factory=list)  # in the decode batch
    busy: bool = False  # an iteration is in flight
    idle_epoch: int = 0  # bumps whenever work arrives; a stale keep-alive check is ignored

    @property
    def assigned(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def profile(self) -> Profile:
        return self.dep.profiles[self.node.hardware]

    def kv_used_tokens(self) -> int:
        return sum(r.input_len + r.generated for r in self.running)


class BaselineSystem:
    """ServerlessLLM-style serving: concurrency-limited instances on exclusive (or half) nodes."""

    def __init__(self, config: BaselineConfig, nodes: list[BNode], deployments: dict[str, Deployment],
                 noise: IterationNoise | None = None, scaleout: Multicaster | None = None):
        self.config = config
        self.scaleout = scaleout  # λScale's multicast and execute-while-load (sim/scaleout.py)
        self.noise = noise or IterationNoise(0.0, 0)
        self.name = config.name
        self.nodes = nodes
        self.deps = deployments
        self.instances: dict[str, list[BInstance]] = {m: [] for m in deployments}
        self.queue: deque[SimRequest] = deque()  # FIFO of requests with nowhere to go
        self._next_iid = 0
        self.loop: EventLoop | None = None
        self.rec: Recorder | None = None

    # --- System protocol ----------------------------------------------------------------------
    def bind(self, loop: EventLoop, rec: Recorder) -> None:
        self.loop, self.rec = loop, rec

    def on_arrival(self, req: SimRequest) -> None:
        if not self._route(req):
            self.queue.append(req)
            due = first_token_due(req.arrival, req.grace_s, req.slo.ttft_s)
            self.loop.schedule(due, "deadline", req)

    def handle(self, ev: Event) -> None:
        getattr(self, f"_on_{ev.kind}")(ev.data)

    def usage(self) -> Usage:
        used = {Hardware.CPU: 0, Hardware.GPU: 0}
        alloc = held = 0
        for node in self.nodes:
            if node.instances:
                used[node.hardware] += 1
            for inst in node.instances:
                alloc += inst.kv_capacity_tokens * inst.dep.kv_bytes_per_token
                held += inst.kv_used_tokens() * inst.dep.kv_bytes_per_token
        return Usage(used[Hardware.CPU], used[Hardware.GPU], alloc, held)

    def shutdown(self) -> None:
        for node in self.nodes:
            for inst in list(node.instances):
                self._unload(inst)

    # --- routing ------------------------------------------------------------------------------
    def _hw_order(self) -> list[Hardware]:
        return [Hardware.CPU, Hardware.GPU] if self.config.use_cpu else [Hardware.GPU]

    def _route(self, req: SimRequest) -> bool:
        """An instance under its limit (CPU first, least loaded), else a new one; False: queue."""
        order = self._hw_order()
        cands = [i for i in self.instances[req.model]
                 if i.assigned < i.limit and i.node.hardware in order]
        if cands:
            cands.sort(key=lambda i: (order.index(i.node.hardware), i.assigned, i.iid))
            self._assign(cands[0], req)
            return True
        inst = self._create(req.model)
        if inst is None:
            return False
        self._assign(inst, req)
        return True

    def _assign(self, inst: BInstance, req: SimRequest) -> None:
        now = self.loop.now
        if inst.ready_at > now:  # waits for the cold start: §IX-A grace
            req.grace_s = max(req.grace_s, inst.ready_at - now)
        inst.waiting.append(req)
        inst.idle_epoch += 1
        self._kick(inst)

    def _create(self, model: str) -> BInstance | None:
        dep = self.deps[model]
        for hw in self._hw_order():
            if hw not in dep.profiles:
                continue
            slots = self.config.slots_needed(hw, dep.size)
            node = next((n for n in self.nodes if n.hardware is hw and n.free_slots >= slots), None)
            if node is not None:
                return self._load(dep, node, slots)
        return None

    def _load(self, dep: Deployment, node: BNode, slots: int) -> BInstance:
        now = self.loop.now
        mem = node.memory_bytes * slots // 2
        kv_tokens = max(0, (mem - dep.weight_bytes) // dep.kv_bytes_per_token)
        profile = dep.profiles[node.hardware]
        load_s = profile.load_s
        iid = f"{self.name}-i{self._next_iid}"
        if node.storage is not None:
            if self.scaleout is not None:
                tier, seconds = start_load(self.scaleout, node.storage, dep.name, dep.weight_bytes,
                                           node.node_id, self._holders(dep.name), now, iid)
            else:
                tier, seconds = node.storage.load(dep.name, dep.weight_bytes, now)
            load_s = seconds + profile.engine_init_s
            self.rec.count(f"loads:{tier}")
        inst = BInstance(
            iid=iid, dep=dep, node=node, slots=slots,
            limit=self.config.limit(node.hardware, dep.size),
            kv_capacity_tokens=int(kv_tokens), ready_at=now + load_s, created_at=now)
        self._next_iid += 1
        node.free_slots -= slots
        node.instances.append(inst)
        self.instances[dep.name].append(inst)
        self.rec.count("cold_starts")
        self.loop.schedule(inst.ready_at, "ready", inst)
        return inst

    def _holders(self, model: str) -> list[str]:
        """Nodes with a loaded instance of the model or its checkpoint in their DRAM tier."""
        now = self.loop.now
        return [n.node_id for n in self.nodes if self.scaleout.is_holder(
            n.node_id, model, [i.iid for i in n.instances if i.dep.name == model and i.ready_at <= now],
            n.storage is not None and model in n.storage.dram, now)]

    def _pipeline_extra(self, inst: BInstance, tokens: int) -> float:
        """An iteration's cost beyond the profile in an execute-while-load pipeline, or once at
        the mode switch (sim/scaleout.py)."""
        if self.scaleout is None:
            return 0.0
        context = sum(r.input_len + r.generated for r in inst.running)
        return self.scaleout.iteration_extra(inst.iid, inst.dep.name, tokens, context,
                                             inst.dep.kv_bytes_per_token, inst.profile, self.loop.now)

    def _unload(self, inst: BInstance) -> None:
        inst.node.instances.remove(inst)
        inst.node.free_slots += inst.slots
        self.instances[inst.dep.name].remove(inst)
        self.rec.add_instance_lifetime(self.loop.now - inst.created_at)

    def _retry_queue(self, model: str | None = None) -> None:
        """Give queued requests (of one model, or all after a slot frees) another try, FIFO."""
        kept: deque[SimRequest] = deque()
        while self.queue:
            req = self.queue.popleft()
            if model is not None and req.model != model:
                kept.append(req)
            elif self.loop.now - req.arrival >= req.slo.ttft_s:
                self._drop(req)
            elif not self._route(req):
                kept.append(req)
        self.queue = kept

    def _drop(self, req: SimRequest) -> None:
        req.dropped = True
        self.rec.count("dropped")
        self.rec.request_done(req)

    # --- execution ----------------------------------------------------------------------------
    def _kick(self, inst: BInstance) -> None:
        """Start the instance's next iteration if it is ready and idle."""
        now = self.loop.now
        if inst.busy or inst.ready_at > now:
            return
        if inst.waiting and self._prompt_fits(inst, inst.waiting[0]):
            req = inst.waiting[0]
            seconds = inst.profile.prefill_s(req.input_len + req.generated) * self._slowdown(inst)
            seconds += self._pipeline_extra(inst, req.input_len + req.generated)
            self._start(inst, ("prefill", req), seconds)
        elif inst.running:
            batch = len(inst.running)
            if inst.kv_used_tokens() + batch > inst.kv_capacity_tokens:
                self._evict_newest(inst)
                return self._kick(inst)
            avg = inst.kv_used_tokens() / batch
            seconds = inst.profile.decode_s(batch, avg) * self._slowdown(inst)
            seconds += self._pipeline_extra(inst, batch)
            self._start(inst, ("decode", None), seconds)
        elif inst.waiting:  # alone and still too long for this slot's KV cache: never fits
            self._drop(inst.waiting.popleft())
            self._kick(inst)
        else:
            self.loop.schedule(now + self.config.keep_alive_s, "keepalive", (inst, inst.idle_epoch))

    def _slowdown(self, inst: BInstance) -> float:
        """The iteration's time multiplier: the node's noise, and half a node's share while the
        neighbour is busy."""
        shared = inst.slots < 2 and any(o.busy for o in inst.node.instances if o is not inst)
        return self.noise() * (self.config.half_slowdown if shared else 1.0)

    def _prompt_fits(self, inst: BInstance, req: SimRequest) -> bool:
        need = req.input_len + req.generated + 1
        return inst.kv_used_tokens() + need <= inst.kv_capacity_tokens or (
            not inst.running and need <= inst.kv_capacity_tokens)

    def _evict_newest(self, inst: BInstance) -> None:
        victim = max(inst.running, key=lambda r: (r.arrival, r.rid))
        inst.running.remove(victim)
        victim.evictions += 1
        inst.waiting.appendleft(victim)
        self.rec.count("evictions")

    def _start(self, inst: BInstance, work: tuple, seconds: float) -> None:
        inst.busy = True
        self.loop.schedule(self.loop.now + seconds, "iter_done", (inst, work, seconds))

    def _on_iter_done(self, data: tuple) -> None:
        inst, (kind, req), seconds = data
        inst.busy = False
        now, hw = self.loop.now, inst.node.hardware
        finished = False
        if kind == "prefill":
            inst.waiting.remove(req)
            self.rec.iteration(now, hw, True, 1, seconds)
            if req.first_token_at is None:
                req.first_token_at, req.hardware = now, hw
            req.token(now)  # a (re)prefill also yields the next token
            finished |= self._maybe_finish(inst, req, running=False)
        else:
            self.rec.iteration(now, hw, False, len(inst.running), seconds)
            for r in list(inst.running):
                r.token(now)
                finished |= self._maybe_finish(inst, r, running=True)
        if finished:
            self._retry_queue(inst.dep.name)
        self._kick(inst)

    def _maybe_finish(self, inst: BInstance, req: SimRequest, running: bool) -> bool:
        if req.generated < req.output_len:
            if not running:
                inst.running.append(req)
            return False
        if running:
            inst.running.remove(req)
        req.finished_at = self.loop.now
        self.rec.request_done(req)
        return True

    def _on_ready(self, inst: BInstance) -> None:
        if inst in inst.node.instances:
            self._kick(inst)

    def _on_keepalive(self, data: tuple) -> None:
        inst, epoch = data
        if inst not in inst.node.instances or inst.idle_epoch != epoch or inst.assigned or inst.busy:
            return
        self._unload(inst)
        self._retry_queue()

    def _on_deadline(self, req: SimRequest) -> None:
        if not req.done and req in self.queue:
            self.queue.remove(req)
            self._drop(req)
