"""Scale-out of one model to k nodes at once (λScale §4): the multicast against every node
reading the checkpoint from storage, two ways.

**Modelled** (the default): the plan the node workers carry out (`shared.core.multicast`) timed
as block bytes over a datacenter link plus a per-step latency, against every node reading from
NVMe or a shared registry link (no network on this box).

    .venv/bin/python bench/scaleout.py [--out bench/results/scaleout_sim.json]

Figures: time until all k nodes hold the model (multicast vs storage), and time until the first
execution pipeline holds a full model across its nodes (execute-while-load can serve then).

**Measured** (`--measure SHAPES`): real multicast endpoints (`python -m services.node.multicast`,
one process per node: a source n0 and destinations n1..nk) on this machine, a real nats-server
for the control, TCP on loopback for the blocks. For each k:

* multicast: the source holds the model in its DRAM tier; time from the coordinator's call to
  the moment the last destination holds every block, checked, in its DRAM tier (offer, prepare
  and plan round trips included; `prepare_s` is that part);
* storage: every destination loads the model through its loader from the converted checkpoint
  at the same time (the `load` op: `CheckpointLoader.load`, chunked parallel O_DIRECT reads into
  pool buffers, as the torch engine loads), the page cache of every partition file dropped
  before each run (`posix_fadvise(POSIX_FADV_DONTNEED)` after an fdatasync, then mincore: the
  largest resident fraction left is recorded); and one destination alone (what each node would
  take if every node had its own disk of this one's speed).

Before each run the destinations drop the model from their DRAM tier (their pool keeps the freed
buffers, so both methods write into memory faulted in before); one untimed run of each method
comes first. Runs alternate between the methods; the median of `--repeats` is reported.

    flock -x /tmp/slinfer-cpu.lock .venv/bin/python bench/scaleout.py --measure small,llama-3.2-1b

Results: bench/results/scaleout_measured_<shape>.json. Loopback on 2 shared cores is not a
datacenter network: every byte a destination receives costs the machine's CPUs a kernel copy and
a CRC pass, so the k links of a step do not run in parallel here as they would on k NICs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.core.multicast import (binomial_schedule, execution_pipelines, kway_orders,  # noqa: E402
                                   steps_of, subgroups)

GB = 1e9
MODELS = {"7b": 13.48 * GB, "13b": 26.03 * GB}  # 16-bit weights (sim/profiles.py shapes)
LINKS_GBPS = (100, 400)
STEP_LATENCY_S = 50e-6  # one RDMA round trip and block bookkeeping per step (ASSUMPTION)
NVME_BYTES_PER_S = 5 * GB  # every node reading its own local copy in parallel (λScale's SSDs)
REGISTRY_BYTES_PER_S = 1.25 * GB  # one 10 Gb/s link out of the registry, shared by all readers


def rss_mb(pid: int) -> int | None:
    """A process's resident memory now (MB), None if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    except OSError:
        return None
    return None


