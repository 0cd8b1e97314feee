"""Chaos soak: mixed traffic on a stack of N nodes while one process at a time is SIGKILLed and
restarted; every request's answer judged, every process's memory sampled.

    .venv/bin/python bench/chaos.py [--minutes 30] [--fault-every-s 60] [--nodes 2] [--clients 4]
    .venv/bin/python bench/chaos.py --table   # the BENCHMARKS section of bench/results/chaos.json

The stack (`services.stack.Stack`: nats-server, valkey, the placer, --nodes CPU node workers, the
gateway, as real processes) serves the random-weight demo model and one LoRA adapter on it, with
the gateway's request deadline SLINFER_REQUEST_TIMEOUT_S = --request-timeout-s. After --warmup-s
of traffic without faults, every --fault-every-s one process picked at random (seeded: --seed) from
all of them - a node, the placer, the gateway, nats-server, the redis server - is SIGKILLed
(its process group), left down --down-s, started again (a server on its port and data directory),
and the stack is waited on until it serves again with every node (`Stack.heal`).

--clients loops send requests of random kinds the whole time: streamed and plain completions,
chat (streamed and plain), the LoRA adapter, clients that hang up after two events, bad bodies
(a negative max_tokens, a body that is not JSON, no prompt) and an unknown model. Every generating
request is greedy with `ignore_eos` and asks for logprobs, so a correct answer has exactly
max_tokens tokens, the first max_tokens of the fault-free reference for its prompt, and one
logprob entry per token. The client gives up on a request --request-timeout-s + --margin-s after
sending it.

Each request gets exactly one outcome (their sum is `sent`):

- completed: a whole answer (plain: 200 with a finish reason and usage; streamed: one finish
  chunk, the usage chunk, then "[DONE]" last) with max_tokens tokens, finish "length", the
  reference's tokens, and as many logprob entries as usage.completion_tokens.
- rejected: a bad body or unknown model answered 400/404/422, as intended.
- clear_error: a request that should have been served answered with an error status, or a
  stream that ended with an error event and "[DONE]" (counted by status and code).
- hung_up: the client closed the stream itself after two events (as intended).
- refused_gateway_down: no connection, sent while the gateway was down (from its kill until the
  stack served again: /health, every node in the view, the model listed): a killed gateway
  cannot accept anything.
- cut_by_gateway_kill: the connection broke, or the stream ended without "[DONE]", and the
  gateway was killed (or down) while the request was open: a killed gateway cannot answer. A
  client's retry would be a new request.
- lost: the same - no complete answer, no error status or event - while the gateway ran the whole
  time the request was open (a connection refused or reset, a stream cut short, by anything but a
  gateway kill). Must be 0.
- answered_twice: two terminal events (finish chunks and error events together), more than one
  "[DONE]", anything after "[DONE]", or more logprob entries streamed than
  usage.completion_tokens (a duplicated token). Must be 0.
- hung: no end within the client's limit (the deadline + the margin). Must be 0.
- wrong: an answer that ended properly but is not right: a bad body accepted, a token count or
  finish reason other than asked, tokens that are not the reference's (a gap, a token lost on a
  resume), fewer logprob entries than tokens. Must be 0.

Writes bench/results/chaos.json: the counts, the clear errors by cause, every fault (target, when
it was killed and restarted, when the stack served again), every process's RSS (summed over its
process tree) before the first fault and after the last one healed, with its peak and restarts,
the samples, the machine, the command and the load average, and up to 50 examples of any
request in a must-be-0 outcome.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.traffic import DONE, Answer, prompt, sample, sampler, send  # noqa: E402
from services.profiler.run import profile_model  # noqa: E402
from services.stack import DEFAULT_PLAN, MODEL, Stack, running_stack  # noqa: E402
from shared.adaptergen import build_adapter  # noqa: E402
from shared.modelgen import ensure_demo_model  # noqa: E402

OUT = ROOT / "bench" / "results" / "chaos.json"
ADAPTER = "chaos-lora"
PROMPTS = 8  # distinct prompts: each has a fault-free reference per model and per API
MAX_TOKENS = 32  # a request asks for 4..MAX_TOKENS tokens; the references have MAX_TOKENS
SAMPLE_S = 15.0
EXAMPLES = 50
MUST_BE_ZERO = ("lost", "answered_twice", "hung", "wrong")
OUTCOMES = ("completed", "rejected", "clear_error", "hung_up", "refused_gateway_down",
            "cut_by_gateway_kill", *MUST_BE_ZERO)
# kind -> weight; "lora" is a completion or chat on the adapter, streamed or not.
KINDS = {"stream": 3, "plain": 2, "chat": 2, "chat-stream": 1, "lora": 3, "hangup": 2, "bad": 1,
         "unknown": 1}


@dataclass(frozen=True)
class ChaosPlan:
    minutes: float = 30.0  # traffic with faults, after the warm-up
    fault_every_s: float = 60.0
    down_s: float = 3.0  # how long a killed process stays down
    warmup_s: float = 60.0  # traffic before the first fault
    clients: int = 4
    seed: int = 1
    targets: tuple[str, ...] = ()  # processes a fault may hit; empty: all of the stack's
    request_timeout_s: float = 60.0  # the gateway's deadline: SLINFER_REQUEST_TIMEOUT_S
    margin_s: float = 30.0  # the client waits the deadline and this long
    heal_timeout_s: float = 180.0


@dataclass(frozen=True)
class Spec:
    """One request: what was sent, and what a right answer looks like."""

    kind: str
    path: str
    body: dict[str, Any] | bytes
    stream: bool
    chat: bool = False
    model: str = ""
    prompt_index: int = -1  # into the references; -1: not a generating request
    max_tokens: int = 0

    @property
    def generates(self) -> bool:
        return self.prompt_index >= 0


@dataclass
class Fault:
    target: str
    killed_s: float  # seconds since the traffic started
    restarted_s: float = 0.0
    served_s: float | None = None  # the stack served again with every node; None: never
    problem: str | None = None

    @property
    def outage(self) -> tuple[float, float]:
        return self.killed_s, self.served_s if self.served_s is not None else float("inf")


# --------------------------------------------------------------------------- requests


def generating(kind: str, model: str, text: str, index: int, max_tokens: int, chat: bool,
               stream: bool) -> Spec:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "stream": stream}
    if chat:
        body |= {"messages": [{"role": "user", "content": text}], "logprobs": True}
    else:
        body |= {"prompt": text, "logprobs": 0}
    if stream:
        body["stream_options"] = {"include_usage": True}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return Spec(kind, path, body, stream, chat, model, index, max_tokens)


def pick(rng: random.Random, prompts: list[str], model: str, adapter: str) -> Spec:
    kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    index = rng.randrange(len(prompts))
    n = rng.randint(4, MAX_TOKENS)
    if kind == "bad":
        body = rng.choice([{"model": model, "prompt": prompts[index], "max_tokens": -1},
                           b'{"model": "' + model.encode() + b'", "prompt": ',
                           {"model": model, "max_tokens": n}])
        return Spec(kind, "/v1/completions", body, stream=False)
    if kind == "unknown":
        return Spec(kind, "/v1/completions", {"model": "no-such-model", "prompt": prompts[index],
                                              "max_tokens": n}, stream=False)
    chat = kind.startswith("chat") or (kind == "lora" and rng.random() < 0.5)
    stream = kind in ("stream", "chat-stream", "hangup") or (kind == "lora" and rng.random() < 0.5)
    return generating(kind, adapter if kind == "lora" else model, prompts[index], index, n, chat,
                      stream)


def tokens_of(choice: dict[str, Any], chat: bool) -> list[str]:
    """The token strings of a choice's logprobs (a whole answer's, or one chunk's)."""
    lp = choice.get("logprobs") or {}
    if chat:
        return [entry["token"] for entry in lp.get("content") or []]
    return list(lp.get("tokens") or [])


