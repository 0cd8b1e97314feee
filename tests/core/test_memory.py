"""Eq. 2, the watermark and the ledger's budget/pessimistic/reservation-station rules."""

from shared.core.cost import m_require
from shared.core.memory import MemOpKind, MemoryLedger, watermark_target

from tests.core.factories import request


def test_m_require_uses_average_output_and_floor():
    reqs = [request("a", input_len=100, generated=10), request("b", input_len=50, generated=200, max_tokens=300)]
    # a: 100 + max(10, 64) = 164; b: 50 + max(200, 64) = 250 -> 414 tokens * 2 bytes
    assert m_require(reqs, 2, 64.0, floor_tokens=10) == 828
    assert m_require(reqs, 2, 64.0, floor_tokens=1000) == 2000  # L_min floor
    assert m_require([], 2, 64.0, floor_tokens=1000) == 2000


def test_m_require_never_counts_past_max_tokens():
    assert m_require([request("a", input_len=100, max_tokens=5)], 1, 64.0, 0) == 105


def test_watermark_scales_up_to_recommend_and_down_lazily():
    assert watermark_target(m_cur=100, m_req=200, w=0.25) == 250  # up, straight to M_recommend
    assert watermark_target(m_cur=250, m_req=200, w=0.25) is None  # enough: stay
    assert watermark_target(m_cur=250, m_req=180, w=0.25) is None  # 225*1.25 > 250: stay (lazy)
    assert watermark_target(m_cur=250, m_req=100, w=0.25) == 125  # 125*1.25 < 250: down


def test_budget_rejects_what_cannot_fit():
    ledger = MemoryLedger(100)
    ok, _ = ledger.request(MemOpKind.LOAD, "a", 70, 0.0)
    assert ok
    ok, ops = ledger.request(MemOpKind.LOAD, "b", 40, 0.0)
    assert not ok and ops == [] and ledger.budget == 70
    assert ledger.fits("b", 30) and not ledger.fits("b", 31)


def test_parked_op_absorbs_later_demand_and_load_can_be_cancelled():
    ledger = MemoryLedger(100)
    ok, ops = ledger.request(MemOpKind.LOAD, "a", 90, 0.0)
    ok2, ops2 = ledger.request(MemOpKind.SCALE, "a", 50, 0.0)  # a load runs; scale queues behind
    assert ok and ok2 and len(ops) == 1 and ops2 == []
    ok, ops = ledger.request(MemOpKind.LOAD, "b", 50, 0.0)
    assert ok and ops == []  # pessimistic: a holds 90 while loading
    ok, ops = ledger.request(MemOpKind.UNLOAD, "b", 0, 0.0)  # cancelled before it started
    assert ok and ops == [] and ledger.parked()[0].instance_id == "a"
    released = ledger.complete("a", 1, 0.0)
    assert [o.bytes_after for o in released] == [50]
    assert ledger.budget == 50
