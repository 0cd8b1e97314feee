"""One request through the real stack (nats-server, valkey, placer, node, gateway processes)
exporting over OTLP/HTTP to a receiver: one trace across the services with its parent links, the
GenAI attributes and the placer's decision; the metrics on /metrics and over OTLP; JSON logs that
carry the trace id."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared import telemetry as tm

from tests.ops.otlp_receiver import ReceivedSpan

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SERVICES = {"slinfer-gateway", "slinfer-placer", "slinfer-node"}


def _chat(traced) -> tuple[str, str, int]:
    """(response id, finish reason, completion tokens) of one streamed chat completion."""
    client = openai.OpenAI(base_url=f"{traced.stack.url}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    chunks = list(client.chat.completions.create(
        model=traced.stack.model, messages=[{"role": "user", "content": "Trace me"}], max_tokens=12,
        stream=True, stream_options={"include_usage": True}, temperature=0))
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = [c.usage for c in chunks if c.usage][-1]
    return chunks[0].id, finish[-1], usage.completion_tokens


def _trace_of(receiver, request_id: str, timeout_s: float = 30.0) -> list[ReceivedSpan]:
    """The spans of the trace whose gateway request span is `request_id`, once the node's and the
    gateway's request spans (the last to end) have arrived."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        spans = receiver.snapshot()
        ids = {s.trace_id for s in spans if s.attributes.get("gen_ai.response.id") == request_id}
        if ids:
            trace = [s for s in spans if s.trace_id in ids]
            names = {s.name for s in trace}
            if len(ids) == 1 and "node.request" in names and any(
                    s.kind == 2 and s.service == "slinfer-gateway" for s in trace):  # 2: SERVER
                time.sleep(0.5)  # stragglers of the same batch
                return [s for s in receiver.snapshot() if s.trace_id in ids]
        time.sleep(0.1)
    raise AssertionError(f"no complete trace for {request_id}; got {len(receiver.snapshot())} spans: "
                         f"{sorted({(s.service, s.name) for s in receiver.snapshot()})}")


def _one(spans: list[ReceivedSpan], name: str, service: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name and s.service == service]
    assert len(found) == 1, f"{service} {name}: {len(found)} spans in {[(s.service, s.name) for s in spans]}"
    return found[0]


def _ancestors(span: ReceivedSpan, by_id: dict[str, ReceivedSpan]) -> list[str]:
    names, cur = [], span
    while cur.parent_id:
        cur = by_id[cur.parent_id]
        names.append(cur.name)
    return names


def test_one_request_is_one_trace_across_gateway_placer_and_node(traced_stack):
    rid, finish, tokens = _chat(traced_stack)
    spans = _trace_of(traced_stack.receiver, rid)
    by_id = {s.span_id: s for s in spans}
    assert len(by_id) == len(spans)
    assert SERVICES <= {s.service for s in spans}

    # Parent links intact: one root (the gateway's HTTP server span), every other parent present.
    roots = [s for s in spans if not s.parent_id]
    assert len(roots) == 1 and roots[0].service == "slinfer-gateway"
    assert roots[0].name == "POST /v1/chat/completions"
    missing = [(s.service, s.name) for s in spans if s.parent_id and s.parent_id not in by_id]
    assert not missing, f"spans whose parent is not in the trace: {missing}"
    assert not [s.name for s in spans if s.name.endswith(("http send", "http receive"))], \
        "per-chunk ASGI send/receive spans must be excluded"

    # The gateway's GenAI span.
    chat = _one(spans, f"chat {traced_stack.stack.model}", "slinfer-gateway")
    a = chat.attributes
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == traced_stack.stack.model
    assert a["gen_ai.request.max_tokens"] == 12
    assert a["gen_ai.usage.input_tokens"] > 0
    assert a["gen_ai.usage.output_tokens"] == tokens
    assert a["gen_ai.response.finish_reasons"] == [finish]
    assert chat.parent_id == roots[0].span_id

    # Through a placer (a cold start, say): its decision under the gateway's request span, the
    # node's command span under the decision. On the warm fast path the gateway's request span
    # sent the admission itself, and no placer took part.
    command = _one(spans, "node.command admit", "slinfer-node")
    assert command.attributes["slinfer.admit_reason"] == "admitted"
    if any(s.service == "slinfer-placer" for s in spans):
        place = _check_decision(spans, chat)
        assert command.parent_id == place.span_id
        chain = ["node.command admit", place.name, chat.name]
    else:
        place = None
        assert command.parent_id == chat.span_id
        chain = ["node.command admit", chat.name]
    node_req = _one(spans, "node.request", "slinfer-node")
    assert _ancestors(node_req, by_id)[:len(chain)] == chain
    assert node_req.attributes["gen_ai.usage.output_tokens"] == tokens
    assert node_req.attributes["gen_ai.response.finish_reasons"] == [finish]
    for name in ("node.queue", "node.prefill"):
        assert _one(spans, name, "slinfer-node").parent_id == node_req.span_id
    prefill = _one(spans, "node.prefill", "slinfer-node")
    assert prefill.attributes["slinfer.prefill.engine_s"] > 0
    if tokens > 1:  # the first token comes from the prefill; each later one from a decode step
        decode = _one(spans, "node.decode", "slinfer-node")
        assert decode.parent_id == node_req.span_id
        assert decode.attributes["slinfer.decode.iterations"] == tokens - 1
    assert len([s for s in spans if s.name == "node.decode"]) <= 1, "one decode span, not one per token"

    # The cold start: the instance's load, with its bytes and time parked.
    if place is not None and place.attributes["slinfer.placement.action"] == "new_instance":
        load = _one(spans, "node.memop load", "slinfer-node")
        assert load.parent_id == command.span_id
        assert load.attributes["slinfer.memop.bytes_after"] > 0
        assert load.attributes["slinfer.memop.parked_s"] >= 0
        assert load.attributes["slinfer.memop.duration_s"] > 0

    # The token stream's headers: the gateway span links the node span that produced the tokens.
    assert (node_req.trace_id, node_req.span_id) in chat.links