async def references(client: httpx.AsyncClient, prompts: list[str],
                     models: tuple[str, ...]) -> dict[tuple[str, bool, int], list[str]]:
    """The fault-free greedy tokens of every (model, chat, prompt), MAX_TOKENS long."""
    refs = {}
    for model in models:
        for chat in (False, True):
            for i, text in enumerate(prompts):
                spec = generating("reference", model, text, i, MAX_TOKENS, chat, stream=False)
                a = await send(client, spec.kind, spec.path, spec.body, stream=False, total_s=300)
                if a.status != 200:
                    raise RuntimeError(f"reference {model} chat={chat} #{i}: {a.status} "
                                       f"{a.error or a.body}")
                refs[(model, chat, i)] = tokens_of(a.body["choices"][0], chat)
    return refs


# --------------------------------------------------------------------------- judging


def _error_key(status: int | None, body: Any) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    code = (error.get("code") or error.get("type")) if isinstance(error, dict) else None
    return f"{status or 'event'} {code or 'no error body'}"


def error_message(a: Answer) -> str:
    """The message of an error answer or of a stream's error event."""
    events = [e["error"] for e in a.events
              if isinstance(e, dict) and isinstance(e.get("error"), dict)]
    if events:
        return str(events[0].get("message"))
    return a.error_message or ""