def stop_processes(procs: list, logs: list, wait_s: float) -> None:
    """Terminate the node processes, kill those still up after `wait_s`, close their logs."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(wait_s)
        except Exception:
            proc.kill()
    for log in logs:
        log.close()


def first_pipeline_steps(n: int, k: int, blocks: int) -> int:
    """Steps until some execution pipeline's nodes hold every block between them (one source
    per sub-group, k-way orders): the earliest step after which a request can be served."""
    groups = subgroups(n, k)
    orders = kway_orders(blocks, k)
    held: dict[int, dict[int, int]] = {}  # node -> block -> step it arrived
    for group, order in zip(groups, orders):
        for t in binomial_schedule(len(group), order):
            held.setdefault(group[t.dst], {})[t.block] = t.step
    best = None
    for pipe in execution_pipelines(groups):
        arrival = {}
        for node in pipe:
            for block, step in held.get(node, {}).items():
                arrival[block] = min(arrival.get(block, step), step)
        if len(arrival) == blocks:
            done = max(arrival.values()) + 1
            best = done if best is None else min(best, done)
    return best if best is not None else steps_of([t for g, o in zip(groups, orders)
                                                   for t in binomial_schedule(len(g), o)])


def row(model: str, n_dest: int, gbps: float, blocks: int) -> dict:
    size = MODELS[model]
    link = gbps * GB / 8
    step_s = size / blocks / link + STEP_LATENCY_S
    n = n_dest + 1  # the source holds the model
    steps = steps_of(binomial_schedule(n, list(range(blocks))))
    two_src = first_pipeline_steps(n_dest + 2, 2, blocks) if n_dest >= 2 else None
    return {"model": model, "destinations": n_dest, "link_gbps": gbps, "blocks": blocks,
            "multicast_steps": steps, "multicast_s": round(steps * step_s, 3),
            "first_pipeline_s_2_sources": round(two_src * step_s, 3) if two_src else None,
            "nvme_each_s": round(size / NVME_BYTES_PER_S, 3),
            "registry_shared_s": round(n_dest * size / REGISTRY_BYTES_PER_S, 3)}


def modelled(args, argv: list[str] | None) -> int:
    rows = [row(m, k, g, args.blocks) for m in MODELS for k in (2, 4, 8) for g in LINKS_GBPS]
    result = {"command": "python bench/scaleout.py " + " ".join(argv or sys.argv[1:]),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores (a model, no network used)",
              "date": time.strftime("%Y-%m-%d"), "step_latency_s": STEP_LATENCY_S,
              "nvme_bytes_per_s": NVME_BYTES_PER_S, "registry_bytes_per_s": REGISTRY_BYTES_PER_S,
              "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for r in rows:
        print(r)
    return 0


# -- measured: real endpoints on this machine -----------------------------------------------------

SHAPE_KS = {"small": (2, 4, 8), "llama-3.2-1b": (2, 4, 8)}
MEMORY_MARGIN = 4 << 30  # left free for the other processes sharing this machine
PROCESS_OVERHEAD = 400 << 20  # an endpoint process besides its model copy (230 MB idle RSS measured)


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "")
    mem = Path("/proc/meminfo").read_text().splitlines()[0]
    return {"cpu": cpu, "cores": os.cpu_count(), "memory": mem, "platform": platform.platform(),
            "python": platform.python_version(), "load_average_before": os.getloadavg()}


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def checkpoint_for(shape: str) -> Path:
    """The shape's converted checkpoint: the model directory's own when it has one, else a
    conversion private to this benchmark (other users of .data/models see no new directory)."""
    from services.node.loader import convert_checkpoint, default_checkpoint_dir, read_index
    from services.node.loader.checkpoint_format import source_fingerprint
    from shared.modelgen import ensure_model

    model_dir = ensure_model(ROOT / ".data", shape, shape)
    own = default_checkpoint_dir(model_dir)
    index = read_index(own)
    if index is not None and index.fingerprint == source_fingerprint(model_dir):
        return own
    return convert_checkpoint(model_dir, ROOT / ".data" / "bench-scaleout" / f"{shape}-checkpoint"
                              ).path


def median(xs: list[float]) -> float:
    return round(statistics.median(xs), 4)


async def measure_shape(shape: str, ks: list[int], repeats: int, blocks: int) -> dict:
    from services.node.loader import read_index
    from services.node.loader.direct_io import drop_page_cache, resident_bytes
    from services.placer.multicast import multicast
    from shared.bus import connect_nats
    from shared.servers import popen_tied, start_nats
    from shared.subjects import multicast_node_subject

    ckpt = checkpoint_for(shape)
    index = read_index(ckpt)
    size = index.file_bytes
    files = [ckpt / p.file for p in index.partitions]
    fits = [k for k in ks if (k + 1) * (size + PROCESS_OVERHEAD) + MEMORY_MARGIN
            <= available_bytes()]
    skipped = {k: f"{k + 1} endpoints x ({size / 1e9:.2f} GB + "
                  f"{PROCESS_OVERHEAD / 1e9:.1f} GB) + {MEMORY_MARGIN / 1e9:.0f} GB margin > "
                  f"{available_bytes() / 1e9:.1f} GB available" for k in ks if k not in fits}
    result = {"shape": shape, "checkpoint": str(ckpt.relative_to(ROOT)), "model_bytes": size,
              "partitions": len(index.partitions), "tensors": len(index.tensors),
              "repeats": repeats, "skipped_k": skipped, "rows": []}
    if not fits:
        return result
    kmax = max(fits)
    names = [f"n{i}" for i in range(kmax + 1)]
    tmp = Path(tempfile.mkdtemp(prefix="scaleout-"))
    server = start_nats(tmp / "nats")
    procs = []
    logs = [open(tmp / f"{n}.log", "wb") for n in names]
    try:
        for name, log in zip(names, logs):
            procs.append(popen_tied([sys.executable, "-m", "services.node.multicast",
                                     "--node-id", name, "--nats", server.url,
                                     "--dram-cache-bytes", str(2 * size + (1 << 30))],
                                    cwd=ROOT, stdout=log, stderr=log))
        nc = await connect_nats(server.url, "bench-scaleout")

        async def ask(node: str, body: dict, timeout: float = 600.0) -> dict:
            msg = await nc.request(multicast_node_subject(node), json.dumps(body).encode(),
                                   timeout=timeout)
            reply = json.loads(msg.data)
            if not reply.get("ok"):
                raise RuntimeError(f"{node}: {reply.get('error')}")
            return reply

        deadline = time.monotonic() + 180
        for name in names:
            while True:
                try:
                    await ask(name, {"op": "ping"}, timeout=1.0)
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.2)
        model = str(ckpt)
        t0 = time.perf_counter()
        first = await ask("n0", {"op": "load", "model_path": model})
        result["source_first_load_s"] = round(time.perf_counter() - t0, 4)
        result["source_first_load_tier"] = first["tier"]

        async def drop(dests: list[str]) -> None:
            await asyncio.gather(*(ask(d, {"op": "drop", "model_path": model}) for d in dests))

        async def run_multicast(dests: list[str]) -> dict:
            await drop(dests)
            report = await multicast(nc, model, "n0", dests, blocks=blocks, timeout_s=900)
            if not report.ok:
                raise RuntimeError(f"multicast failed: {report.failed}")
            done = [d.seconds for d in report.destinations]
            arrivals = [t for d in report.destinations for t in d.block_seconds.values()]
            return {"seconds": report.seconds, "prepare_s": report.prepare_seconds,
                    "first_done_s": min(done), "first_block_s": min(arrivals),
                    "steps": report.planned_steps, "blocks": report.blocks,
                    "registered": all(d.registered for d in report.destinations)}

        async def run_storage(dests: list[str]) -> dict:
            await drop(dests)
            for f in files:
                drop_page_cache(f)
            resident = max(resident_bytes(f) / f.stat().st_size for f in files)
            t0 = time.perf_counter()
            loads = await asyncio.gather(*(ask(d, {"op": "load", "model_path": model})
                                           for d in dests))
            seconds = time.perf_counter() - t0
            if any(x["tier"] != "registry" for x in loads):
                raise RuntimeError(f"a storage load was served from {[x['tier'] for x in loads]}")
            return {"seconds": seconds, "resident_after_drop": resident,
                    "direct": all(x["direct"] for x in loads),
                    "loader_s": [round(x["seconds"], 4) for x in loads]}

        # Untimed: the first offer checksums the source's copy (reported), and both methods
        # fault in the destinations' pool buffers once.
        t0 = time.perf_counter()
        warm = await multicast(nc, model, "n0", names[1:], blocks=blocks, timeout_s=900)
        result["first_multicast_s"] = round(time.perf_counter() - t0, 4)
        result["first_offer_s_incl_checksum"] = round(warm.prepare_seconds, 4)
        await run_storage(names[1:])
        for k in sorted(fits):
            dests = names[1:k + 1]
            mc, st, one = [], [], []
            for _ in range(repeats):
                mc.append(await run_multicast(dests))
                st.append(await run_storage(dests))
                one.append(await run_storage(dests[:1]))
            row = {
                "k": k,
                "multicast_s": median([r["seconds"] for r in mc]),
                "multicast_all_s": [round(r["seconds"], 4) for r in mc],
                "multicast_prepare_s": median([r["prepare_s"] for r in mc]),
                "multicast_first_block_s": median([r["first_block_s"] for r in mc]),
                "multicast_first_node_done_s": median([r["first_done_s"] for r in mc]),
                "multicast_steps": mc[0]["steps"], "blocks": mc[0]["blocks"],
                "multicast_delivered_bytes_per_s": round(
                    k * size / statistics.median(r["seconds"] - r["prepare_s"] for r in mc)),
                "registered_in_dram_tier": all(r["registered"] for r in mc),
                "storage_concurrent_s": median([r["seconds"] for r in st]),
                "storage_concurrent_all_s": [round(r["seconds"], 4) for r in st],
                "storage_one_reader_s": median([r["seconds"] for r in one]),
                "storage_direct_io": all(r["direct"] for r in st + one),
                "page_cache_resident_after_drop": max(r["resident_after_drop"]
                                                      for r in st + one),
            }
            row["storage_over_multicast"] = round(row["storage_concurrent_s"]
                                                  / row["multicast_s"], 3)
            print(json.dumps(row), flush=True)
            result["rows"].append(row)
        await nc.close()
    finally:
        stop_processes(procs, logs, 15)
        server.stop()
    result["load_average_after"] = os.getloadavg()
    return result


# -- served: the burst through real node workers and the placer ---------------------------------

SERVE_CONTEXT = 256  # the record's context: one request of the burst needs over half of it
SERVE_PROMPT, SERVE_MAX_TOKENS = 150, 8
SERVE_PROCESS_BYTES = 700 << 20  # a node worker process besides its model (torch, engine, KV)


def served_model_dir(shape: str) -> Path:
    """A model directory whose loading-optimized checkpoint is where the node's loader looks
    (its own `slinfer-checkpoint/`): the shape's directory when it has one, else a private
    copy (links to its files) converted once."""
    from services.node.loader import convert_checkpoint, default_checkpoint_dir, read_index
    from services.node.loader.checkpoint_format import source_fingerprint
    from shared.modelgen import ensure_model

    model_dir = ensure_model(ROOT / ".data", shape, shape)
    index = read_index(default_checkpoint_dir(model_dir))
    if index is not None and index.fingerprint == source_fingerprint(model_dir):
        return model_dir
    copy = ROOT / ".data" / "bench-scaleout" / f"{shape}-model"
    copy.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file() and not (copy / f.name).exists():
            os.symlink(f.resolve(), copy / f.name)
    convert_checkpoint(copy)
    return copy


def stand_in_profile(name: str, one_request: bool = False):
    """Placement needs a profile of the model; the iteration estimates do not matter here (the
    burst's SLOs are loose) and the startup estimate is bypassed (each method is forced).
    `one_request`: a batch of two decodes past the burst's 5 s TPOT SLO, so an instance takes
    one request whatever room its node has."""
    from shared.core.perf_model import DecodeTable, PrefillTable, Profile
    from shared.core.types import Hardware

    decode = DecodeTable([1, 2, 256], [1, 8192], [[0.01, 0.01], [10.0, 10.0], [10.0, 10.0]]) \
        if one_request else DecodeTable([1, 256], [1, 8192], [[0.01, 0.01], [0.01, 0.01]])
    return Profile(name, Hardware.CPU, PrefillTable([1, 8192], [0.05, 0.05]), decode,
                   load_s=60.0, engine_init_s=0.05)


async def serve_shape(shape: str, ks: list[int], repeats: int,
                      methods: tuple[str, ...] = ("multicast", "storage"),
                      link_bytes_per_s: float | None = None, sources: int = 1) -> dict:
    """The burst of k requests through node workers (one process each) and a placer: k + 1
    nodes, node n0 a memory node holding the model in its DRAM tier (no room for an instance),
    n1..nk with room for one instance holding one request each. Per run, one method forced on
    the placer: multicast from n0, or every node loading from the registry (page cache
    dropped), or (`pipeline`) multicast with execute-while-load: n0 then has room for one
    stage of the model's layers, so one new instance of the burst can serve through a pipeline
    with n0 while its copy arrives (λScale §4.3). `link_bytes_per_s`: every node paces its
    sending connections to it and declares it as its link (None: loopback, unpaced).
    `sources`: that many memory nodes (n0, n1, ...) hold the model (a k-way multicast); with
    `receivers` (execute-while-load with receivers hosting layers for each other, λScale
    Algorithm 2) they have no room for a stage, each destination has room for the K/V of a
    context besides its instance (what hosting for another receiver holds, at most), and the
    profile keeps an instance to one request (`stand_in_profile`'s `one_request`)."""
    import dataclasses

    from services.node.loader import read_index
    from shared.cluster import model_spec as cluster_spec
    from services.node.loader.direct_io import drop_page_cache
    from services.placer.placer import Placer
    from services.placer.settings import PlacerSettings
    from shared import wire
    from shared.bus import connect_nats, ensure_streams
    from shared.redis_client import open_redis
    from shared.cluster import read_nodes, save_profile
    from shared.core.config import CoreConfig
    from shared.core.cost import stage_bytes
    from shared.core.types import InstanceStatus
    from shared.registry import ModelRegistry, model_record_from_dir
    from shared.schemas import InferenceRequest, TokenMessage
    from shared.servers import popen_tied, start_nats, start_redis
    from shared.subjects import REQUEST_SUBJECT, multicast_node_subject, token_subject

    model_dir = served_model_dir(shape)
    record = dataclasses.replace(model_record_from_dir(shape, model_dir),
                                 max_context=SERVE_CONTEXT)
    index = read_index(model_dir / "slinfer-checkpoint")
    files = [model_dir / "slinfer-checkpoint" / p.file for p in index.partitions]
    size = index.file_bytes
    per_node = size + SERVE_PROCESS_BYTES
    fits = [k for k in ks if (k + sources) * per_node + MEMORY_MARGIN <= available_bytes()]
    result = {"shape": shape, "model_bytes": size, "repeats": repeats, "sources": sources,
              "skipped_k": {k: f"{k + sources} node workers x {per_node / 1e9:.2f} GB + "
                               f"{MEMORY_MARGIN / 1e9:.0f} GB margin > "
                               f"{available_bytes() / 1e9:.1f} GB available"
                            for k in ks if k not in fits},
              "profile": "stand-in (placement only; startup method forced per run)",
              "methods": list(methods), "link_bytes_per_s": link_bytes_per_s,
              "rows": []}
    if not fits:
        return result
    names = [f"n{i}" for i in range(max(fits) + sources)]
    holders, receivers = names[:sources], names[sources:]
    tmp = Path(tempfile.mkdtemp(prefix="scaleout-serve-"))
    servers = [start_nats(tmp / "nats"), start_redis(tmp / "redis")]
    nats_url, redis_url = servers[0].url, servers[1].url
    procs, logs = [], []
    nc = await connect_nats(nats_url, "bench-scaleout")
    redis = open_redis(redis_url)
    loop = {"stop": asyncio.Event(), "runner": None}  # the placer's run loop
    try:
        await ensure_streams(nc.jetstream())
        await ModelRegistry(redis).register(record)
        await save_profile(redis, stand_in_profile(record.name, "receivers" in methods))
        one_instance = record.weight_bytes + 300 * record.kv_bytes_per_token
        if "receivers" in methods:  # room to host the K/V of every layer for another receiver
            one_instance += SERVE_CONTEXT * record.kv_bytes_per_token
        # The memory node: no room for an instance; with the pipeline method, room for one stage.
        holder = record.weight_bytes // 2
        if "pipeline" in methods:
            holder = stage_bytes(cluster_spec(record)) + (4 << 20)
            if holder >= record.weight_bytes:
                raise RuntimeError("a stage of this model is as large as an instance")
        link_env = {} if link_bytes_per_s is None else {
            "SLINFER_MULTICAST_RATE_BYTES_PER_S": str(link_bytes_per_s),
            "SLINFER_MULTICAST_LINK_BYTES_PER_S": str(link_bytes_per_s)}
        for name in names:
            env = {**os.environ, "SLINFER_NATS_URL": nats_url, "SLINFER_REDIS_URL": redis_url,
                   "SLINFER_NODE_ID": name, "SLINFER_NODE_HARDWARE": "cpu",
                   "SLINFER_NODE_MEMORY_BYTES": str(holder if name in holders else one_instance),
                   **link_env,
                   "SLINFER_NODE_DRAM_CACHE_BYTES": str(size + (256 << 20)),
                   "SLINFER_NODE_DISK_CACHE_BYTES": "0", "SLINFER_DATA_DIR": str(tmp),
                   "SLINFER_REQUIRE_MATRIX_ACCEL": "false", "SLINFER_KEEP_ALIVE_S": "1",
                   "SLINFER_HEARTBEAT_S": "0.1", "SLINFER_CALIBRATION": "false",
                   # No pre-loading (ServerlessLoRA): it would put the model back into the DRAM
                   # tiers the runs empty, and the next burst would load from there.
                   "SLINFER_PRELOAD_INTERVAL_S": "0",
                   "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none",
                   "SLINFER_MULTICAST_HOST": "127.0.0.1", "SLINFER_MULTICAST_PORT": "0"}
            log = open(tmp / f"{name}.log", "wb")
            logs.append(log)
            procs.append(popen_tied([sys.executable, "-m", "services.node"], env=env, cwd=ROOT,
                                    stdout=log, stderr=log))

        async def views() -> dict:
            return {n.node_id: n for n in await read_nodes(redis)}

        async def wait(condition, what: str, timeout: float = 300.0) -> None:
            deadline = time.monotonic() + timeout
            while not await condition():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"timed out waiting for {what}")
                await asyncio.sleep(0.05)

        async def all_up() -> bool:
            return set(names) <= set(await views())

        await wait(all_up, "the node workers", 600)
        print(f"{len(names)} node workers up", flush=True)

        async def ask(node: str, body: dict, timeout: float = 600.0) -> dict:
            msg = await nc.request(multicast_node_subject(node), json.dumps(body).encode(),
                                   timeout=timeout)
            reply = json.loads(msg.data)
            if not reply.get("ok"):
                raise RuntimeError(f"{node}: {reply.get('error')}")
            return reply

        for h in holders:  # the holders' DRAM tiers
            await ask(h, {"op": "load", "model_path": record.path})
        placer = Placer(PlacerSettings(nats_url, redis_url,
                                       CoreConfig(require_matrix_accel=False)), nc, redis)
        await placer.start()
        loop["runner"] = asyncio.create_task(placer.run(loop["stop"]))

        async def pause_placer() -> None:
            loop["stop"].set()
            await loop["runner"]
            loop["stop"], loop["runner"] = asyncio.Event(), None

        def resume_placer() -> None:
            loop["runner"] = asyncio.create_task(placer.run(loop["stop"]))

        async def burst(dests: list[str], method: str) -> dict:
            by_multicast = method in ("multicast", "pipeline", "receivers")
            placer.s = dataclasses.replace(placer.s, core=CoreConfig(
                require_matrix_accel=False,  # as the nodes run (SLINFER_REQUIRE_MATRIX_ACCEL)
                enable_multicast=by_multicast, force_multicast=by_multicast,
                enable_pipeline=method in ("pipeline", "receivers"),
                enable_receiver_pipelines=method == "receivers"))

            async def unloaded() -> bool:
                v = await views()
                return all(d in v and not v[d].instances and not v[d].storage.arriving
                           for d in receivers)

            async def dropped() -> bool:
                v = await views()
                return all(d in v and v[d].storage.holds.get(record.name) != "dram"
                           for d in receivers) \
                    and all(h in v and v[h].storage.holds.get(record.name) == "dram"
                            for h in holders)

            await wait(unloaded, "the last burst's instances unloaded (keep-alive)")
            await asyncio.gather(*(ask(d, {"op": "drop", "model_path": record.path})
                                   for d in receivers))
            await wait(dropped, "the destinations' DRAM tiers without the model")
            print(f"burst {method} k={len(dests)}", flush=True)
            for f in files:
                drop_page_cache(f)
            reports_before = len(placer.multicast_reports)
            log_from = {n: (tmp / f"{n}.log").stat().st_size for n in names}
            first: dict[str, float] = {}
            finals: dict[str, TokenMessage] = {}
            ready: dict[str, float] = {}
            t0 = time.time()

            def on_token(rid):
                async def cb(msg):
                    m = wire.decode(TokenMessage, msg.data)
                    if m.token_ids and rid not in first:
                        first[rid] = time.time() - t0
                    if m.finished:
                        finals[rid] = m
                return cb

            # The burst arrives at once: the placer sees all of it in one turn.
            await pause_placer()
            rids = [f"burst-{method}-{len(dests)}-{uuid_hex()}" for _ in dests]
            for rid in rids:
                await nc.subscribe(token_subject(rid), cb=on_token(rid))
            for rid in rids:
                req = InferenceRequest(rid, "bench", record.name,
                                       [5 + i for i in range(SERVE_PROMPT)], SERVE_MAX_TOKENS,
                                       t0, 600.0, 5.0, temperature=0.0)
                await nc.jetstream().publish(REQUEST_SUBJECT, wire.encode(req),
                                             headers={"Nats-Msg-Id": rid})
            resume_placer()
            deadline = time.monotonic() + 900
            while len(finals) < len(rids):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"burst {method} k={len(dests)}: {len(finals)} finished")
                for d, v in (await views()).items():
                    if d in dests and d not in ready and any(
                            i.model.name == record.name and i.status is InstanceStatus.READY
                            for i in v.instances):
                        ready[d] = time.time() - t0
                await asyncio.sleep(0.02)
            errors = [f.error for f in finals.values() if f.error]
            if errors:
                raise RuntimeError(f"burst {method} k={len(dests)}: {errors}")
            served_on = sorted(f.node_id for f in finals.values())
            if method != "storage":  # through a pipeline the requests may end before the copy
                deadline = time.monotonic() + 300
                while len(placer.multicast_reports) == reports_before \
                        and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
            reports = list(placer.multicast_reports)[reports_before:]
            if method != "storage" and (len(reports) != 1 or not reports[0].ok):
                raise RuntimeError(f"expected one multicast: {[r.to_dict() for r in reports]}")
            if method == "storage" and reports:
                raise RuntimeError("a storage run multicast")
            piped = method in ("pipeline", "receivers")
            timings = await pipeline_timings(tmp, log_from) if piped else []
            return {"ready_s": [round(ready.get(d, float("nan")), 4) for d in dests],
                    "ttft_min_s": round(min(first[r] for r in rids), 4),
                    "all_ready_s": max(ready.values()) if len(ready) == len(dests) else None,
                    "ttft_s": [round(first[r], 4) for r in rids],
                    "served_on": served_on,
                    "multicast_s": reports[0].seconds if reports else None,
                    "rss_mb": {n: rss_mb(p.pid) for n, p in zip(names, procs)},
                    **({"pipeline_timings": timings} if piped else {})}

        # One untimed burst each way (first-use costs: pool buffers, code paths).
        for method in methods:
            await burst(receivers[:1], method)
        for k in sorted(fits):
            dests = receivers[:k]
            runs = {method: [] for method in methods}
            for _ in range(repeats):
                for method in methods:
                    runs[method].append(await burst(dests, method))
            row = {"k": k}
            for method, rs in runs.items():
                if any(r["all_ready_s"] is None for r in rs):
                    raise RuntimeError(f"k={k} {method}: a node's READY was not seen: {rs}")
                row[f"{method}_all_ready_s"] = median([r["all_ready_s"] for r in rs])
                row[f"{method}_ttft_max_s"] = median([max(r["ttft_s"]) for r in rs])
                row[f"{method}_ttft_median_s"] = median([statistics.median(r["ttft_s"])
                                                         for r in rs])
                row[f"{method}_ttft_min_s"] = median([r["ttft_min_s"] for r in rs])
                row[f"{method}_runs"] = rs
            if "storage" in runs and "multicast" in runs:
                row["storage_over_multicast_ready"] = round(row["storage_all_ready_s"]
                                                            / row["multicast_all_ready_s"], 3)
            print(json.dumps({k2: v for k2, v in row.items() if not k2.endswith("_runs")}),
                  flush=True)
            result["rows"].append(row)
    finally:
        loop["stop"].set()
        if loop["runner"] is not None:
            await loop["runner"]
        await nc.close()
        await redis.aclose()
        stop_processes(procs, logs, 20)
        for server in servers:
            server.stop()
    result["load_average_after"] = os.getloadavg()
    return result