def _check_decision(spans: list[ReceivedSpan], chat: ReceivedSpan) -> ReceivedSpan:
    """The placer's decision span, under the gateway's request span, and what it says."""
    place = _one(spans, f"place {chat.attributes['gen_ai.request.model']}", "slinfer-placer")
    p = place.attributes
    assert place.parent_id == chat.span_id
    assert p["slinfer.placement.action"] in ("new_instance", "route")
    assert p["slinfer.placement.node_id"] == "node-0"
    assert p["slinfer.node.accepted"] is True and p["slinfer.node.reason"] == "admitted"
    assert p["slinfer.placement.instance_id"].startswith(f"{chat.attributes['gen_ai.request.model']}@node-0")
    assert any(re.fullmatch(r"node-0/.+: admitted", t) for t in p["slinfer.placement.attempts"])
    assert [e for e in place.events if e[0] == "admission" and e[1]["slinfer.admit_reason"] == "admitted"]
    assert p["slinfer.placement.queued_s"] >= 0
    return place


def test_a_warm_request_goes_from_the_gateway_to_its_node_directly(traced_stack):
    """Once the model has an instance, a request skips the stream and the placer: its trace
    holds no placer span, and the gateway counts the direct admission."""
    _chat(traced_stack)  # the instance is there now (if it was not)
    rid, _, _ = _chat(traced_stack)
    spans = _trace_of(traced_stack.receiver, rid)
    assert not [s.name for s in spans if s.service == "slinfer-placer"]
    chat = _one(spans, f"chat {traced_stack.stack.model}", "slinfer-gateway")
    assert _one(spans, "node.command admit", "slinfer-node").parent_id == chat.span_id
    text = httpx.get(f"{traced_stack.stack.url}/metrics", timeout=10).text
    admitted = re.search(r'^slinfer_gateway_direct_admissions_total\{[^}]*outcome="admitted"[^}]*\} '
                         r'(\S+)$', text, re.M)
    assert admitted and float(admitted.group(1)) >= 1, text[:3000]


def test_gateway_metrics_show_ttft_histogram_after_a_request(traced_stack):
    _chat(traced_stack)
    text = httpx.get(f"{traced_stack.stack.url}/metrics", timeout=10).text
    model = traced_stack.stack.model
    count = re.search(r'^gen_ai_server_time_to_first_token_seconds_count\{[^}]*'
                      rf'gen_ai_request_model="{re.escape(model)}"[^}}]*\}} (\S+)$', text, re.M)
    assert count and float(count.group(1)) >= 1, text[:3000]
    assert re.search(r'^gen_ai_server_time_to_first_token_seconds_bucket\{.*le="\+Inf"\}', text, re.M)
    assert "gen_ai_server_request_duration_seconds_count" in text
    assert "gen_ai_server_time_per_output_token_seconds_count" in text
    slo = sum(float(m) for m in re.findall(
        r'^slinfer_requests_slo_(?:met|violated)_total\{[^}]*\} (\S+)$', text, re.M))
    assert slo >= 1