def _check_whole(spec: Spec, tokens: list[str], usage: Any, finish: Any,
                 refs: dict[tuple[str, bool, int], list[str]]) -> str | None:
    """Why a properly ended answer is wrong (None: it is right)."""
    if not isinstance(usage, dict):
        return "no usage"
    n = usage.get("completion_tokens")
    if n != spec.max_tokens or finish != "length":
        return f"{n} tokens, finish {finish!r}; asked {spec.max_tokens}, 'length'"
    if len(tokens) != n:
        return f"{len(tokens)} logprob entries for {n} tokens"
    want = refs[(spec.model, spec.chat, spec.prompt_index)][:n]
    if tokens != want:
        return f"tokens differ from the reference: got {tokens}, want {want}"
    return None


def _judge_stream(spec: Spec, a: Answer,
                  refs: dict[tuple[str, bool, int], list[str]]) -> tuple[str, str]:
    objects = [e for e in a.events if isinstance(e, dict)]
    choices = [c for e in objects for c in e.get("choices") or []]
    finishes = [c for c in choices if c.get("finish_reason")]
    errors = [e for e in objects if "error" in e]
    dones = [i for i, e in enumerate(a.events) if e == DONE]
    tokens = [t for c in choices for t in tokens_of(c, spec.chat)]
    usage = next((e["usage"] for e in reversed(objects) if e.get("usage")), None)
    after_done = bool(dones) and dones[0] != len(a.events) - 1
    if len(finishes) + len(errors) > 1 or len(dones) > 1 or after_done:
        return "answered_twice", (f"{len(finishes)} finishes, {len(errors)} errors, "
                                  f"{len(dones)} [DONE], more after [DONE]: {after_done}")
    if isinstance(usage, dict) and len(tokens) > (usage.get("completion_tokens") or 0):
        return "answered_twice", f"{len(tokens)} tokens streamed, usage says {usage}"
    if not dones:
        return "", "the stream ended without [DONE]"
    if errors:
        return "clear_error", _error_key(None, errors[0])
    finish = finishes[0]["finish_reason"] if finishes else None
    why = _check_whole(spec, tokens, usage, finish, refs)
    return ("wrong", why) if why else ("completed", "")


def _judge_whole(spec: Spec, a: Answer,
                 refs: dict[tuple[str, bool, int], list[str]]) -> tuple[str, str]:
    status, body = a.status, a.body
    if status is not None and status >= 400:
        if not spec.generates and status in (400, 404, 422):
            return "rejected", _error_key(status, body)
        return "clear_error", _error_key(status, body)
    if not spec.generates:
        return "wrong", f"a {spec.kind} request answered {status}"
    try:
        choice = body["choices"][0]
    except (TypeError, KeyError, IndexError):
        return "wrong", f"{status} without choices: {str(body)[:200]}"
    why = _check_whole(spec, tokens_of(choice, spec.chat), body.get("usage"),
                       choice.get("finish_reason"), refs)
    return ("wrong", why) if why else ("completed", "")