async def pipeline_timings(tmp: Path, log_from: dict[str, int], wait_s: float = 10.0
                           ) -> list[dict]:
    """The "pipeline timings" lines the node workers logged since `log_from` (each log's size
    then), one dict per pipelined instance: how long its formation took (waiting for its
    first blocks, the helper hosting the stage, the head's engine) and its switch to local
    execution, which comes once the copy is whole (waited for up to `wait_s`)."""
    deadline = time.monotonic() + wait_s
    while True:
        merged: dict[str, dict] = {}
        for name, start in log_from.items():
            with open(tmp / f"{name}.log", "rb") as f:
                f.seek(start)
                text = f.read().decode(errors="replace")
            for line in text.splitlines():
                if line.startswith("{"):  # the node's JSON log format: the message inside
                    try:
                        line = json.loads(line).get("message", "")
                    except json.JSONDecodeError:
                        continue  # a line cut by the read
                _, sep, payload = line.partition("pipeline timings ")
                if sep:
                    entry = json.loads(payload)
                    merged.setdefault(entry["instance"], {}).update(entry)
        if all("switch_s" in e for e in merged.values()) or time.monotonic() > deadline:
            return list(merged.values())
        await asyncio.sleep(0.2)


def served_table(results: Path) -> str:
    """The BENCHMARKS rows of the served runs recorded in `results` (scaleout_served_*.json)."""
    lines = ["| shape (bytes) | k | all k can serve, multicast / storage (s) | the multicast "
             "itself (s) | TTFT at t = 0, median / max, multicast (s) | TTFT at t = 0, median / "
             "max, storage (s) | storage / multicast (serve) |",
             "|---|---|---|---|---|---|---|"]
    for path in sorted(results.glob("scaleout_served_*.json")):
        r = json.loads(path.read_text())
        for row in r["rows"]:
            lines.append(
                f"| {r['shape']} ({r['model_bytes'] / 1e6:.0f} MB) | {row['k']} | "
                f"{row['multicast_all_ready_s']:.2f} / {row['storage_all_ready_s']:.2f} | "
                + (f"{median([x['multicast_s'] for x in row['multicast_runs']]):.2f} | "
                   if "multicast_runs" in row else "not recorded | ") +
                f"{row['multicast_ttft_median_s']:.2f} / {row['multicast_ttft_max_s']:.2f} | "
                f"{row['storage_ttft_median_s']:.2f} / {row['storage_ttft_max_s']:.2f} | "
                f"{row['storage_over_multicast_ready']:.2f} |")
        for k, why in r.get("skipped_k", {}).items():
            lines.append(f"| {r['shape']} | {k} | not run: {why} | | | | |")
    return "\n".join(lines)


