"""Knobs of the policy core, validated once where they are built."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CoreConfig:
    watermark: float = 0.25  # w of §VII-B: scale up to M_require*(1+w), down below M_rec*(1+w)
    overestimate: float = 0.10  # shadow validation inflates every predicted iteration (§VI-C)
    keep_alive_s: float = 1.0  # idle instances are reclaimed after this (§IX-A)
    enable_cpu: bool = True  # ablation "--no-cpu"
    enable_sharing: bool = True  # ablation "--no-sharing": one instance per node
    enable_consolidation: bool = True  # ablation "--no-consolidation": no preemption
    require_matrix_accel: bool = True  # CPUs without AMX-like units are never used (§V)
    shadow_max_steps: int = 1024  # bound on simulated iterations per shadow validation
    # ...and on those it simulates before the newcomer's instance can first run (a cold start
    # or a KV resize): the node's other instances go on meanwhile, one cheap iteration each
    # (about 1.5 us on the dev box), and a 4 s load beside a 3 ms decode is 1,200 of them.
    shadow_max_wait_steps: int = 16384
    # New instances by bin-packing (§V) after the startup check; False: the node that can start
    # it soonest (what slinfer did before; kept as an ablation to show what packing saves).
    pack_new_instances: bool = True
    # λScale locality-driven startup (shared/core/startup.py): a new instance may receive its
    # model by multicast from nodes holding it in DRAM when that is quicker than its own tiers.
    enable_multicast: bool = True
    # Ablation / benchmark: multicast to every new instance that has a holder to receive from,
    # whatever the estimate says (bench/scaleout.py measures both ways on the node workers).
    force_multicast: bool = False
    multicast_blocks: int = 16  # blocks a multicast cuts the model into (λScale §7.6)
    # The control round trips before the first byte (offer, prepare, plan, go over NATS):
    # 0.01-0.04 s measured on loopback (bench/scaleout.py --measure, prepare_s).
    multicast_setup_s: float = 0.05
    multicast_step_latency_s: float = 0.0  # per pipeline step beyond the block's bytes
    # λScale execute-while-load (§4.3, shared/core/startup.py): a new instance receiving its
    # model by multicast may serve through an execution pipeline (its node runs the head and
    # the layers it holds, a node holding the model runs the rest) until its copy is whole.
    # Off in the pure core; the services turn it on (SLINFER_ENABLE_PIPELINE), their node workers
    # carry it out. The simulator takes the services' default, but its nodes report no multicast
    # link (it times λScale's multicasts and pipelines itself, sim/scaleout.py).
    enable_pipeline: bool = False
    # ...and the receivers of one multicast host layers for each other (λScale Algorithm 2,
    # `shared.core.pipeline.receiver_plan`), besides a DRAM holder's stage; the node workers
    # carry it out (services/node/pipeline_mode.py), the services read SLINFER_RECEIVER_PIPELINES.
    enable_receiver_pipelines: bool = False
    # Starting the helper's stage and attaching the head's engine to it (both from tensors
    # already in memory: no read), and one activation transfer's fixed cost (framing, a round
    # trip; bench/modules.py measured ~1 ms a hop on loopback, compute of a tiny stage included).
    # The setup measured 0.03-0.06 s for the stage and as much for the head's engine on CPU
    # nodes (bench/scaleout.py --ewl, small and 1B); 0.5 s leaves room for a GPU node, whose
    # stage also copies its layers to device memory (not measured).
    pipeline_setup_s: float = 0.5
    pipeline_hop_latency_s: float = 0.002
    # Preemption by live migration (ServerlessLLM §5): the victims' requests move while they keep
    # decoding and the newcomer waits for the handover; False: stop-and-resume (the victims are
    # unloaded at once, their requests recompute elsewhere). The services default to live
    # (SLINFER_LIVE_PREEMPTION), and so does the simulator (sim/simulate.py builds the services'
    # defaults and carries live plans out: sim/slinfer_system.py).
    live_preemption: bool = False
    # Burst scale-out (shared/core/burst.py, λScale §7.5): a placement that starts an instance
    # of a model whose recent arrivals outgrow it starts the instances they need at once, on
    # distinct nodes, so one multicast feeds them all. Off by default: SLINFER's §IX runs add one
    # instance per placement; the λScale simulator runs turn it on.
    burst_scaleout: bool = False
    burst_window_s: float = 1.0  # arrivals in this window set the model's recent rate
    burst_max: int = 8  # instances one burst starts at most (the one for the request included)
    # Only instances that can start within this burst together (λScale's regime: multicast or a
    # local copy); slower starts gain nothing from starting at once and share the slow tier.
    burst_max_startup_s: float = 3.0
    # CoCoServe host compute: an instance's busy fraction (its node's iterations) and a hosted
    # stage's (its host's forwards) are measured over this time constant (`busy.BusyMeter`).
    busy_window_s: float = 10.0
    # Chunked prefill (Sarathi-Serve) as a decision of the headroom scheduler
    # (`iteration.plan_chunk`): > 0 turns it on, and a prefill then runs in chunks sized to the
    # decode slack of every other request on the node, none shorter than this many tokens but
    # its last; 0: whole prefills (SLINFER's §VI-A).
    prefill_chunk_tokens: int = 0
    # Predictive pre-warming (`shared.core.prewarm`, Shahrad et al. ATC'20): the placer (or the
    # simulator) keeps each model's idle-time histogram, starts an instance shortly before its
    # predicted next call where a node has room to spare, and keeps instances alive for the
    # policy's window instead of `keep_alive_s`. Off: the fixed keep-alive only (SLINFER §IX-A).
    prewarm: bool = False

    def __post_init__(self) -> None:
        if not self.busy_window_s > 0:
            raise ValueError(f"busy_window_s must be > 0, got {self.busy_window_s}")
        if self.watermark < 0:
            raise ValueError(f"watermark must be >= 0, got {self.watermark}")
        if self.overestimate < 0:
            raise ValueError(f"overestimate must be >= 0, got {self.overestimate}")
        if self.keep_alive_s < 0:
            raise ValueError(f"keep_alive_s must be >= 0, got {self.keep_alive_s}")
        if self.multicast_blocks < 1 or self.multicast_setup_s < 0 \
                or self.multicast_step_latency_s < 0 or self.pipeline_setup_s < 0 \
                or self.pipeline_hop_latency_s < 0:
            raise ValueError("multicast_blocks must be >= 1 and its latencies >= 0")
        if not self.burst_window_s > 0 or self.burst_max < 1 or self.burst_max_startup_s < 0:
            raise ValueError("burst_window_s must be > 0, burst_max >= 1, "
                             "burst_max_startup_s >= 0")
        if self.prefill_chunk_tokens < 0:
            raise ValueError("prefill_chunk_tokens must be >= 0")
        if self.shadow_max_steps < 1 or self.shadow_max_wait_steps < 1:
            raise ValueError("shadow_max_steps and shadow_max_wait_steps must be >= 1")
