"""Adversarial timelines on the node core (issue 22): random arrivals (some through LoRA
adapters), live and stop-and-resume preemptions, adapter pre-loads, CoCoServe layer sheds to a
host and λScale execution pipelines with a helper, on two nodes, driven by a plain event loop.

The world the core is promised: an iteration takes at most what `step` predicted (a random
factor in [0.5, 1]; half the time all of it), times the contention of the stages its node hosts
(`cost.contention` of `NodeView.stage_load`, as the core's validation counts it); a memory op
takes what the node's timeline prices it at (`MemOpTimeline.op_seconds`) from when the ledger
starts it; a handover ends by the time promised, or sooner; a pipeline switches to local
execution once its model has arrived. Every decision that changes the timeline is the core's
own, taken as the node worker and the placer take it: admissions, preemption trials, pre-loads,
the module planner's sheds, the pipeline's helper. Requests ask for at most the model's average
output length, so eq. 2 never underestimates their K/V (an underestimation's scale-up or
eviction, §VII-D, is a risk SLINFER takes knowingly, not part of the promise).

Checked after every event: every node's pessimistic memory stays within its capacity, and what
a stage host really holds for an instance (its stage mirrors the instance's K/V blocks) within
what its ledger reserved; and every token of an admitted request comes by its Eq. 1 deadline
while the request is on the node that admitted it (a preemption's victims hand theirs over).
One kind of late token is counted rather than failed: one behind a priority inversion
(`Timeline.inversion`), which SLINFER's non-preemptive token loop allows whenever work ends
sooner than the validation assumed.
"""


from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from shared.core.config import CoreConfig
from shared.core.consolidation import preemption_victims
from shared.core.context import DecisionContext
from shared.core.cost import contention, layer_weight_bytes, stage_bytes
from shared.core.lora import adapter_load_s
from shared.core.memory import UNLOAD_S, MemOpKind
from shared.core.module_scaling import (MemoryPressure, ModuleAction, ModuleSettings,
                                        plan_module_scaling)
from shared.core.modules import stage_key
from shared.core.node_scheduler import NodeScheduler
from shared.core.node_token_loop import LATE_EPS_S
from shared.core.startup import pipeline_helper
from shared.core.types import (AdapterSpec, Hardware, InstanceStatus, ModelSpec, PipelineMode,
                               StorageView, adapter_key)

from tests.core.factories import GB, linear_profile, node, perf_for, request

# A model whose layers can move (CoCoServe) and serve through a pipeline (λScale), a plain one
# that is also the adapters' backbone, and another plain one. K/V of 1 MiB or 0.5 MiB a token: an
# instance's pool is a sizeable share of a 6-12 GB node.
SPLIT = ModelSpec("a", int(2.25 * GB), 1 << 20, 1024, 64.0, layers=8, head_bytes=GB // 4,
                  token_bytes=8192)
PLAIN = ModelSpec("b", 1 * GB, 1 << 19, 1024, 64.0)
WIDE = ModelSpec("c", int(1.5 * GB), 1 << 20, 1024, 64.0)
MODELS = {"a": SPLIT, "b": PLAIN, "c": WIDE}
# Iterations slow enough that deadlines bind (1 ms a prompt token, 50+ ms a decode step), loads
# and resizes that take time (a resize: 20 ms plus the new pool at 5 GB/s).
PERF = perf_for(*(replace(linear_profile(m, Hardware.CPU, 1e-3, base, 0.01, load_s=0.5),
                          kv_scale_fixed_s=0.02, kv_scale_bytes_per_s=5e9)
                  for m, base in (("a", 0.05), ("b", 0.005), ("c", 0.06))))