def uuid_hex() -> str:
    import uuid

    return uuid.uuid4().hex[:8]


def _record(args, argv: list[str] | None, shapes: str, kind: str, network: str, run) -> int:
    """Run `run(shape, ks)` for each shape and write its result, with the command and machine,
    to RESULTS/scaleout_<kind>_<shape>.json."""
    for shape in shapes.split(","):
        ks = [int(k) for k in args.ks.split(",")] if args.ks else list(SHAPE_KS.get(shape,
                                                                                (2, 4, 8)))
        result = {"command": "flock -x /tmp/slinfer-cpu.lock .venv/bin/python bench/scaleout.py "
                             + " ".join(argv if argv is not None else sys.argv[1:]),
                  "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"),
                  "network": network, **run(shape, ks)}
        out = Path(args.results) / f"scaleout_{kind}_{shape}.json"
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
    return 0


def served(args, argv: list[str] | None) -> int:
    return _record(args, argv, args.serve, "served",
                   "loopback TCP between node worker processes of this machine",
                   lambda shape, ks: asyncio.run(serve_shape(shape, ks, args.repeats)))


def execute_while_load(args, argv: list[str] | None) -> int:
    """The burst multicast with and without execute-while-load, the link paced (`--link-mbps`):
    `--ewl-methods` multicast,pipeline (a DRAM holder hosts the stage) by default, or
    multicast,receivers (receivers host for each other, with `--sources` >= 2)."""
    link = args.link_mbps * 1e6
    methods = tuple(args.ewl_methods.split(","))
    kind = "ewl" if (methods, args.sources) == (("multicast", "pipeline"), 1) else \
        f"ewl-{'-'.join(m for m in methods if m != 'multicast')}-{args.sources}src"
    return _record(args, argv, args.ewl, kind,
                   f"loopback TCP between node worker processes of this machine, every sending "
                   f"connection paced to {args.link_mbps:g} MB/s",
                   lambda shape, ks: asyncio.run(serve_shape(shape, ks, args.repeats, methods,
                                                             link, args.sources)))