def judge(spec: Spec, a: Answer, refs: dict[tuple[str, bool, int], list[str]],
          gateway_outages: list[tuple[float, float]]) -> tuple[str, str]:
    """(outcome, detail) of one request; see the module docstring for each outcome."""
    def gateway_down_during() -> bool:
        return any(start <= a.ended and a.started <= end for start, end in gateway_outages)

    if a.timed_out:
        return "hung", a.error or ""
    if a.hung_up:
        return "hung_up", ""
    if a.error is not None:
        if a.error_type == "ConnectError" and gateway_down_during():
            return "refused_gateway_down", a.error
        return ("cut_by_gateway_kill" if gateway_down_during() else "lost"), a.error
    if a.stream and a.status == 200:
        outcome, detail = _judge_stream(spec, a, refs)
        if not outcome:  # no [DONE]: the connection closed early
            outcome = "cut_by_gateway_kill" if gateway_down_during() else "lost"
        return outcome, detail
    return _judge_whole(spec, a, refs)


# --------------------------------------------------------------------------- the run


@dataclass
class Run:
    plan: ChaosPlan
    started: float = field(default_factory=time.monotonic)
    sent: list[tuple[Spec, Answer]] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)

    def now_s(self) -> float:
        return round(time.monotonic() - self.started, 2)

    def gateway_outages(self) -> list[tuple[float, float]]:
        """Monotonic (kill, served again) spans of every gateway fault."""
        return [(self.started + f.outage[0], self.started + f.outage[1])
                for f in self.faults if f.target == "gateway"]


async def client_loop(stack: Stack, run: Run, i: int, prompts: list[str], adapter: str,
                      until: float) -> None:
    rng = random.Random(run.plan.seed * 1000 + i)
    total_s = run.plan.request_timeout_s + run.plan.margin_s
    async with httpx.AsyncClient(base_url=stack.url, timeout=total_s, headers=stack.auth,
                                 trust_env=False) as client:
        while time.monotonic() < until:
            spec = pick(rng, prompts, stack.model, adapter)
            a = await send(client, spec.kind, spec.path, spec.body, stream=spec.stream,
                           hang_up_after=2 if spec.kind == "hangup" else None, total_s=total_s)
            run.sent.append((spec, a))
            if a.status is None or a.status >= 500:
                await asyncio.sleep(0.5)  # a dead gateway refuses at once: do not spin


async def inject(stack: Stack, run: Run, fault: Fault) -> None:
    plan = run.plan
    await asyncio.to_thread(stack.kill, fault.target)
    await asyncio.sleep(plan.down_s)
    try:
        await asyncio.to_thread(stack.restart, fault.target)
        fault.restarted_s = run.now_s()
        await asyncio.to_thread(stack.heal, plan.heal_timeout_s)
        fault.served_s = run.now_s()
    except (RuntimeError, TimeoutError, OSError) as exc:  # the soak's finding: say it, go on
        fault.problem = f"{type(exc).__name__}: {str(exc)[:2000]}"


async def fault_loop(stack: Stack, run: Run, until: float) -> None:
    plan = run.plan
    rng = random.Random(plan.seed)
    targets = plan.targets or stack.names
    at = run.started + plan.warmup_s
    while at + plan.down_s < until:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        fault = Fault(rng.choice(targets), run.now_s())
        run.faults.append(fault)
        await inject(stack, run, fault)
        at = max(at + plan.fault_every_s, time.monotonic())


async def chaos(stack: Stack, plan: ChaosPlan, adapter: str) -> dict[str, Any]:
    """Run the plan against a started stack serving `adapter` on its model; the measured part of
    the result (counts, errors, faults, memory, examples)."""
    rng = random.Random(plan.seed)
    prompts = [prompt(rng, 8, 60) for _ in range(PROMPTS)]
    async with httpx.AsyncClient(base_url=stack.url, headers=stack.auth, trust_env=False) as c:
        refs = await references(c, prompts, (stack.model, adapter))
    run = Run(plan)
    until = run.started + plan.warmup_s + plan.minutes * 60
    samples: list[dict] = []
    await asyncio.gather(
        sampler(stack.pids, lambda: len(run.sent), until, samples, run.started, SAMPLE_S),
        fault_loop(stack, run, until),
        *[client_loop(stack, run, i, prompts, adapter, until) for i in range(plan.clients)])
    healed = True
    try:
        await asyncio.to_thread(stack.heal, plan.heal_timeout_s)
    except (RuntimeError, TimeoutError) as exc:
        healed = False
        run.faults.append(Fault("(end)", run.now_s(), problem=f"{type(exc).__name__}: {exc}"))
    samples.append(sample(stack.pids(), len(run.sent), run.started))
    return account(run, refs, samples) | {"healed_at_end": healed}


