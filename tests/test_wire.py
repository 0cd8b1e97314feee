"""The msgpack wire: schema classes survive a round trip, and a malformed message says where."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared import wire
from shared.schemas import InferenceRequest


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