def ewl_table(results: Path) -> str:
    """The BENCHMARKS rows of the recorded --ewl runs (scaleout_ewl_*.json)."""
    lines = ["| shape (bytes) | k | link (MB/s) | first TTFT at t = 0, multicast / pipeline (s) | "
             "TTFT median / max, multicast (s) | TTFT median / max, pipeline (s) | the "
             "multicast itself, multicast / pipeline run (s) | pipeline formation: stage "
             "hosted / head engine / switch (s) |", "|---|---|---|---|---|---|---|---|"]
    for path in sorted(results.glob("scaleout_ewl_*.json")):
        r = json.loads(path.read_text())
        for row in r["rows"]:
            mc = [median([x["multicast_s"] for x in row[f"{m}_runs"]]) for m in
                  ("multicast", "pipeline")]
            timings = [t for x in row["pipeline_runs"] for t in x.get("pipeline_timings", [])]
            formation = " / ".join(
                f"{median([t[key] for t in timings if key in t]):.2f}"
                if any(key in t for t in timings) else "n/a"
                for key in ("host_stage_s", "head_engine_s", "switch_s")) \
                if timings else "not recorded"
            lines.append(
                f"| {r['shape']} ({r['model_bytes'] / 1e6:.0f} MB) | {row['k']} | "
                f"{r['link_bytes_per_s'] / 1e6:g} | {row['multicast_ttft_min_s']:.2f} / "
                f"{row['pipeline_ttft_min_s']:.2f} | {row['multicast_ttft_median_s']:.2f} / "
                f"{row['multicast_ttft_max_s']:.2f} | {row['pipeline_ttft_median_s']:.2f} / "
                f"{row['pipeline_ttft_max_s']:.2f} | {mc[0]:.2f} / {mc[1]:.2f} | "
                f"{formation} |")
    return "\n".join(lines)


