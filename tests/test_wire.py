"""The msgpack wire: schema classes survive a round trip, and a malformed message says where."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import wire
from shared.cluster import model_spec
from shared.core.types import (SLO, Hardware, InstanceView, NodeView, RequestView, RunningIteration,
                               StorageView)
from shared.schemas import (CommandKind, FinishReason, InferenceRequest, ModelRecord, NodeCommand,
                            NodeReply, TokenMessage)


class Colour(enum.IntEnum):
    RED = 1
    BLUE = 2


@dataclass(frozen=True)
class Sample:
    ints: list[int]
    floats: list[float] = field(default_factory=list)
    names: tuple[str, ...] = ()
    colours: list[Colour] = field(default_factory=list)


def _request(tokens: list[int]) -> InferenceRequest:
    return InferenceRequest(request_id="r", tenant="t", model="m", prompt_token_ids=tokens,
                            max_tokens=4, arrival=1.0, ttft_slo_s=1.0, tpot_slo_s=0.1)


@given(st.lists(st.integers(min_value=-(2**63), max_value=2**64 - 1), max_size=300),
       st.lists(st.floats(allow_nan=False), max_size=20),
       st.lists(st.text(max_size=5), max_size=10),
       st.lists(st.sampled_from(Colour), max_size=10))
def test_a_round_trip_gives_back_what_was_sent(ints, floats, names, colours) -> None:
    sent = Sample(ints, floats, tuple(names), colours)
    got = wire.decode(Sample, wire.encode(sent))
    assert got == sent
    assert type(got.names) is tuple and all(type(c) is Colour for c in got.colours)


def test_a_prompt_of_a_thousand_tokens_round_trips() -> None:
    sent = _request(list(range(1000, 2024)))
    assert wire.decode(InferenceRequest, wire.encode(sent)) == sent


def test_enum_items_travel_as_their_values() -> None:
    plain = msgpack.unpackb(wire.encode(Sample([1], colours=[Colour.BLUE])), raw=False)
    assert plain["colours"] == [2] and type(plain["colours"][0]) is int


@pytest.mark.parametrize("tail", [[1, 2, "3"], [1, True], [1.5]], ids=["str", "bool", "float"])
def test_a_wrong_item_in_a_long_list_is_named_by_its_index(tail) -> None:
    plain = wire.to_plain(_request([7] * 500))
    plain["prompt_token_ids"] = [7] * 500 + tail
    where = rf"^\$\.prompt_token_ids\[{500 + len(tail) - 1}\]: expected int"
    with pytest.raises(wire.WireError, match=where):
        wire.decode(InferenceRequest, msgpack.packb(plain, use_bin_type=True))


def test_ints_in_a_float_list_become_floats() -> None:
    got = wire.from_plain(list[float], [1, 2.5])
    assert got == [1.0, 2.5] and all(type(x) is float for x in got)


# --- the compiled decoders against the reference walk --------------------------------------------
# Every schema message, valid, with a random leaf replaced by a random plain value: the compiled
# decoder must accept exactly what the reference accepts, give the same object, and fail with
# the same message (which the reference writes for both).

def _node_reply() -> NodeReply:
    spec = model_spec(ModelRecord(name="m", path="/m", weight_bytes=1 << 30, kv_bytes_per_token=1024,
                                  max_context=2048))
    requests = [RequestView(f"r{i}", "m", 300, 1.0, SLO(1.0, 0.2), generated=i) for i in range(3)]
    instance = InstanceView("m@n#1", spec, "n", kv_bytes=1 << 20, requests=requests,
                            adapters={"a": 5}, prefill_progress={"r0": 64})
    node = NodeView("n", Hardware.CPU, 1 << 34, instances=[instance], heartbeat=2.0,
                    running=RunningIteration("m@n#1", ("r1", "r2"), False),
                    storage=StorageView({"dram": 1e10}, holds={"m": "dram"}))
    final = TokenMessage("r9", 3, [4], finished=True, finish_reason=FinishReason.STOP)
    return NodeReply(True, "admitted", "m@n#1", evicted=[_request([1, 2])], node=node, final=final)


_MESSAGES = [(NodeReply, _node_reply()), (InferenceRequest, _request(list(range(40)))),
             (NodeCommand, NodeCommand(CommandKind.ADMIT, request=_request([3]), instance_id="i")),
             (Sample, Sample([1, 2], [0.5], ("x",), [Colour.RED]))]

_PLAIN = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=4) | st.binary(max_size=4) | st.sampled_from(["stop", "admitted", "cpu", 1, 2]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)


def _leaves(plain, path=()):
    """Every place in a plain tree a value can be swapped at (maps' values, lists' items)."""
    yield path
    items = plain.items() if isinstance(plain, dict) else enumerate(plain) if isinstance(plain, list) else ()
    for key, value in items:
        yield from _leaves(value, (*path, key))


def _swapped(plain, path, value):
    if not path:
        return value
    copy = dict(plain) if isinstance(plain, dict) else list(plain)
    copy[path[0]] = _swapped(plain[path[0]], path[1:], value)
    return copy


def _outcome(decode):
    try:
        return "ok", decode()
    except Exception as exc:  # the type and message, whatever it is, must match
        return type(exc).__name__, str(exc)


@settings(max_examples=400)
@given(st.sampled_from(_MESSAGES), st.data(), _PLAIN, st.booleans())
def test_the_compiled_decoder_accepts_and_refuses_what_the_reference_does(message, data, value, drop) -> None:
    cls, obj = message
    plain = wire.to_plain(obj)
    path = data.draw(st.sampled_from(list(_leaves(plain))))
    parent = plain
    for key in path[:-1]:
        parent = parent[key]
    if drop and path and isinstance(parent, dict):  # a field missing instead of a wrong one
        changed = _swapped(plain, path[:-1], {k: v for k, v in parent.items() if k != path[-1]})
    else:
        changed = _swapped(plain, path, value)
    compiled = _outcome(lambda: wire.from_plain(cls, changed))
    reference = _outcome(lambda: wire._reference(cls, changed))
    assert compiled == reference


@pytest.mark.parametrize("cls,obj", _MESSAGES, ids=[c.__name__ for c, _ in _MESSAGES])
def test_every_schema_message_round_trips_through_the_compiled_codec(cls, obj) -> None:
    blob = wire.encode(obj)
    assert wire.decode(cls, blob) == obj == wire._reference(cls, msgpack.unpackb(blob, raw=False))