def _gauge(text: str, name: str) -> float | None:
    found = re.search(rf'^{name}\{{[^}}]*slinfer_node_id="node-0"[^}}]*\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else None


def _model_gauge(text: str, name: str, model: str) -> float | None:
    """A vLLM-named gauge of `model` on node-0."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (sample.name == name and sample.labels.get("model_name") == model
                    and sample.labels.get("slinfer_node_id") == "node-0"):
                return sample.value
    return None


def _scrape_node_while_generating(traced_stack) -> str:
    """The node's /metrics while a request generates there (ignore_eos, close to the model's
    context), so an instance is there because the request holds it, not because keep-alive has
    not run out; the gauges are sampled at the node's heartbeat, so the scrape waits for a
    sample that shows the request running."""
    client = openai.OpenAI(base_url=f"{traced_stack.stack.url}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    model = traced_stack.stack.model
    stream = client.completions.create(model=model, prompt="Scrape me", max_tokens=2000, stream=True,
                                       temperature=0, extra_body={"ignore_eos": True})
    try:
        next(iter(stream))  # the first token: the request is on the node
        deadline = time.monotonic() + 30
        while True:
            text = httpx.get(traced_stack.node_metrics_url, timeout=10).text
            if ((_gauge(text, "slinfer_node_instances") or 0) >= 1
                    and (_model_gauge(text, "vllm:num_requests_running", model) or 0) >= 1
                    or time.monotonic() > deadline):
                return text
            time.sleep(0.1)
    finally:
        stream.close()


def test_node_metrics_endpoint_and_otlp_metrics(traced_stack):
    text = _scrape_node_while_generating(traced_stack)
    for name in ("slinfer_node_memory_budget_bytes", "slinfer_node_memory_pessimistic_bytes",
                 "slinfer_node_kv_allocated_bytes", "slinfer_node_memops_parked",
                 "slinfer_node_instances", "slinfer_node_iterations_per_second"):
        assert _gauge(text, name) is not None, name
    assert _gauge(text, "slinfer_node_instances") >= 1  # the one the running request holds
    assert _gauge(text, "slinfer_node_kv_allocated_bytes") > 0
    assert _gauge(text, "slinfer_node_memory_budget_bytes") > 0
    # vLLM's names for the same node: the generating request runs (prefilled), its KV is in use.
    model = traced_stack.stack.model
    assert _model_gauge(text, "vllm:num_requests_running", model) >= 1
    assert _model_gauge(text, "vllm:num_requests_waiting", model) is not None
    usage = _model_gauge(text, "vllm:kv_cache_usage_perc", model)
    assert 0 < usage <= 1
    assert _model_gauge(text, "vllm:gpu_cache_usage_perc", model) == usage
    receiver = traced_stack.receiver
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not {
            "gen_ai.server.time_to_first_token", "slinfer.node.memory.budget"} <= receiver.metric_names:
        time.sleep(0.2)
    assert "gen_ai.server.time_to_first_token" in receiver.metric_names
    assert "slinfer.node.memory.budget" in receiver.metric_names


def test_json_logs_carry_the_trace_id_inside_a_request(traced_stack):
    rid, _, _ = _chat(traced_stack)
    trace_id = next(s.trace_id for s in _trace_of(traced_stack.receiver, rid)
                    if s.attributes.get("gen_ai.response.id") == rid)
    logs = traced_stack.stack.data_dir / "logs"
    deadline = time.monotonic() + 10
    while True:
        lines = {name: [json.loads(line) for line in (logs / f"{name}.log").read_text().splitlines()
                        if line.startswith("{")] for name in ("gateway", "placer")}
        gateway = [r for r in lines["gateway"] if rid in r["message"] and "finished" in r["message"]]
        placer = [r for r in lines["placer"] if rid in r["message"] and r["message"].startswith("placed")]
        if (gateway and placer) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert gateway and placer
    for record in (gateway[0], placer[0]):
        assert record["trace_id"] == trace_id and re.fullmatch(r"[0-9a-f]{16}", record["span_id"])
        assert record["level"] == "INFO" and record["service"].startswith("slinfer-")


# --- vLLM's metric names, GenAI token usage, per-tenant tokens, and the Grafana dashboard -------
DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "slinfer-dashboard.json"


def _values(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def _total(values: dict, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, lbl), v in values.items() if n == name and want <= lbl)


def _settled(url: str) -> dict:
    """A scrape once earlier tests' requests have all been recorded (two scrapes agree)."""
    previous = None
    deadline = time.monotonic() + 30
    while True:
        values = _values(httpx.get(url, timeout=10).text)
        if values == previous or time.monotonic() > deadline:
            return values
        previous = values
        time.sleep(0.5)