def ewl_sources_table(results: Path) -> str:
    """The BENCHMARKS rows of the recorded k-way --ewl runs (scaleout_ewl-*-<k>src_*.json): per
    method, each burst's earliest and latest first token (medians of the runs), and how the
    pipelines formed (from the heads' `pipeline timings` lines)."""
    lines = ["| shape | sources | k | link (MB/s) | method | first token, earliest / latest "
             "(s) | instances served through a pipeline per burst | where their other layers "
             "ran | waiting for blocks / stages hosted / head engine (s) | the multicast "
             "itself (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for path in sorted(results.glob("scaleout_ewl-*src_*.json")):
        r = json.loads(path.read_text())
        for row in r["rows"]:
            for method in r["methods"]:
                runs = row[f"{method}_runs"]
                timings = [t for x in runs for t in x.get("pipeline_timings", [])
                           if "remote" in t]
                where = sorted({", ".join(f"{h} {a}-{b - 1}" for h, a, b in t["remote"])
                                for t in timings})
                formation = " / ".join(f"{median([t[key] for t in timings]):.2f}" for key in
                                       ("wait_blocks_s", "host_stage_s", "head_engine_s")) \
                    if timings else "-"
                lines.append(
                    f"| {r['shape']} | {r['sources']} | {row['k']} | "
                    f"{r['link_bytes_per_s'] / 1e6:g} | {method} | "
                    f"{row[f'{method}_ttft_min_s']:.2f} / {row[f'{method}_ttft_max_s']:.2f} | "
                    f"{len(timings) / len(runs):g} | {'; '.join(where) or '-'} | {formation} | "
                    f"{median([x['multicast_s'] for x in runs]):.2f} |")
    return "\n".join(lines)


def measured(args, argv: list[str] | None) -> int:
    return _record(args, argv, args.measure, "measured",
                   "loopback TCP between processes of this machine",
                   lambda shape, ks: asyncio.run(measure_shape(shape, ks, args.repeats,
                                                               args.measure_blocks)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "scaleout_sim.json"))
    p.add_argument("--blocks", type=int, default=32, help="model blocks (λScale's elbow: tens)")
    p.add_argument("--measure", metavar="SHAPES",
                   help="measure on real endpoints instead, e.g. small,llama-3.2-1b")
    p.add_argument("--serve", metavar="SHAPES",
                   help="the burst through node workers and the placer, multicast vs storage, "
                        "e.g. small,llama-3.2-1b")
    p.add_argument("--served-table", action="store_true",
                   help="print the BENCHMARKS table of the recorded --serve results")
    p.add_argument("--ewl", metavar="SHAPES",
                   help="the burst through node workers and the placer, multicast with and "
                        "without execute-while-load (λScale §4.3) over a paced link")
    p.add_argument("--link-mbps", type=float, default=100.0,
                   help="--ewl: the link every node paces its sends to (MB/s)")
    p.add_argument("--ewl-methods", default="multicast,pipeline",
                   help="--ewl: the methods compared (multicast, pipeline, receivers)")
    p.add_argument("--sources", type=int, default=1,
                   help="--ewl: memory nodes holding the model (a k-way multicast)")
    p.add_argument("--ewl-table", action="store_true",
                   help="print the BENCHMARKS table of the recorded --ewl results")
    p.add_argument("--ks", help="destination counts to measure (default 2,4,8; those that do "
                                "not fit in memory are skipped and recorded)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--measure-blocks", type=int, default=16,
                   help="blocks of a measured multicast (λScale §7.6: 16)")
    p.add_argument("--results", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    if args.served_table:
        print(served_table(Path(args.results)))
        return 0
    if args.ewl_table:
        print(ewl_table(Path(args.results)))
        print()
        print(ewl_sources_table(Path(args.results)))
        return 0
    if args.ewl:
        return execute_while_load(args, argv)
    if args.serve:
        return served(args, argv)
    return measured(args, argv) if args.measure else modelled(args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
