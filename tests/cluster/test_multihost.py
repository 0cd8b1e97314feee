"""slinfer on three hosts (network namespaces on this machine, `hosts.Cluster`) under a steady
load of streamed and plain requests, through four faults one after the other: the nats-server
leading the request stream is killed, the valkey primary is killed (Sentinel fails over), a
node's host is cut off the network and healed, and a whole host (a placer, a node, and its
nats-server, valkey and Sentinel) is killed. Every request completes with the fault-free text or
gets a clear error, none runs twice or hangs past its deadline, and the cluster view drops the
lost node within its TTL. Before the last fault the node holding a long request is drained: the
request moves live to the other node, on another host, and ends with all its tokens; before the
faults the model was multicast (λScale) from one node's host to the other's. How long
each fault stalled the load goes to the test's output (and BENCHMARKS).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from services.node.loader.convert import convert_checkpoint
from shared.cluster import profile_to_json
from shared.subjects import REQUEST_STREAM
from tests.cluster import netns
from tests.cluster.hosts import OPERATOR_KEY, REPO, Cluster
from tests.cluster.driver import LONG_TOKENS
from tests.faults.load import PROMPTS, Outcome, check

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(bool(netns.available()), reason=str(netns.available()))]

MODEL = "tiny-llama"
DEADLINE_S = 100.0  # no request may take longer (the batch SLO class's deadline is shorter)
AFTER_FAULT = 4  # requests that must complete after a fault before the next one
RECORD_ENV = "SLINFER_MULTIHOST_RECORD"  # append this run's figures (JSON line) to that file


class Driver:
    """tests/cluster/driver.py running in host h1."""

    def __init__(self, cluster: Cluster, model_dir: Path, profile_file: Path, data: Path) -> None:
        self.out, self.stop_file = data / "driver.json", data / "driver.stop"
        self.log = data / "logs" / "driver.log"
        h1 = cluster.seg["h1"]
        argv = [sys.executable, "-m", "tests.cluster.driver", "--gateway", cluster.gateway_url,
                "--key", OPERATOR_KEY, "--nats", cluster.nats_urls, "--redis", cluster.redis_url,
                "--model", MODEL, "--model-dir", str(model_dir), "--profile", str(profile_file),
                "--nodes", "node-0,node-1", "--out", str(self.out), "--stop", str(self.stop_file)]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(h1.argv(argv), cwd=REPO, stdout=log,
                                         stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float) -> None:
        self._until(lambda: "ready" in self.log.read_text(errors="replace"), timeout_s, "ready")

    def completed(self) -> int:
        try:
            return int(Path(f"{self.out}.progress").read_text() or 0)
        except (OSError, ValueError):
            return 0

    def wait_completed(self, n: int, timeout_s: float, what: str) -> float:
        """Until `n` requests completed in all; when (monotonic) that happened."""
        self._until(lambda: self.completed() >= n, timeout_s, what)
        return time.monotonic()

    def drain_under_long_request(self, timeout_s: float = 60) -> tuple[str, dict, str]:
        """Send the long request; the driver drains its node once it streams. (That node, the
        drain's answer, the request's id.)"""
        Path(f"{self.out}.long").touch()
        done = Path(f"{self.out}.long.drain")
        self._until(done.exists, timeout_s, "the long request's node to be drained")
        drained = json.loads(done.read_text())
        return drained["node"], drained["reply"], drained["request_id"]

    def finish(self) -> dict:
        self.stop_file.touch()
        self.proc.wait(timeout=180)
        return json.loads(self.out.read_text())

    def _until(self, cond, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if self.proc.poll() is not None:
                raise AssertionError(f"the driver exited while waiting for {what}:\n"
                                     f"{self.log.read_text(errors='replace')[-4000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}:\n"
                                     f"{self.log.read_text(errors='replace')[-4000:]}")
            time.sleep(0.2)


def _stall(outcomes: list[Outcome], at: float) -> float:
    """Seconds from the fault until the first request sent after it completed (its own time
    included: compare with the fault-free request time)."""
    after = [o.ended for o in outcomes if o.ok and o.started >= at]
    return (min(after) - at) if after else float("inf")


def _view(cluster: Cluster) -> list[dict] | None:
    """The cluster view's nodes (`/admin/nodes`); None when the gateway could not say (its Redis
    may be failing over: the host that died may have held the valkey primary)."""
    try:
        body = cluster.probe(cluster.seg["h1"], "get", f"{cluster.gateway_url}/admin/nodes",
                             OPERATOR_KEY)
    except RuntimeError:
        return None
    return json.loads(body)["data"]


def _node_ids(cluster: Cluster) -> set[str] | None:
    view = _view(cluster)
    return None if view is None else {n["node_id"] for n in view}


def _until_fresh(cluster: Cluster, node_ids: set[str], since: float, timeout_s: float = 60
                 ) -> float:
    """Until the cluster view holds a snapshot of each of `node_ids` taken after `since` (wall
    clock; the hosts share this machine's); when (wall clock) that was first seen."""
    deadline = time.monotonic() + timeout_s
    while True:
        view = _view(cluster)  # None: the gateway could not say just now; ask again
        if view is not None and node_ids <= {n["node_id"] for n in view if n["heartbeat"] > since}:
            return time.time()
        assert time.monotonic() < deadline, f"{node_ids} not all back in the view"
        time.sleep(0.2)


def _until_held_by(cluster: Cluster, request_id: str, node_id: str, timeout_s: float = 60) -> None:
    """Until the cluster view shows `node_id` holding `request_id` (a live migration to it
    committed): only then may the source's host die without the request being resumed."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            body = cluster.probe(cluster.seg["h1"], "get",
                                 f"{cluster.gateway_url}/admin/instances", OPERATOR_KEY)
            if any(i["node_id"] == node_id and request_id in i["requests"]
                   for i in json.loads(body)["data"]):
                return
        except RuntimeError:  # the gateway could not say just now: ask again
            pass
        assert time.monotonic() < deadline, (f"{request_id} never moved to {node_id}; what "
                                             f"the nodes said:\n{_migration_story(cluster)}")
        time.sleep(0.2)


def _migration_story(cluster: Cluster) -> str:
    """The nodes' log lines about drains, migrations and their refusals, and the views of the
    cluster then: what a failed move needs to be understood after the test's hosts are gone."""
    words = ("drain", "migrat", "refus", "destination", "view", "reconnect", "disconnect")
    lines = [f"{name}: {line}" for name in ("node-0", "node-1")
             for line in cluster.procs[name].log().splitlines()
             if any(w in line.lower() for w in words)]
    view = _view(cluster)
    nodes = "(the gateway could not say)" if view is None else json.dumps(view)[-3000:]
    return "\n".join(lines[-60:] + [f"/admin/nodes: {nodes}"])


def other(node_id: str) -> str:
    return {"node-0": "node-1", "node-1": "node-0"}[node_id]


def _primary_host(cluster, seg) -> str:
    """The address of the valkey the Sentinels name primary now (asked from h1)."""
    return cluster.probe(seg["h1"], "primary", f"{seg['h1'].ip}:26379", "slinfer").split(":")[0]


def test_failovers_across_hosts_lose_nothing(tmp_path, demo_model, demo_profile) -> None:
    model_dir = demo_model(tmp_path)
    convert_checkpoint(model_dir)  # the loading-optimized form a multicast sends
    profile_file = tmp_path / "profile.json"
    profile_file.write_text(profile_to_json(demo_profile))
    with netns.segment(["h1", "h2", "h3"]) as seg:
        cluster = Cluster(seg, tmp_path / "cluster")
        try:
            cluster.start_servers()
            cluster.start_services()
            driver = Driver(cluster, model_dir, profile_file, tmp_path)
            driver.wait_ready(300)
            dead = [p.name for p in cluster.procs.values() if not p.alive()]
            assert not dead, "\n".join(f"{n} died:\n{cluster.procs[n].log()[-3000:]}"
                                        for n in dead)  # e.g. a start-up the cluster refused
            faults: dict[str, float] = {}
            driver.wait_completed(AFTER_FAULT, 120, "steady load")

            # 1. the nats-server leading the request stream
            leader = cluster.probe(seg["h1"], "leader", cluster.nats_urls, REQUEST_STREAM)
            faults[f"nats stream leader ({leader})"] = time.monotonic()
            cluster.kill(f"nats@{leader}")
            driver.wait_completed(driver.completed() + AFTER_FAULT, 120, "after the leader")
            cluster.restart(f"nats@{leader}")

            # 2. the valkey primary (Sentinel promotes a replica; the old one comes back as one)
            primary = cluster.host_at(_primary_host(cluster, seg))
            faults[f"valkey primary ({primary.name})"] = time.monotonic()
            cluster.kill(f"valkey@{primary.name}")
            driver.wait_completed(driver.completed() + AFTER_FAULT, 120, "after the primary")
            cluster.restart(f"valkey@{primary.name}")

            # 3. node-1's host off the network for a while, then back (with the valkey primary
            # or not: where the failover above put it decides how node-1's writes fare)
            primary_in_cut = _primary_host(cluster, seg)
            faults["h3 cut off for 8 s"] = time.monotonic()
            seg["h3"].cut()
            time.sleep(8)
            seg["h3"].heal()
            healed = time.time()
            # node-1 serves again once its heartbeat reaches Redis and it answers over NATS (its
            # NATS client reconnects on a schedule of its own, seconds after the heartbeat may
            # be back): until then a drain of node-0 has nowhere to go (make test run 81: the
            # long request finished while its migration waited for node-1)
            back_after = _until_fresh(cluster, {"node-0", "node-1"}, healed) - healed
            cluster.probe(seg["h1"], "answers", cluster.nats_urls, "node-1", "60", timeout_s=70)
            answers_after = time.time() - healed
            driver.wait_completed(driver.completed() + AFTER_FAULT, 120, "after the cut")

            # A live migration across hosts: the node holding a long request drains it to the
            # other node, on another host.
            source, drain, long_id = driver.drain_under_long_request()
            assert drain["draining"] and drain["requests"] >= 1, drain
            _until_held_by(cluster, long_id, other(source))  # the migration committed
            driver.wait_completed(driver.completed() + AFTER_FAULT, 120, "after the drain")

            # 4. the drained node's host loses power: its node, a nats-server, a valkey, a
            # Sentinel (and on h2 a placer)
            host = cluster.host_of_service(source)
            faults[f"host {host.name} killed"] = lost = time.monotonic()
            for name in cluster.on_host(host):
                cluster.kill(name)
            deadline = time.monotonic() + 30
            while (view := _node_ids(cluster)) is None or source in view:
                assert time.monotonic() < deadline, f"{source} never left the cluster view"
                time.sleep(0.5)
            left_after = time.monotonic() - lost
            driver.wait_completed(driver.completed() + AFTER_FAULT, 120, "after the host")
            result = driver.finish()
        finally:
            cluster.stop()
    outcomes = [Outcome(**o) for o in result["outcomes"]]
    refs = {(p, chat): text for p, chat, text in result["refs"]}
    check(outcomes, refs, DEADLINE_S, allowed_status=frozenset({503, 504}),
          allow_disconnect=False, max_tokens=24)
    assert not result["ran_twice"]
    mc = result["multicast"]  # before the faults: node-0 (h2) sent the model to node-1 (h3)
    assert mc["ok"] and mc["blocks_received"] > 0 and mc["block_sources"] == ["node-0"], mc
    long = Outcome(**result["long"])
    assert long.ok and long.tokens == LONG_TOKENS and long.finish == "length", str(long)
    assert long.text.startswith(refs[(PROMPTS[0], False)])  # greedy: the short answer, longer
    path = result["moved"].get(long.request_id, [])
    assert [n for _, n in path][:2] == [source, other(source)] and {a for a, _ in path} == {0}, (
        f"the long request did not move live from {source}: {path}")
    stalls = {what: round(_stall(outcomes, at), 2) for what, at in faults.items()}
    summary = {"requests": len(outcomes), "completed": sum(o.ok for o in outcomes),
               "errors": Counter(str(o.status) for o in outcomes if not o.ok),
               "ran_twice": len(result["ran_twice"]), "stall_s": stalls,
               "fault_free_request_s": round(statistics.median(
                   o.seconds for o in outcomes if o.ok and o.ended < min(faults.values())), 2),
               "node_left_view_after_s": round(left_after, 2),
               "cut_node_back_in_view_after_s": round(back_after, 2),
               "cut_node_answers_after_s": round(answers_after, 2),
               "valkey_primary_during_cut": cluster.host_at(primary_in_cut).name,
               "long_request_moved": [n for _, n in path],
               "multicast": {k: mc[k] for k in ("bytes", "seconds", "blocks_received")}}
    print(f"\nmulti-host: {json.dumps(summary)}")
    if os.environ.get(RECORD_ENV):  # bench/BENCHMARKS.md's multi-host figures
        with open(os.environ[RECORD_ENV], "a") as out:
            out.write(json.dumps(summary) + "\n")
    assert all(s < DEADLINE_S for s in stalls.values()), stalls
