"""The event loop: virtual time, ordering, and the run driver's bookkeeping."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.core.types import SLO, RequestView
from sim.engine import EventLoop, SimRequest, Usage, run
from sim.metrics import Metrics


def test_events_pop_in_time_order_and_ties_are_fifo():
    loop = EventLoop()
    loop.schedule(2.0, "b")
    loop.schedule(1.0, "a1")
    loop.schedule(1.0, "a2")  # same time as a1, scheduled later: fires after it
    loop.schedule(0.5, "z")
    kinds, times = [], []
    while (ev := loop.pop()) is not None:
        kinds.append(ev.kind)
        times.append(loop.now)
    assert kinds == ["z", "a1", "a2", "b"]
    assert times == [0.5, 1.0, 1.0, 2.0]


def test_clock_never_goes_back():
    loop = EventLoop()
    loop.schedule(3.0, "x")
    loop.pop()
    with pytest.raises(ValueError):
        loop.schedule(2.0, "late")
    ev = loop.after(0.5, "y")
    assert ev.time == 3.5


class EchoSystem:
    """Serves each request alone: first token 1 s after arrival, then one token per 0.1 s."""

    name = "echo"

    def bind(self, loop, rec):
        self.loop, self.rec = loop, rec
        self.active = 0

    def on_arrival(self, req):
        self.active += 1
        self.loop.after(1.0, "token", req)

    def handle(self, ev):
        req = ev.data
        if req.first_token_at is None:
            req.first_token_at = self.loop.now
        req.generated += 1
        if req.generated >= req.output_len:
            req.finished_at = self.loop.now
            self.active -= 1
            self.rec.request_done(req)
        else:
            self.loop.after(0.1, "token", req)

    def usage(self):
        return Usage(0, 1 if self.active else 0, 0, 0)

    def shutdown(self):
        pass


def _req(i: int, t: float, out: int) -> SimRequest:
    return SimRequest(f"r{i}", "m", 100, out, t, SLO(ttft_s=1.0, tpot_s=0.1))


def test_run_feeds_arrivals_in_order_and_stops_when_all_done():
    reqs = [_req(0, 0.0, 3), _req(1, 5.0, 1)]
    m = Metrics()
    result = run(EchoSystem(), reqs, m, horizon=100.0)
    assert reqs[0].first_token_at == pytest.approx(1.0)
    assert reqs[0].finished_at == pytest.approx(1.2)
    assert reqs[0].tpot == pytest.approx(0.1)
    assert reqs[1].finished_at == pytest.approx(6.0)
    assert all(r.slo_met for r in reqs)
    assert result.end_time == pytest.approx(6.0)  # not the horizon
    assert m.done == 2


def test_requests_unfinished_at_the_horizon_count_as_dropped():
    reqs = [_req(0, 0.0, 1000)]
    m = Metrics()
    run(EchoSystem(), reqs, m, horizon=10.0)
    assert reqs[0].dropped and not reqs[0].slo_met and m.done == 1


def test_slo_is_every_token_by_its_eq1_deadline():
    from shared.core.types import SLO
    from sim.engine import SimRequest

    # TTFT 1 s, TPOT 0.25 s: token k is due at 1 + 0.25 k.
    early = SimRequest("a", "m", 100, 3, 0.0, SLO(1.0, 0.25))
    for t in (0.2, 1.2, 1.5):  # an early first token buys slack: 0.65 s per token after it
        early.token(t)
    early.first_token_at, early.finished_at = 0.2, 1.5
    assert early.slo_met and not early.slo_met_mean_tpot
    late = SimRequest("b", "m", 100, 3, 0.0, SLO(1.0, 0.25))
    for t in (0.9, 1.3, 1.45):  # token 1 due at 1.25: late, though the mean TPOT is 0.275 s
        late.token(t)
    late.first_token_at, late.finished_at = 0.9, 1.45
    assert late.late_tokens == 1 and not late.slo_met


@given(arrival=st.floats(0, 1e5), grace=st.floats(0, 50), ttft=st.floats(0.1, 10),
       tpot=st.floats(0.01, 1), tokens=st.lists(st.floats(0, 200), min_size=1, max_size=30))
def test_a_simulated_token_is_late_exactly_when_the_cores_deadline_says(arrival, grace, ttft, tpot,
                                                                       tokens):
    """The simulator's lateness count and the core's Eq. 1 (`RequestView.deadline`) agree."""
    sim = SimRequest("r", "m", 10, len(tokens), arrival, SLO(ttft, tpot), grace_s=grace)
    late = 0
    for k, offset in enumerate(sorted(tokens)):
        core = RequestView("r", "m", 10, arrival, SLO(ttft, tpot), generated=k, grace_s=grace)
        now = arrival + offset
        late += now > core.deadline() + 1e-9
        sim.token(now)
    assert sim.late_tokens == late