def account(run: Run, refs: dict[tuple[str, bool, int], list[str]],
            samples: list[dict]) -> dict[str, Any]:
    counts: Counter = Counter({o: 0 for o in OUTCOMES})
    errors: Counter = Counter()
    rejected: Counter = Counter()
    kinds: Counter = Counter()
    examples = []
    causes: dict[str, list[dict[str, Any]]] = {}  # a clear error's cause -> its first examples
    outages = run.gateway_outages()
    for spec, a in run.sent:
        outcome, detail = judge(spec, a, refs, outages)
        counts[outcome] += 1
        kinds[spec.kind] += 1
        if outcome == "clear_error":
            errors[detail] += 1
            if len(causes.setdefault(detail, [])) < 3:
                causes[detail].append({"sent_s": round(a.started - run.started, 2),
                                       "seconds": round(a.ended - a.started, 2), "kind": spec.kind,
                                       "message": error_message(a)[:500]})
        if outcome == "rejected":
            rejected[detail] += 1
        if outcome in MUST_BE_ZERO and len(examples) < EXAMPLES:
            examples.append({"outcome": outcome, "detail": detail[:1000], "kind": spec.kind,
                             "model": spec.model, "stream": spec.stream, "chat": spec.chat,
                             "sent_s": round(a.started - run.started, 2),
                             "seconds": round(a.ended - a.started, 2), "status": a.status,
                             "events": [str(e)[:200] for e in a.events[-4:]]})
    return {"counts": {"sent": len(run.sent), **{o: counts[o] for o in OUTCOMES}},
            "clear_errors": dict(errors.most_common()), "clear_error_examples": causes,
            "rejected": dict(rejected.most_common()),
            "kinds": dict(sorted(kinds.items())), "faults": [asdict(f) for f in run.faults],
            "rss": memory(run, samples), "examples": examples, "samples": samples}


def memory(run: Run, samples: list[dict]) -> dict[str, dict[str, float | int]]:
    """Per process: RSS before the first fault (its last sample before it: a sample taken as
    the fault lands may miss the process), after the end (the stack healed), the peak, and how
    many times it was killed."""
    first = run.faults[0].killed_s if run.faults else float("inf")
    before = [s for s in samples[:-1] if s["t_s"] < first] or samples[:1]
    restarts = Counter(f.target for f in run.faults)
    out = {}
    for name in samples[-1]["rss_mb"]:
        seen = [s["rss_mb"][name] for s in samples if name in s["rss_mb"]]
        had = [s["rss_mb"][name] for s in before if name in s["rss_mb"]]
        out[name] = {"before_mb": had[-1] if had else None,
                     "after_mb": samples[-1]["rss_mb"][name], "max_mb": max(seen),
                     "killed": restarts[name]}
    return out


# --------------------------------------------------------------------------- the command


