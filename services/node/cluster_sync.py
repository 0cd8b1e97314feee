"""The node's part of the cluster state in Redis: its view (the heartbeat), the profiles it
decides with, the registry's model names, the profiling jobs its hardware kind lacks, and the
online calibration it learns and publishes.

A Redis error costs a beat, never the loop: once Redis answers again (restarted, even empty) the
next beat puts the node back in the cluster view.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from services.node.runtime import NodeRuntime
from shared.cluster import load_perf, publish_node, save_calibration
from shared.core.calibration import DECODE, PREFILL, baseline_s
from shared.core.iteration import IterationKind
from shared.core.node_scheduler import StepPlan
from shared.model_state import profile_joining_kind
from shared.registry import ModelRegistry
from shared.schemas import ModelRecord
from services.node.tiers import model_key

log = logging.getLogger("slinfer.node")
REDIS_TIMEOUT_S = 5.0  # one heartbeat's Redis work; a hung Redis must not hang the heartbeat


class ClusterSync:
    def __init__(self, rt: NodeRuntime, tend: Callable[[], Awaitable[None]],
                 sample: Callable[[], None]) -> None:
        self.rt = rt
        self._tend, self._sample = tend, sample  # the heartbeat's other chores
        # Backbones (models that are not adapters) this node was asked for, by name, while the
        # registry holds them: what pre-loading plans over (services/node/preload.py).
        self.backbones: dict[str, ModelRecord] = {}
        self.published_seen: dict[str, dict[str, float]] = {}  # model -> `seen` as published
        self.joined = False  # queued the profiling jobs this node's hardware kind lacks

    # --- the heartbeat ----------------------------------------------------------------------------
    async def publish_view(self) -> None:
        await publish_node(self.rt.redis, self.rt.view(), ttl_s=self.rt.s.heartbeat_s * 12)

    async def heartbeat(self) -> None:
        """Publish the node's view; pick up new profiles (and the registry's model names) every
        few seconds."""
        last_perf = time.monotonic()
        s = self.rt.s
        while not self.rt.stopping:
            try:
                if time.monotonic() - last_perf > s.profile_refresh_s:
                    await asyncio.wait_for(self.load_profiles(), REDIS_TIMEOUT_S)
                    await asyncio.wait_for(self.read_registry(), REDIS_TIMEOUT_S)
                    if not self.joined:
                        await asyncio.wait_for(self.join_profiling(), REDIS_TIMEOUT_S)
                    last_perf = time.monotonic()
                await asyncio.wait_for(self.publish_view(), REDIS_TIMEOUT_S)
                await self._confirm_calibrations()
                await asyncio.wait_for(self._tend(), REDIS_TIMEOUT_S)
                self.rt.trouble("heartbeat (Redis)", None)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.rt.trouble("heartbeat (Redis)", exc)
            self._sample()
            await asyncio.sleep(s.heartbeat_s)

    # --- profiles, registry, profiling jobs -------------------------------------------------------
    async def load_profiles(self) -> None:
        sched = self.rt.sched
        base = await load_perf(self.rt.redis, calibrate=False)
        perf = await load_perf(self.rt.redis, config=self.rt.calibrator.config)
        if not perf.profiles and sched.perf.profiles:
            # Redis came back empty: decide with the profiles we had until they are restored.
            return
        self.rt.base_perf, sched.perf = base, perf

    async def read_registry(self) -> None:
        """The registry's names of model directories, for the tiers report. A checkpoint the
        local disk tier kept from an earlier run is known by its key only: those keys are
        computed (file metadata) when the disk tier holds such a checkpoint."""
        records = await ModelRegistry(self.rt.redis).list()
        registered = {r.name: r for r in records}
        kept = {n: registered[n] for n in self.backbones if n in registered}
        self.backbones.clear()  # in place: pre-loading holds the same dict
        self.backbones.update(kept)
        loader = self.rt.loader
        stray = False
        if loader is not None:
            paths = {model_key(r.path) for r in records}
            stray = any(model_key(m.model_path) not in paths
                        for t in loader.tiers_report().tiers if t.name == "disk" for m in t.models)
        await asyncio.to_thread(self.rt.model_names.set_registry, records,
                                loader.key_of if stray and loader is not None else None)

    async def join_profiling(self) -> None:
        """This node's hardware kind joins the cluster: the models servable elsewhere with no
        profile of this kind get a profiling job (`shared.model_state.profile_joining_kind`;
        another node of the kind that did it first leaves nothing to do). Retried by the
        heartbeat until it went through once."""
        s = self.rt.s
        try:
            records = await ModelRegistry(self.rt.redis).list()
            queued = await profile_joining_kind(self.rt.js, self.rt.redis, s.hardware, records)
        except Exception as exc:
            log.warning("could not check which models lack a %s profile (%r); retrying",
                        s.hardware, exc)
            return
        self.joined = True
        if queued:
            log.info("node %s: %s has no %s profile yet; profiling queued", s.node_id,
                     ", ".join(queued), s.hardware)

    async def learn_model(self, record: ModelRecord, backbone: bool = True) -> None:
        """Before the core decides on `record`: its profile, its name and its tiers are known
        (`backbone`: an admission of it, which pre-loading then plans over)."""
        sched = self.rt.sched
        if sched.perf.get(record.name, sched.node.hardware) is None:
            # A profile stored after this node last read them (the profiler reports `ready` as
            # soon as it stored it): read them again once before the core may say no_profile.
            await self.load_profiles()
        self.rt.model_names.learn(record)
        if backbone and record.base_model is None:
            self.backbones[record.name] = record
        self.rt.refresh_storage()

    # --- online calibration -----------------------------------------------------------------------
    def base_prediction(self, plan: StepPlan, model: str) -> float:
        """What the measured profile, uncorrected, says this iteration takes (calibration input)."""
        sched = self.rt.sched
        profile = self.rt.base_perf.get(model, sched.node.hardware)
        inst = sched.node.instance(plan.iteration.instance_id)
        if profile is None or inst is None:
            return 0.0
        # With the layout's hops and the host's contention, as the core decides (issue 22 #10).
        return baseline_s(plan.iteration, inst, profile, sched.node.stage_load)

    def note_prediction(self, plan: StepPlan, elapsed: float) -> None:
        """The iteration's actual time against its prediction, on its requests' spans (before
        the token that may end them)."""
        if plan.predicted_s > 0:
            self.rt.obs.prediction_on_spans(_kind(plan), plan.iteration.request_ids,
                                            plan.predicted_s, elapsed)

    def calibrate(self, model: str, plan: StepPlan, base_s: float, elapsed: float) -> None:
        """Online calibration: every iteration's actual time against the prediction the node
        decided with is exported; a drifting model's profile is corrected and published."""
        kind = _kind(plan)
        if plan.predicted_s > 0:
            self.rt.obs.prediction(model, kind, plan.predicted_s, elapsed)
        if self.rt.calibrator.observe(model, kind, base_s, elapsed, time.time()) and \
                self.rt.s.calibrate:
            self.rt.spawn(self.publish_calibration(model), f"calibrate-{model}")

    async def _confirm_calibrations(self) -> None:
        """Republish a correction whose model ran since it was last published, with when: the
        placers hold a confirmed correction and fade one that nothing has run to confirm (see
        shared.core.calibration). One write per corrected, running model per beat."""
        if not self.rt.s.calibrate:
            return
        calibrator = self.rt.calibrator
        for model in calibrator.models():
            if calibrator.corrected(model) and \
                    calibrator.seen(model) != self.published_seen.get(model):
                await asyncio.wait_for(self.publish_calibration(model, quiet=True), REDIS_TIMEOUT_S)

    async def publish_calibration(self, model: str, quiet: bool = False) -> None:
        s, calibrator = self.rt.s, self.rt.calibrator
        factors, seen = calibrator.factors(model), calibrator.seen(model)
        if not quiet:
            log.info("calibrated %s on %s: prefill x%.3f, decode x%.3f", model, s.node_id,
                     factors[PREFILL], factors[DECODE])
        try:
            await save_calibration(self.rt.redis, s.node_id, model, s.hardware, factors, seen)
            self.published_seen[model] = seen
            if not quiet:  # a new factor: decide with it at once (a confirmation changes nothing)
                await self.load_profiles()
        except Exception:  # a Redis blip: the next correction publishes again
            log.exception("publishing the calibration of %s failed", model)


def _kind(plan: StepPlan) -> str:
    return PREFILL if plan.iteration.kind is IterationKind.PREFILL else DECODE
