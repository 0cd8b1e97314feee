"""The simulator's --chunked-prefill: SLINFER's nodes run prefills in chunks (the core's
`CoreConfig.prefill_chunk_tokens`), and a run without it reports what it always did."""

from __future__ import annotations

from sim.cli import config_from, parser
from sim.config import SimConfig, params_of

from tests.sim.helpers import run_requests


def test_the_flag_sets_the_core_setting_and_only_then_shows_in_the_report():
    on = config_from(parser().parse_args(["--chunked-prefill", "--prefill-chunk-min", "32"]))
    off = config_from(parser().parse_args([]))
    assert on.core_config().prefill_chunk_tokens == 32 and params_of(on)["prefill_chunk_tokens"] == 32
    assert off.core_config().prefill_chunk_tokens == 0 and "prefill_chunk_tokens" not in params_of(off)
    assert SimConfig().prefill_chunk_tokens == 0


def _run(chunk: int):
    # One CPU node, one 7B model: a short prompt decoding when a 3000-token one arrives.
    sys_, requests, metrics, _ = run_requests(
        "slinfer", "7b", 1, 0, 1, [(0.0, 0, 100, 40), (0.5, 0, 3000, 10)],
        prefill_chunk_tokens=chunk)
    return requests, metrics


def test_a_long_prompt_is_prefilled_in_chunks_and_every_request_finishes():
    _, whole_metrics = _run(0)
    chunked, chunked_metrics = _run(64)
    assert whole_metrics.counters["prefill_iterations"] == 2
    assert chunked_metrics.counters["prefill_iterations"] > 2  # the long prompt in chunks
    for r in chunked:
        assert r.finished_at is not None and r.generated == r.output_len