CONFIG = CoreConfig(live_preemption=True, enable_pipeline=True)
MODULES = ModuleSettings(hop_latency_s=2e-3, link_bytes_per_s=1e9)
ADAPTERS = [AdapterSpec(f"lora{k}", size) for k, size in
            enumerate((GB // 20, GB // 5, GB // 2))]  # loads of 0.1 s, 0.43 s, 1.07 s
NODES = ("n0", "n1")
EPS_S = 1e-9


# --- the timeline's events -------------------------------------------------------------------
node_ids = st.sampled_from(NODES)
prompts = st.integers(16, 950)  # a prompt and its output fit the models' 1024-token context
arrivals = st.tuples(st.just("arrive"), node_ids, st.sampled_from(sorted(MODELS)), prompts,
                     st.floats(0.3, 4.0), st.floats(0.08, 0.5), st.integers(8, 64),
                     st.sampled_from([None, None, 0, 1, 2]), st.integers(0, 3))
preemptions = st.tuples(st.just("preempt"), node_ids, prompts, st.floats(0.3, 6.0),
                        st.one_of(st.none(), st.floats(0.0, 3.0)),
                        st.sampled_from([None, 0, 1, 2]))
preloads = st.tuples(st.just("preload"), node_ids, st.integers(0, 2), st.integers(0, 3))
sheds = st.tuples(st.just("shed"), node_ids, st.floats(0.05, 1.5))
pipelines = st.tuples(st.just("pipeline"), prompts, st.floats(0.3, 4.0),
                      st.floats(0.05, 0.5), st.floats(0.5, 4.0))
cancels = st.tuples(st.just("cancel"), st.integers(0, 50))
# Arrivals six events in ten, in bursts (`one_of` would draw each kind alike).
kinds = [arrivals] * 6 + [preemptions] * 2 + [preloads, sheds, pipelines, cancels]
events = st.lists(st.tuples(st.one_of(st.just(0.0), st.floats(0.0, 0.3)),
                            st.sampled_from(kinds).flatmap(lambda kind: kind)),
                  min_size=12, max_size=40)


@dataclass
class Timeline:
    """Two nodes run by one event loop: at each time, the next of (an iteration ends, a memory
    op ends, a handover or pipeline switch is due, a node may run again, an event arrives)."""

    memory_gb: float
    seed: int
    now: float = 0.0
    scheds: dict[str, NodeScheduler] = field(default_factory=dict)
    agenda: list = field(default_factory=list)  # (time, seq, kind, data)
    busy: dict[str, bool] = field(default_factory=dict)
    tracked: set[str] = field(default_factory=set)  # admitted requests whose deadlines bind
    sheds: dict[str, tuple] = field(default_factory=dict)  # hold key -> (plan, host)
    stages: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # iid -> [(host, key)]
    deferred: dict[str, list] = field(default_factory=dict)  # node -> handovers after its iteration
    log: list[str] = field(default_factory=list)
    # node -> the iterations it ran: (instance, start, end, its end as the core expected it)
    runs: dict[str, list[tuple[str, float, float, float]]] = field(default_factory=dict)
    # node -> instance -> when it could run, as the node's last admission was validated
    promised: dict[str, dict[str, float]] = field(default_factory=dict)
    inversions: int = 0  # late tokens after a priority inversion (`inversion`)
    runnable_since: dict[tuple[str, str], float] = field(default_factory=dict)
    verbose: bool = False  # log every iteration and memory op too (to read a failing case)
    slowest: bool = False  # every iteration takes all the time predicted (explicit cases)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.seq = itertools.count()
        self.ids = itertools.count()
        self.wakes: set[tuple[str, float]] = set()
        for n in NODES:
            self.scheds[n] = node(n, Hardware.CPU, self.memory_gb, PERF, CONFIG)
            self.busy[n] = False
            self.deferred[n] = []
            self.runs[n], self.promised[n] = [], {}

    # --- the loop ----------------------------------------------------------------------------
    def at(self, t: float, kind: str, data) -> None:
        heapq.heappush(self.agenda, (t, next(self.seq), kind, data))

    def run_until(self, t: float) -> None:
        """Everything due by `t`. Events due at one time all happen before the nodes pick
        their next iterations, as the shadow validation sees them (two loads that end together
        make both instances runnable then, not the first one's long prefill first)."""
        while self.agenda and self.agenda[0][0] <= t:
            self.now = max(self.now, self.agenda[0][0])
            while self.agenda and self.agenda[0][0] <= self.now:
                _, _, kind, data = heapq.heappop(self.agenda)
                getattr(self, f"_on_{kind}")(data)
                self.check_memory()
            self.kick_all()
        self.now = max(self.now, t)

    def drain(self, limit: int = 20000) -> None:
        """Run until nothing is left to do (every request finished or gone)."""
        for _ in range(limit):
            if not self.agenda:
                return
            self.run_until(self.agenda[0][0])
        raise AssertionError("the timeline does not end")

    def kick_all(self) -> None:
        for n in NODES:
            self.note_runnable(n)
            self.kick(n)

    def note_runnable(self, n: str) -> None:
        """Since when each instance of `n` could run (an iteration, were the node free)."""
        sched = self.scheds[n]
        for inst in sched.node.instances:
            keys = [inst.instance_id, *(adapter_key(inst.instance_id, a) for a in inst.adapters)]
            free = inst.status in (InstanceStatus.READY, InstanceStatus.HANDOVER) and \
                inst.ready_at <= self.now and not any(sched.ledger.busy(k) for k in keys)
            if free:
                self.runnable_since.setdefault((n, inst.instance_id), self.now)
            else:
                self.runnable_since.pop((n, inst.instance_id), None)

    def kick(self, n: str) -> None:
        if self.busy[n]:
            return
        sched = self.scheds[n]
        plan = sched.step(self.now)
        self.start(n, plan.start_ops)
        assert not plan.evictions, (n, plan.evictions, self.log)
        if plan.iteration is not None:
            self.busy[n] = True
            # As slow as predicted half the time (the adversary's choice), else faster.
            speed = 1.0 if self.slowest or self.rng.random() < 0.5 else self.rng.uniform(0.5, 1.0)
            seconds = plan.predicted_s * speed * contention(sched.node.stage_load)
            self.at(self.now + seconds, "iteration", (n, plan.iteration))
            self.runs[n].append((plan.iteration.instance_id, self.now, self.now + seconds,
                                 sched.node.busy_until))
            if self.verbose:
                self.log.append(f"    {self.now:.4f} {n} runs {plan.iteration.kind.value} "
                                f"{plan.iteration.request_ids} on {plan.iteration.instance_id} "
                                f"until {self.now + seconds:.4f} (predicted "
                                f"{plan.predicted_s:.4f}, load {sched.node.stage_load:.3f})")
            return
        # Nothing runnable now: wake up when an instance with work may run, or an idle one's
        # keep-alive expires (the node worker's loop does the same).
        times = [i.ready_at for i in sched.node.instances if i.requests and i.ready_at > self.now]
        reclaim = sched.next_reclaim_at()
        if reclaim is not None:
            times.append(max(reclaim, self.now))
        for t in times:
            if (n, t) not in self.wakes and t < float("inf"):
                self.wakes.add((n, t))
                self.at(t, "wake", n)

    def start(self, n: str, ops) -> None:
        for op in ops:
            # As long as the node's timeline prices it (`MemOpTimeline.op_seconds`).
            seconds = self.scheds[n].timeline.op_seconds(op)
            self.at(self.now + seconds, "memop", (n, op))
            if self.verbose:
                self.log.append(f"    {self.now:.4f} {n} starts {op.kind.value} of "
                                f"{op.instance_id} {op.bytes_before}->{op.bytes_after} until "
                                f"{self.now + seconds:.4f}")

    # --- what the nodes do -------------------------------------------------------------------
    def _on_wake(self, n: str) -> None:
        self.wakes.discard((n, self.now))
        self.start(n, self.scheds[n].reclaim_idle(self.now))

    def _on_iteration(self, data) -> None:
        n, choice = data
        sched = self.scheds[n]
        self.busy[n] = False
        inst = sched.node.instance(choice.instance_id)
        finished: set[str] = set()
        for r in inst.requests if inst is not None else ():
            if r.request_id not in choice.request_ids:
                continue
            if r.request_id in self.tracked and self.now > r.deadline() + LATE_EPS_S:
                late = f"{r.request_id} on {n}: token {r.generated + 1} at {self.now:.4f}, " \
                       f"due {r.deadline():.4f}"
                assert self.inversion(n, inst), (late, self.log)
                self.log.append(f"  {late}, after a priority inversion")
                self.inversions += 1
                self.tracked -= {q.request_id for i in sched.node.instances for q in i.requests}
            if r.generated + 1 >= r.max_tokens:
                finished.add(r.request_id)
        self.start(n, sched.finish_iteration(choice, self.now, finished))
        self.tracked -= finished
        due, self.deferred[n] = self.deferred[n], []
        for handover in due:
            self._hand_over(handover)

    def _on_memop(self, data) -> None:
        n, op = data
        sched = self.scheds[n]
        self.start(n, sched.memop_done(op, self.now))
        if op.instance_id in self.sheds and op.kind is MemOpKind.LOAD \
                and not sched.ledger.busy(op.instance_id):
            self._moved(op.instance_id)
        if op.kind is MemOpKind.UNLOAD and sched.node.instance(op.instance_id) is None:
            for host, key in self.stages.pop(op.instance_id, []):  # its stages go with it
                self.release(host, key)

    def _on_handover(self, data) -> None:
        n, victims, _ = data
        running = self.scheds[n].node.running
        if self.busy[n] and running is not None and running.instance_id in victims:
            self.deferred[n].append(data)  # after the victim's iteration in flight
            return
        self._hand_over(data)

    def _hand_over(self, data) -> None:
        """The victims' requests have moved: each one the other node took joins its batch
        there with the tokens it made here meanwhile (the commit); then the victims unload."""
        n, victims, moves = data
        sched = self.scheds[n]
        on_victims = {r.request_id: r for v in victims
                      for r in getattr(sched.node.instance(v), "requests", ())}
        for dest, iid, view in moves:
            source = on_victims.get(view.request_id)
            if source is not None and \
                    self.scheds[dest].commit_parked(iid, view, source.generated, self.now):
                self.log.append(f"  {self.now:.4f} {view.request_id} moved to {iid}")
        for v in victims:
            inst = sched.node.instance(v)
            for r in list(inst.requests) if inst is not None else ():
                self.start(n, sched.cancel(r.request_id, self.now))
            left, ops = sched.finish_handover(v, self.now)
            assert left == []
            self.start(n, ops)

    def _on_switch(self, data) -> None:
        """The pipelined instance's model has arrived: it runs every layer at home, its helper
        lets the stage go."""
        iid, helper, key = data
        self.scheds["n0"].set_pipeline(iid, None)
        self.scheds["n0"].node.storage = None
        self.release(helper, key)
        self.stages[iid] = [s for s in self.stages.get(iid, []) if s[1] != key]

    def release(self, host: str, key: str) -> None:
        self.sheds.pop(key, None)
        _, ops = self.scheds[host].hold(key, 0, self.now)
        self.start(host, ops)

    # --- external events ---------------------------------------------------------------------
    def apply(self, happening) -> None:
        self.log.append(f"{self.now:.4f} {happening}")
        getattr(self, f"_{happening[0]}")(*happening[1:])
        self.check_memory()
        self.kick_all()

    def _request(self, model: str, input_len: int, ttft: float, max_tokens: int,
                 adapter: AdapterSpec | None = None, tpot: float = 0.25):
        r = request(f"r{next(self.ids)}", model, input_len=input_len, arrival=self.now,
                    ttft=ttft, tpot=tpot, max_tokens=max_tokens)
        return replace(r, lora_rank=8, adapter=adapter.name) if adapter is not None else r

    def admitted(self, n: str, result, rid: str) -> bool:
        self.start(n, result.start_ops)
        if result.admission.ok:
            self.tracked.add(rid)
            self.promise(n)
            self.log.append(f"  admitted {rid} on {result.instance_id} grace "
                            f"{result.admission.grace_s:.3f}")
        return result.admission.ok

    def _arrive(self, n: str, model: str, input_len: int, ttft: float, tpot: float,
                max_tokens: int, adapter: int | None, pick: int) -> None:
        sched = self.scheds[n]
        spec = MODELS[model]
        through = ADAPTERS[adapter] if adapter is not None and model == "b" else None
        r = self._request(model, input_len, ttft, max_tokens, through, tpot)
        joinable = [i.instance_id for i in sched.node.instances
                    if i.model.name == model and i.accepts]
        piped = n == "n0" and sched.node.storage is not None and model == "a"
        joined = joinable[pick] if pick < len(joinable) else None
        targets = ([joined] if joined else []) + ([] if piped else [None])
        for iid in targets:  # the placer's order: a running instance first, else a new one
            if self.admitted(n, sched.admit(r, iid, spec, self.now, through), r.request_id):
                return

    def _preempt(self, n: str, input_len: int, ttft: float, handover_s: float | None,
                 adapter: int | None) -> None:
        sched = self.scheds[n]
        view = sched.view()
        candidates = [i for i in view.instances if i.accepts and i.requests
                      and i.status is InstanceStatus.READY]
        if not candidates:
            return
        preemptor = max(candidates, key=lambda i: (i.batch_size, i.instance_id))
        victims = [v.instance_id for v in preemption_victims(view, preemptor)]
        if not victims:
            return
        spec = MODELS[preemptor.model.name] if preemptor.layout is None else preemptor.layout.model
        through = ADAPTERS[adapter] if adapter is not None and spec.name == "b" else None
        r = self._request(spec.name, input_len, ttft, 32, through)
        res = sched.preempt_and_admit(victims, r, preemptor.instance_id, spec, self.now,
                                      through, handover_s=handover_s)
        self.log.append(f"  preempt {victims} live {handover_s is not None}: "
                        f"{res.admission.reason.value}")
        if not res.admission.ok:
            assert res.evicted == () and res.start_ops == () and res.migrating == (), res
            return
        # The victims' requests move elsewhere: from now on their tokens are the migration's
        # (ServerlessLLM §5), not this node's promise.
        self.tracked -= {v.request_id for v in (*res.evicted, *res.migrating)}
        self.admitted(n, res, r.request_id)
        if handover_s is not None:  # done by the time promised, or sooner
            moves = [m for r in res.migrating if (m := self.migrate(n, r)) is not None]
            self.at(self.now + handover_s * self.rng.uniform(0.5, 1.0), "handover",
                    (n, tuple(victims), moves))

    def migrate(self, source: str, r):
        """A live migration's destination: the other node admits the request to an instance of
        its model (to recompute its KV: not prefilled) and holds it out of its batches until
        the commit; None where it refuses (the request then just leaves at the handover)."""
        dest = NODES[1 - NODES.index(source)]
        sched = self.scheds[dest]
        iid = next((i.instance_id for i in sched.node.instances
                    if i.model.name == r.model and i.accepts and i.layout is None), None)
        if iid is None:
            return None
        through = next((a for a in ADAPTERS if a.name == r.adapter), None)
        res = sched.admit(replace(r, prefilled=False), iid, MODELS[r.model], self.now, through)
        self.start(dest, res.start_ops)
        if not res.admission.ok:
            return None
        self.promise(dest)
        self.log.append(f"  {r.request_id} migrates to {iid}")
        return dest, iid, sched.park(iid, r.request_id)

    def _preload(self, n: str, adapter: int, pick: int) -> None:
        sched = self.scheds[n]
        ready = [i.instance_id for i in sched.node.instances
                 if i.model.name == "b" and i.status is InstanceStatus.READY]
        if ready:
            ops = sched.preload_adapter(ready[pick % len(ready)], ADAPTERS[adapter], self.now)
            self.log.append(f"  preload: {bool(ops)}")
            self.start(n, ops)
            if ops:  # validated like an admission (`evaluate.may_hold`)
                self.promise(n)

    def _shed(self, n: str, deficit_gb: float) -> None:
        """Memory pressure on `n`: the module planner's sheds, carried out as the placer and the
        node workers do: the host reserves the stage (a hold), and once its op has run the
        owner's layers move (`set_layout`)."""
        busy = frozenset(p.instance_id for p, _ in self.sheds.values())
        ctx = DecisionContext([self.scheds[x].view() for x in NODES], PERF, self.now, CONFIG)
        plans = plan_module_scaling(ctx, [MemoryPressure(n, int(deficit_gb * GB))], MODULES,
                                    busy=busy)
        for plan in plans:
            if plan.action is not ModuleAction.SHED:
                continue
            key = stage_key(plan.instance_id, plan.start, plan.end)
            ok, ops = self.scheds[plan.host_node].hold(key, plan.host_bytes, self.now, plan.load)
            self.log.append(f"  shed {key} to {plan.host_node}: {ok}")
            if ok:
                self.sheds[key] = (plan, plan.host_node)
                self.start(plan.host_node, ops)

    def _moved(self, key: str) -> None:
        plan, host = self.sheds.pop(key)
        owner = self.scheds[plan.owner_node]
        inst = owner.node.instance(plan.instance_id)
        if inst is None or inst.status is not InstanceStatus.READY:
            self.release(host, key)
            return
        ok, ops = owner.set_layout(plan.instance_id, plan.layout_after(inst, key, MODULES),
                                   self.now)
        self.log.append(f"  {self.now:.4f} moved {key}: {ok}")
        if not ok:
            self.release(host, key)
            return
        self.start(plan.owner_node, ops)
        self.stages.setdefault(plan.instance_id, []).append((host, key))

    def _pipeline(self, input_len: int, ttft: float, serve_s: float, arrive_s: float) -> None:
        """A new instance of the split model on n0 serves through an execution pipeline with
        n1 running the layers it lacks (a DRAM holder's stage), until its copy has arrived."""
        owner, helper = self.scheds["n0"], self.scheds["n1"]
        if owner.node.storage is not None or any(i.model.name == "a" for i in owner.node.instances):
            return
        if pipeline_helper(SPLIT, [helper.view()], PERF, CONFIG, self.now) is None:
            return  # the placer's choice: no room or no compute for the stage there
        mode = PipelineMode(1, CONFIG.pipeline_hop_latency_s, 1e9, SPLIT.token_bytes, serve_s,
                            ("n1",))
        owner.node.storage = StorageView({}, arriving={"a": serve_s + arrive_s},
                                         pipelines={"a": mode})
        r = self._request("a", input_len, ttft, 32)
        res = owner.admit(r, None, SPLIT, self.now)
        self.log.append(f"  pipeline: {res.admission.reason.value}")
        if not self.admitted("n0", res, r.request_id):
            owner.node.storage = None
            return
        key = stage_key(res.instance_id, 1, SPLIT.layers)
        ok, ops = helper.hold(key, stage_bytes(SPLIT), self.now,
                              (SPLIT.layers - 1) / SPLIT.layers)
        assert ok, "pipeline_helper saw room for the stage"
        self.start("n1", ops)
        self.stages.setdefault(res.instance_id, []).append(("n1", key))
        self.at(self.now + serve_s + arrive_s, "switch", (res.instance_id, "n1", key))

    def _cancel(self, k: int) -> None:
        live = sorted(r.request_id for s in self.scheds.values() for i in s.node.instances
                      for r in i.requests if i.status is not InstanceStatus.HANDOVER)
        if live:
            rid = live[k % len(live)]
            for n, sched in self.scheds.items():
                self.start(n, sched.cancel(rid, self.now))
            self.tracked.discard(rid)

    # --- invariants --------------------------------------------------------------------------
    def promise(self, n: str) -> None:
        """An admission (or a pre-load) was validated on `n`: when each instance can run, as
        the validation took it."""
        self.promised[n] = {i.instance_id: i.ready_at for i in self.scheds[n].node.instances}

    def inversion(self, n: str, inst) -> bool:
        """Was a late token on `inst` the work of a priority inversion, the one way a promise
        of the core breaks in a world that runs no later than the core expects? The node runs
        one iteration at a time and never preempts one, so an iteration it starts while `inst`
        cannot run yet (a load, a resize, an adapter or a handover holding it up) may still
        run when `inst` can, however urgent its requests are; its start then depends on when
        the work before it ended. The shadow validation simulated that work at its predicted
        length (plus the overestimate), with the requests it holds (none finishing) and the
        ready times the node's timeline estimates; when the work ends sooner (a faster
        iteration, a request that finished or was cancelled, a parked op that started early),
        such an iteration can start before `inst` is ready where the validation had it start
        after. Counted (the token loop would have to hold back, or the validation assume the
        worst blocking, to rule it out), but only where `inst` could run no later than the
        node's last validation said and the iteration in the way ended no later than the node
        expected: a late ready time or a long iteration is a misprediction, and fails."""
        ready = self.runnable_since.get((n, inst.instance_id), inst.ready_at)
        if ready > self.promised[n].get(inst.instance_id, ready) + EPS_S:
            return False
        return any(iid != inst.instance_id and start < ready <= end <= until + EPS_S
                   for iid, start, end, until in self.runs[n])

    def check_memory(self) -> None:
        for n, sched in self.scheds.items():
            ledger = sched.ledger
            assert ledger.pessimistic <= ledger.capacity, (n, ledger.pessimistic, self.log)
            assert ledger.budget <= ledger.capacity, (n, ledger.budget, self.log)
        for iid, stages in self.stages.items():
            inst = self.scheds["n0"].node.instance(iid) or self.scheds["n1"].node.instance(iid)
            if inst is None:
                continue
            for host, key in stages:
                held = self.scheds[host].ledger.target(key)
                assert self.stage_needs(inst, key) <= held, \
                    (f"{key} on {host} mirrors {self.stage_needs(inst, key)} bytes, "
                     f"holds {held}", self.log)

    @staticmethod
    def stage_needs(inst, key: str) -> int:
        """What a stage of `inst` holds on its host: its layers' weights and their K/V pool,
        which mirrors the instance's block count (the instance's pool in tokens)."""
        start, end = (int(x) for x in key.rsplit("/", 1)[1].split(":"))
        full = inst.layout.model if inst.layout is not None else inst.model
        tokens = inst.kv_bytes // max(1, inst.model.kv_bytes_per_token)
        layers = end - start
        return layers * layer_weight_bytes(full, full.layers, full.head_bytes) + \
            tokens * (full.kv_bytes_per_token * layers // full.layers)


def run_timeline(memory_gb: float, seed: int, timeline, verbose: bool = False,
                 slowest: bool = False) -> Timeline:
    world = Timeline(memory_gb, seed, verbose=verbose, slowest=slowest)
    t = 0.0
    for gap, happening in timeline:
        t += gap
        world.run_until(t)
        world.apply(happening)
    world.drain()
    return world


@given(timeline=events, memory_gb=st.sampled_from([6.0, 8.0, 12.0]), seed=st.integers(0, 999))
@settings(max_examples=300, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def test_random_timelines_keep_deadlines_and_memory(timeline, memory_gb, seed):
    world = run_timeline(memory_gb, seed, timeline)
    event(f"priority inversions: {min(world.inversions, 2)}")


# --- what the property found: each timeline as it was shrunk, failing before its fix ----------
def run(timeline, memory_gb: float = 12.0, seed: int = 0) -> Timeline:
    """An explicit timeline, every iteration as slow as predicted (the handovers' and the
    speeds' draws come from `seed`)."""
    return run_timeline(memory_gb, seed, timeline, slowest=True)


def test_a_pipelined_instance_keeps_its_pool_within_what_its_helper_reserved():
    """The helper's stage mirrors the instance's block count, and the placer had it reserve K/V
    for one full context (`stage_bytes`); the new instance's pool was 1.25 of that (the
    watermark) from its first admission on, and grew with every join (`cost.kv_ceiling`)."""
    run([(0.0, ("pipeline", 100, 2.0, 0.3, 3.0))])


def test_a_pipeline_helper_keeps_the_deadlines_of_the_requests_it_admitted():
    """n1 admitted a 400-token prompt due at 1.2 s; a stage of 7 of the 8 layers of a new
    instance on n0 takes 7/8 of its compute, so that prefill takes 3.2 s. The helper was chosen
    for its memory and its decode round (case 3) alone (`startup.takes_load`)."""
    run([(0.0, ("arrive", "n1", "b", 400, 0.7, 0.25, 16, None, 0)),
         (0.0, ("pipeline", 300, 1.0, 0.3, 3.0))], memory_gb=6.0)


def test_a_stage_host_times_the_iteration_in_flight_with_its_stages_load():
    """n1 runs a prefill predicted at 0.256 s while it hosts a 7/8 stage: 2.05 s. After the
    stage left, a join was validated as if the prefill had ended at 0.756 s
    (`NodeView.busy_until` without the contention)."""
    run([(0.0, ("pipeline", 100, 1.0, 0.2, 1.0)),
         (0.0, ("arrive", "n1", "b", 256, 2.7, 0.25, 8, None, 0)),
         (1.3, ("arrive", "n1", "b", 700, 1.4, 0.25, 8, None, 1))], memory_gb=6.0)


def test_a_shed_is_not_carried_out_once_the_pool_outgrew_what_the_host_reserved():
    """The host reserved the moved layers' share of the pool when the shed was planned; two
    joins grew the pool while the host took the layers, and the move then had the stage mirror
    more than that (`cost.reservations_cover`)."""
    run([(0.0, ("arrive", "n0", "a", 100, 3.0, 0.25, 64, None, 0)),
         (1.0, ("shed", "n0", 1.3)),
         (0.0, ("arrive", "n0", "a", 900, 3.0, 0.25, 64, None, 0)),
         (0.0, ("arrive", "n0", "a", 300, 3.0, 0.25, 64, None, 0))], memory_gb=6.0)


def test_a_lazy_scale_down_waits_until_the_requests_left_can_wait_for_it():
    """Two joins grew the pool (a resize until 1.86 s); the cancel of the third request then
    queued a scale-down behind it that held the instance up until 2.15 s, past a first token
    due at 2.3 s once its prefill runs (`evaluate.may_shrink`)."""
    run([(0.0, ("arrive", "n0", "c", 900, 4.0, 0.3, 64, None, 0)),
         (1.5, ("arrive", "n0", "c", 100, 0.8, 0.1, 64, None, 0)),
         (0.0, ("arrive", "n0", "c", 100, 0.8, 0.1, 64, None, 0)),
         (0.0, ("cancel", 0))], memory_gb=6.0)


def test_a_preemptor_waits_for_its_victims_handover_while_an_adapter_loads_onto_a_victim():
    """The victim had an adapter loading (until 1.57 s): the preemptor's instance was published
    ready then, not after the 2 s handover, and a join due at 1.6 s was admitted to it
    (`readiness.MemopTimeline.handover_ready_at`)."""
    run([(0.0, ("arrive", "n1", "b", 16, 1.0, 0.5, 8, None, 0)),
         (0.0, ("cancel", 0)),
         (0.0, ("arrive", "n1", "b", 16, 1.0, 0.5, 8, None, 1)),
         (0.5, ("preload", "n1", 2, 0)),
         (0.1, ("preempt", "n1", 16, 3.0, 2.0, None)),
         (0.0, ("arrive", "n1", "b", 16, 1.0, 0.5, 8, None, 0))], memory_gb=6.0)


def test_a_victim_runs_only_iterations_that_end_by_its_handover():
    """The victim started a 0.9 s prefill shortly before its handover was due; the handover
    (and the preemptor, which waits for the victim's unload) followed it at 2.98 s, not at
    2.19 s as every validation had it, and a newcomer's 1 s prefill got in first."""
    run([(0.5, ("arrive", "n1", "c", 660, 1.4, 0.12, 60, None, 1)),
         (0.3, ("arrive", "n0", "b", 30, 2.6, 0.2, 47, 2, 0)),
         (0.15, ("arrive", "n0", "b", 650, 2.2, 0.3, 56, None, 3)),
         (0.6, ("cancel", 38)),
         (0.0, ("arrive", "n0", "b", 900, 3.7, 0.4, 33, None, 1)),
         (0.0, ("arrive", "n0", "b", 150, 3.3, 0.25, 57, 2, 0)),
         (0.3, ("preempt", "n0", 170, 4.6, 0.3, 0)),
         (0.4, ("arrive", "n0", "b", 780, 2.8, 0.08, 10, 0, 3))], seed=77)


def test_a_shed_ledger_op_does_not_stop_its_instance():
    """After the layers moved, `set_layout`'s op was priced as a resize of the pool (0.25 s)
    and the instance ran nothing meanwhile: a token due 85 ms after the last came late. Neither
    the module planner nor any admission counted that pause; the engine had moved already."""
    run([(0.2, ("arrive", "n0", "a", 180, 0.3, 0.085, 32, None, 0)),
         (0.75, ("shed", "n0", 0.4))])


def test_a_stop_and_resume_preemption_refused_after_its_trial_leaves_the_victims_alone():
    """The trial saw the preemptor's KV growth start at once; the admission that followed the
    victim's unload saw it parked behind that unload (50 ms) and refused for its TTFT, after
    the victim and its adapter had been unloaded. (`Timeline._preempt` asserts a refusal
    changed nothing.)"""
    run([(0.35, ("arrive", "n1", "a", 160, 1.6, 0.5, 47, 0, 0)),
         (0.0, ("arrive", "n0", "a", 340, 1.7, 0.25, 53, None, 3)),
         (0.56, ("arrive", "n1", "c", 330, 1.6, 0.35, 55, None, 3)),
         (0.07, ("arrive", "n1", "c", 280, 1.05, 0.4, 62, 1, 0)),
         (0.0, ("arrive", "n0", "b", 700, 2.0, 0.2, 27, 2, 2)),
         (0.6, ("cancel", 2)),
         (0.0, ("cancel", 31)),
         (0.6, ("arrive", "n0", "a", 800, 3.2, 0.4, 38, None, 0)),
         (0.0, ("preempt", "n0", 284, 1.4864, None, 0))], memory_gb=6.0)


def test_a_live_preemption_counts_the_victims_iteration_in_flight_into_its_handover():
    """The victim runs a 0.9 s prefill until 1.84 s; a live preemption at 1.1 s with a 0.1 s
    handover had its newcomer ready at 1.25 s (the shadow then starts it when the node is free,
    at 1.84 s), but the handover waits for the victim's iteration and its unload: the first
    token came 50 ms after its deadline."""
    run([(0.0, ("arrive", "n0", "a", 900, 4.0, 0.25, 16, None, 0)),
         (0.0, ("arrive", "n0", "c", 100, 3.0, 0.25, 32, None, 0)),
         (0.0, ("arrive", "n0", "c", 100, 3.0, 0.25, 32, None, 0)),
         (1.1, ("preempt", "n0", 50, 0.8, 0.1, None))])


def test_a_live_preemption_waits_for_a_victim_still_loading():
    """The victim (its request cancelled) still loads until 0.8 s; its unload runs after that
    load, so the newcomer's instance runs at 0.85 s, not at the end of the 0 s handover."""
    run([(0.0, ("arrive", "n1", "c", 100, 3.0, 0.25, 32, None, 0)),
         (0.0, ("arrive", "n1", "c", 100, 3.0, 0.25, 32, None, 0)),
         (0.3, ("arrive", "n1", "a", 100, 3.0, 0.25, 32, None, 3)),
         (0.0, ("cancel", 2)),
         (0.3, ("preempt", "n1", 17, 0.25, 0.0, None))])


def test_a_parked_load_waits_for_the_unload_parked_behind_an_adapters_load():
    """(Shrunk from a timeline by hand.) An instance is unloaded while its adapter still loads:
    the adapter's unload waits behind that load, and a new instance that needs its memory too
    starts loading only after it. The timeline had the new load start once the ops running
    had ended, one unload (50 ms) too early, and published that ready time to later
    admissions (`readiness.memop_timeline`)."""
    sched = node("n", Hardware.CPU, 3.0, PERF, CONFIG)
    first = sched.admit(request("r0", "b"), None, PLAIN, 0.0, ADAPTERS[2])
    iid = first.instance_id
    load, adapter = sorted(first.start_ops, key=lambda op: op.instance_id != iid)
    sched.memop_done(load, 0.5)
    sched.cancel("r0", 0.5)
    _, unload = sched.preempt([iid], 0.5)
    new = sched.admit(request("r1", "c", ttft=4.0), None, WIDE, 0.5)
    assert new.admission.ok and new.start_ops == ()  # parked for memory
    promised = sched.node.instance(new.instance_id).ready_at
    sched.memop_done(unload[0], 0.55)
    loaded = adapter_load_s(ADAPTERS[2].bytes)
    [adapter_unload] = sched.memop_done(adapter, loaded)
    [new_load] = sched.memop_done(adapter_unload, loaded + UNLOAD_S)
    assert promised == pytest.approx(new_load.started_at + PERF.get("c", Hardware.CPU).load_s)


def test_an_idle_instance_is_reclaimed_at_the_time_announced():
    """`next_reclaim_at` said 1.4 s (0.4 + 1.0); there `1.4 - 0.4` is 0.9999999999999999, and
    `reclaim_idle` found nothing expired: a caller woken then was told 1.4 s again."""
    sched = node("n", Hardware.CPU, 12, PERF, CONFIG)
    res = sched.admit(request("r", "b", arrival=0.0), None, PLAIN, 0.0)
    for op in res.start_ops:
        sched.memop_done(op, 0.3)
    sched.cancel("r", 0.4)
    assert sched.next_reclaim_at() == 0.4 + 1.0
    assert [op.kind for op in sched.reclaim_idle(0.4 + 1.0)] == [MemOpKind.UNLOAD]


def test_a_cancel_can_make_another_request_late_by_a_priority_inversion():
    """What the property counts rather than fails (`Timeline.inversion`). The third request
    (its instance ready at 0.7 s, its token due at 1.05 s) was validated with the second
    one's prefill holding the node from 0.5 s until its instance is ready; that request is
    cancelled, the node starts a 0.9 s prefill at 0.5 s instead, and the token comes at 1.42 s.
    The token loop never holds back for an instance about to be ready, nor does the
    validation charge one iteration of blocking to it."""
    world = run([(0.0, ("arrive", "n0", "a", 900, 4.0, 0.25, 16, None, 0)),
                 (0.0, ("arrive", "n0", "c", 300, 1.0, 0.25, 16, None, 0)),
                 (0.2, ("arrive", "n0", "b", 16, 0.35, 0.25, 16, None, 0)),
                 (0.1, ("cancel", 1))])
    assert world.inversions == 1
    assert "r2 on n0: token 1 at 1.4160, due 1.0500, after a priority inversion" in \
        "\n".join(world.log)
