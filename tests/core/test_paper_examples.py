"""The SLINFER paper's worked examples (Fig. 14, Fig. 15, Fig. 18/19)."""

import pytest

from shared.core.admission import AdmitReason
from shared.core.config import CoreConfig
from shared.core.iteration import IterationKind, apply_iteration, choose_iteration
from shared.core.memory import MemOpKind, MemoryLedger
from shared.core.shadow import shadow_validate
from shared.core.types import InstanceView

from tests.core.factories import flat_profile, model, request
from shared.core.types import Hardware

NO_OVERESTIMATE = CoreConfig(overestimate=0.0)


def test_fig14_headroom_after_one_iteration():
    # A request whose headroom is 1.9 s runs a 0.2 s decode with a 0.25 s TPOT SLO -> 1.95 s.
    r = request("r", ttft=1.0, tpot=0.25, generated=3, arrival=1.0)
    now = 1.0 + 1.0 + 0.25 * 3 - 1.9  # chosen so that headroom(now) == 1.9
    assert r.headroom(now) == pytest.approx(1.9)
    inst = InstanceView("i2", model(), "n", requests=[r])
    choice = choose_iteration([inst], now)
    assert choice.kind is IterationKind.DECODE
    apply_iteration(choice, inst)
    assert r.headroom(now + 0.2) == pytest.approx(1.95)


def test_fig14_least_headroom_instance_runs_first():
    urgent = InstanceView("i2", model(), "n", requests=[request("a", generated=1, arrival=0.0)])
    relaxed = InstanceView("i1", model(), "n", requests=[request("b", generated=1, arrival=0.5)])
    assert choose_iteration([relaxed, urgent], now=0.6).instance_id == "i2"


def test_prefill_runs_alone_before_decodes_join():
    inst = InstanceView("i", model(), "n", requests=[request("old", generated=2), request("new")])
    choice = choose_iteration([inst], now=0.0)
    assert choice.kind is IterationKind.PREFILL and choice.request_ids == ("new",)
    apply_iteration(choice, inst)
    assert choose_iteration([inst], 0.0).request_ids == ("old", "new")


def _fig15(prefill_s: float, decode_s: float, ttft: float, existing_headroom: float, tpot: float = 0.25):
    """Instance-3 holds R1 (decoding); a neighbour instance holds R2. R5 asks to join instance-3."""
    spec = model("m")
    prof = flat_profile("m", Hardware.CPU, prefill_s=prefill_s, decode_s=decode_s)
    now = 10.0
    # R1's next token is due `existing_headroom` seconds from now.
    r1 = request("r1", ttft=1.0, tpot=tpot, generated=4, arrival=now + existing_headroom - 1.0 - tpot * 4)
    r2 = request("r2", ttft=1.0, tpot=tpot, generated=4, arrival=now + 5.0 - 1.0 - tpot * 4)
    inst3 = InstanceView("i3", spec, "n", requests=[r1])
    inst4 = InstanceView("i4", spec, "n", requests=[r2])
    r5 = request("r5", ttft=ttft, tpot=tpot, arrival=now)
    profiles = {"i3": prof, "i4": prof}
    return shadow_validate([inst3, inst4], profiles, "i3", r5, now, now, NO_OVERESTIMATE)


def test_fig15_case1_new_request_misses_ttft():
    assert _fig15(prefill_s=0.8, decode_s=0.01, ttft=0.5, existing_headroom=5.0) is AdmitReason.TTFT_MISS


def test_fig15_case2_existing_request_pushed_past_deadline():
    # R1's next token is due in 0.2 s. Instance-3 is picked (least headroom) and runs R5's
    # prefill first (0.4 s, alone); R5 makes its 0.5 s TTFT, but R1's token now comes at 0.41 s.
    assert _fig15(prefill_s=0.4, decode_s=0.01, ttft=0.5, existing_headroom=0.2) is AdmitReason.HEADROOM


def test_fig15_case3_aggregate_decode_round_exceeds_tpot():
    # Two instances decoding at 0.13 s each: a round takes 0.26 s > 0.25 s TPOT.
    assert _fig15(prefill_s=0.01, decode_s=0.13, ttft=2.0, existing_headroom=5.0) is AdmitReason.TPOT_BUDGET


def test_fig15_all_clear_admits():
    assert _fig15(prefill_s=0.1, decode_s=0.02, ttft=1.0, existing_headroom=2.0) is AdmitReason.ADMITTED


def test_fig18_hazard_avoided_by_fig19_flow():
    """A shrinks 60->40 while B grows 40->60 on a 100-unit node. Executed blindly, A still holds
    60 while B already holds 60: 120%. The ledger parks B until A's scale-down completes."""
    ledger = MemoryLedger(100)
    for iid, size in (("A", 60), ("B", 40)):
        ok, ops = ledger.request(MemOpKind.LOAD, iid, size, 0.0)
        assert ok
        for op in ops:
            ledger.complete(op.instance_id, op.op_id, 0.0)
    ok, down = ledger.request(MemOpKind.SCALE, "A", 40, 1.0)
    assert ok and [o.instance_id for o in down] == ["A"]  # scale-down runs at once
    ok, up = ledger.request(MemOpKind.SCALE, "B", 60, 1.0)
    assert ok and up == []  # approved by the optimistic budget (40 + 60 = 100) ...
    assert [o.instance_id for o in ledger.parked()] == ["B"]  # ... but parked: A still holds 60
    assert ledger.pessimistic <= 100
    released = ledger.complete("A", down[0].op_id, 0.0)
    assert [o.instance_id for o in released] == ["B"]
    assert ledger.pessimistic == 100