def test_vllm_and_genai_metrics_count_what_the_usage_says(traced_stack):
    url, model = f"{traced_stack.stack.url}/metrics", traced_stack.stack.model
    before = _settled(url)
    client = openai.OpenAI(base_url=f"{traced_stack.stack.url}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count my tokens, please"}],
        max_tokens=10, stream=True, stream_options={"include_usage": True}, temperature=0))
    usage = [c.usage for c in chunks if c.usage][-1]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    deadline = time.monotonic() + 15
    while True:
        after = _values(httpx.get(url, timeout=10).text)
        done = _total(after, "vllm:e2e_request_latency_seconds_count", model_name=model)
        if done > _total(before, "vllm:e2e_request_latency_seconds_count", model_name=model):
            break
        assert time.monotonic() < deadline, "the request's metrics were never recorded"
        time.sleep(0.1)

    def delta(name: str, **labels: str) -> float:
        return _total(after, name, **labels) - _total(before, name, **labels)

    prompt, completion = usage.prompt_tokens, usage.completion_tokens
    assert prompt > 0 and completion > 0
    assert delta("vllm:prompt_tokens_total", model_name=model) == prompt
    assert delta("vllm:generation_tokens_total", model_name=model) == completion
    assert delta("vllm:request_success_total", model_name=model, finished_reason=finish) == 1
    for histogram in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert delta(f"{histogram}_count", model_name=model) == 1
        assert delta(f"{histogram}_bucket", model_name=model, le="+Inf") == 1
    if completion > 1:
        assert delta("vllm:time_per_output_token_seconds_count", model_name=model) == 1
        assert 1 <= delta("vllm:inter_token_latency_seconds_count", model_name=model) <= completion - 1
    for kind, tokens in (("input", prompt), ("output", completion)):
        labels = {"gen_ai_request_model": model, "gen_ai_token_type": kind}
        assert delta("gen_ai_client_token_usage_count", **labels, gen_ai_provider_name="slinfer") == 1
        assert delta("gen_ai_client_token_usage_sum", **labels) == tokens
        assert delta("slinfer_tenant_tokens_total", **labels, slinfer_tenant="local") == tokens


_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
                 "or", "unless", "offset", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (strings, label matchers, ranges, grouping
    clauses and function names left out)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for word in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        if word.group(0).lower() in _PROMQL_WORDS or expr[word.end():].lstrip().startswith("("):
            continue
        names.add(word.group(0))
    return names


def dashboard_metric_names() -> dict[str, set[str]]:
    """Each panel's (and the template variables') metric names, by title."""
    board = json.loads(DASHBOARD.read_text())
    found = {p["title"]: set().union(*(promql_metric_names(t["expr"]) for t in p["targets"]))
             for p in board["panels"]}
    for var in board["templating"]["list"]:
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        found[f"${var['name']}"] = set(re.findall(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)", query))
    return found


def test_promql_metric_names_skip_functions_labels_and_ranges():
    expr = ('histogram_quantile(0.9, sum by (le, model_name) (rate(vllm:ttft_bucket{model_name=~"$m",'
            'x="a{b}"}[$__rate_interval]))) / ignoring(le) (up or vector(0)) > bool 1')
    assert promql_metric_names(expr) == {"vllm:ttft_bucket", "up"}


# Series that appear only once a request met, or missed, its SLO: which of the two a test stack
# sees depends on the machine's speed. The code must still declare them.
_EVENT_ONLY = {"slinfer_requests_slo_met_total": tm.prometheus_name(tm.SLO_MET, "{request}") + "_total",
               "slinfer_requests_slo_violated_total":
               tm.prometheus_name(tm.SLO_VIOLATED, "{request}") + "_total"}


def test_dashboard_reads_only_metrics_the_services_export(traced_stack):
    """So the board cannot drift from the code: every metric name in its PromQL is one the
    gateway or a node exports after real traffic (a request done, one generating)."""
    _chat(traced_stack)
    node = _scrape_node_while_generating(traced_stack)
    gateway = httpx.get(f"{traced_stack.stack.url}/metrics", timeout=10).text
    exported = {name for name, _ in _values(gateway)} | {name for name, _ in _values(node)}
    wanted = dashboard_metric_names()
    assert all(wanted.values()), f"panels with no metric found: {[t for t, n in wanted.items() if not n]}"
    for name, declared in _EVENT_ONLY.items():
        assert name == declared
        exported.add(name)
    missing = {title: sorted(names - exported) for title, names in wanted.items() if names - exported}
    assert not missing, f"the dashboard reads metrics nothing exports: {missing}"
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_bucket", "slinfer_tenant_tokens_total"):
        assert any(name in names for names in wanted.values()), f"the dashboard does not show {name}"