def register_adapter(stack: Stack, out: Path, name: str = ADAPTER) -> str:
    """A random rank-8 adapter of the stack's model, registered public; returns its name."""
    path = build_adapter(stack.model_dir, out / name, seed=7)
    r = httpx.post(f"{stack.url}/admin/models", headers=stack.auth, timeout=60, json={
        "name": name, "path": str(path), "base_model": stack.model, "public": True})
    if r.status_code != 201:
        raise RuntimeError(f"registering the adapter failed: {r.status_code} {r.text}")
    return name


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}"


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main_run(args: argparse.Namespace) -> dict[str, Any]:
    plan = ChaosPlan(args.minutes, args.fault_every_s, args.down_s, args.warmup_s, args.clients,
                     args.seed, tuple(args.targets or ()), args.request_timeout_s)
    load_before = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data_dir or Path(tmp)
        model_dir = Path(ensure_demo_model(data))
        profile, _ = profile_model(model_dir, MODEL, plan=DEFAULT_PLAN)
        env = {"SLINFER_REQUEST_TIMEOUT_S": str(plan.request_timeout_s)}
        with running_stack(data / "stack", model_dir, env, profile=profile,
                           nodes=args.nodes) as stack:
            adapter = register_adapter(stack, data / "adapters")
            measured = asyncio.run(chaos(stack, plan, adapter))
    return {"command": "python bench/chaos.py " + " ".join(sys.argv[1:]), "machine": machine(),
            "date": time.strftime("%Y-%m-%d"),
            "load_average": {"before": load_before, "after": load_average()},
            "model": {"name": MODEL, "engine": "torch", "adapter": "rank 8, all projections"},
            "nodes": args.nodes, "plan": asdict(plan), **measured}


def table(result: dict[str, Any]) -> str:
    """The BENCHMARKS section of a chaos.json."""
    plan, c = result["plan"], result["counts"]
    lines = [f"## Chaos soak: {plan['minutes']:g} minutes of mixed traffic on {result['nodes']} "
             f"nodes, a process killed every ~{plan['fault_every_s']:g} s (`bench/chaos.py`)", "",
             f"Command: `{result['command']}`; {result['machine']}; {result['date']}; load average "
             f"{result['load_average']['before'][0]} before, {result['load_average']['after'][0]} "
             f"after. {plan['clients']} clients, gateway deadline {plan['request_timeout_s']:g} s, "
             f"client limit +{plan['margin_s']:g} s. Raw: `bench/results/chaos.json`; the outcomes "
             "are defined in the module docstring.", "",
             "| outcome | requests |", "|---|---:|"]
    lines += [f"| {name.replace('_', ' ')} | {n} |" for name, n in c.items()]
    if result["clear_errors"]:
        lines += ["", "| clear error (status, code) | requests |", "|---|---:|"]
        lines += [f"| {k} | {n} |" for k, n in result["clear_errors"].items()]
    lines += ["", "| # | killed | at (s) | serving again after (s) | problem |",
              "|---:|---|---:|---:|---|"]
    for i, f in enumerate(result["faults"], 1):
        back = "never" if f["served_s"] is None else f"{f['served_s'] - f['killed_s']:.1f}"
        lines.append(f"| {i} | {f['target']} | {f['killed_s']:.0f} | {back} | "
                     f"{(f['problem'] or '').splitlines()[0][:80] if f['problem'] else ''} |")
    lines += ["", "| process | RSS before (MB) | after (MB) | peak (MB) | killed |",
              "|---|---:|---:|---:|---:|"]
    for name, m in result["rss"].items():
        lines.append(f"| {name} | {m['before_mb']} | {m['after_mb']} | {m['max_mb']} | "
                     f"{m['killed']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0,
                   help="traffic with faults, after the warm-up")
    p.add_argument("--fault-every-s", type=float, default=60.0)
    p.add_argument("--down-s", type=float, default=3.0, help="how long a killed process stays down")
    p.add_argument("--warmup-s", type=float, default=60.0, help="traffic before the first fault")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--targets", nargs="*", help="processes a fault may hit (default: all)")
    p.add_argument("--request-timeout-s", type=float, default=60.0)
    p.add_argument("--data-dir", type=Path, help="the model, the stack's data and its logs "
                   "(default: a temporary directory, removed at the end)")
    p.add_argument("--out", type=Path, default=OUT, help="the result's file (default %(default)s)")
    p.add_argument("--table", action="store_true", help="print the BENCHMARKS section of --out")
    args = p.parse_args()
    if args.table:
        print(table(json.loads(args.out.read_text())), end="")
        return 0
    result = main_run(args)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result), end="")
    bad = {k: result["counts"][k] for k in MUST_BE_ZERO if result["counts"][k]}
    not_back = [f for f in result["faults"] if f["problem"]]
    return 1 if bad or not_back else 0


if __name__ == "__main__":
    sys.exit(main())
