"""The multicast's data, without processes: how a checkpoint is cut into blocks, the repair plan
after a lost node, and the manifest's CRC chain against the checkpoint index."""

from __future__ import annotations

import zlib
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.node.loader import CheckpointLoader, LoaderSettings
from services.node.loader.checkpoint_format import read_index
from services.node.multicast_transfer import Manifest, MulticastError, build_manifest
from shared.core.multicast import (DEFAULT_BLOCKS, Block, binomial_schedule, binomial_steps,
                                   cut_blocks, kway_orders, kway_schedule, repair_schedule,
                                   steps_of, subgroups)

ALIGN = 4096


def _tiles(blocks: list[Block], partitions: list[tuple[str, int]]) -> None:
    by_file = defaultdict(list)
    for i, b in enumerate(blocks):
        assert b.index == i and b.size > 0 and b.start % ALIGN == 0
        by_file[b.file].append(b)
    for file, size in partitions:
        position = 0
        for b in by_file.pop(file, []):
            assert b.start == position  # in order, no gap, no overlap
            position = b.end
        assert position == size
    assert not by_file


@st.composite
def layouts(draw):
    """Partitions of aligned tensors, some much larger than a block (an embedding)."""
    partitions, starts = [], {}
    for p in range(draw(st.integers(1, 4))):
        offsets, position = [], 0
        for _ in range(draw(st.integers(1, 40))):
            offsets.append(position)
            position += ALIGN * draw(st.one_of(st.integers(1, 50), st.integers(500, 3000)))
        partitions.append((f"part-{p}", position))
        starts[f"part-{p}"] = offsets
    return partitions, starts, draw(st.integers(1, 48))


@given(layouts())
@settings(max_examples=200, deadline=None)
def test_blocks_tile_every_partition_and_number_about_the_requested_count(layout):
    partitions, starts, blocks = layout
    cut = cut_blocks(partitions, starts, blocks, ALIGN)
    _tiles(cut, partitions)
    assert len(cut) <= blocks + len(partitions)
    # No block is much larger than an even share of its partition (a big tensor is split):
    # each cut is at most a quarter share away from its ideal place (or one page, aligned).
    for file, size in partitions:
        n = sum(b.file == file for b in cut)
        share = size / n
        assert n >= 1
        if share >= 2 * ALIGN:
            assert all(b.size <= 1.5 * share + ALIGN for b in cut if b.file == file)


def test_cuts_move_to_a_nearby_tensor_boundary_and_split_a_tensor_only_when_none_is_near():
    # Tensors of 10 pages each except one of 100 pages at the start: 16 pages per block.
    starts = [0] + [100 * ALIGN + 10 * ALIGN * i for i in range(6)]
    size = 160 * ALIGN
    cut = cut_blocks([("p", size)], {"p": starts}, 10, ALIGN)
    inside = [b.start for b in cut if b.start not in starts]
    assert inside and all(s < 100 * ALIGN for s in inside)  # only the big tensor is split
    assert all(b.start in starts for b in cut if b.start >= 100 * ALIGN)


def test_the_small_models_checkpoint_is_cut_into_the_papers_sixteen_blocks(small_model):
    index = read_index(small_model / "slinfer-checkpoint")
    starts = defaultdict(list)
    for t in index.tensors:
        starts[t.file].append(t.offset)
    cut = cut_blocks([(p.file, p.size) for p in index.partitions], starts)
    assert len(cut) == DEFAULT_BLOCKS == 16
    _tiles(cut, [(p.file, p.size) for p in index.partitions])
    sizes = [b.size for b in cut]
    assert max(sizes) <= 1.6 * min(sizes)


def _replay(have: list[set[int]], schedule) -> list[set[int]]:
    have = [set(h) for h in have]
    by_step = defaultdict(list)
    for t in schedule:
        by_step[t.step].append(t)
    assert sorted(by_step) == list(range(len(by_step)))
    for step in sorted(by_step):
        sends = by_step[step]
        assert len({t.src for t in sends}) == len(sends)  # one block out per node per step
        assert len({t.dst for t in sends}) == len(sends)  # one block in per node per step
        for t in sends:
            assert t.block in have[t.src] and t.block not in have[t.dst]
        for t in sends:
            have[t.dst].add(t.block)
    return have


@given(st.integers(1, 20), st.lists(st.sets(st.integers(0, 19)), min_size=2, max_size=9))
@settings(max_examples=300, deadline=None)
def test_a_repair_plan_completes_every_survivor_from_any_holdings(blocks, holdings):
    order = list(range(blocks))
    have = [{b for b in h if b < blocks} for h in holdings]
    if not set(order) <= set().union(*have):
        with pytest.raises(ValueError, match="held by no node"):
            repair_schedule(have, order)
        return
    schedule = repair_schedule(have, order)
    assert all(h == set(order) for h in _replay(have, schedule))
    missing = sum(blocks - len(h) for h in have)
    assert len(schedule) == missing  # no block is sent twice to a node
    # At least one transfer per step, and never slower than the neediest node alone.
    assert max(blocks - len(h) for h in have) <= steps_of(schedule) <= missing


def test_a_repair_after_a_lost_node_is_no_longer_than_starting_over():
    """A destination lost after 6 steps of 1 -> 8 with 16 blocks: the survivors finish from
    what they hold in no more steps than a fresh binomial pipeline to the 6 of them."""
    order = list(range(16))
    have = [set(order)] + [set() for _ in range(7)]
    for t in binomial_schedule(8, order):
        if t.step < 6:
            have[t.dst].add(t.block)
    survivors = [h for i, h in enumerate(have) if i != 3]
    schedule = repair_schedule(survivors, order)
    assert all(h == set(order) for h in _replay(survivors, schedule))
    assert steps_of(schedule) <= steps_of(binomial_schedule(7, order))


@pytest.mark.parametrize("n,k,blocks", [(5, 1, 16), (6, 2, 16), (8, 2, 4), (9, 3, 10),
                                        (4, 4, 8)])
def test_a_kway_plan_runs_one_binomial_pipeline_per_subgroup_in_its_shifted_order(n, k, blocks):
    order = list(range(blocks))
    schedule = kway_schedule(n, k, blocks)
    if k == 1:
        assert schedule == sorted(binomial_schedule(n, order), key=lambda t: (t.step, t.src))
    start = [set(order) if i < k else set() for i in range(n)]
    assert all(h == set(order) for h in _replay(start, schedule))
    groups = subgroups(n, k)
    assert steps_of(schedule) == max((binomial_steps(len(g), blocks) for g in groups), default=0)
    for group, shifted in zip(groups, kway_orders(blocks, k)):
        members = set(group)
        assert all((t.src in members) == (t.dst in members) for t in schedule
                   if t.src in members or t.dst in members)  # sub-groups exchange nothing
        firsts = [t.block for t in schedule if t.src == group[0] and t.step == 0]
        if len(group) > 1:
            assert firsts == [shifted[0]]  # each source starts on its own chunk


@pytest.fixture(scope="module")
def host(small_model):
    loader = CheckpointLoader(LoaderSettings(dram_cache_bytes=1 << 30, dram_bytes_per_s=1e10))
    try:
        yield loader.host_checkpoint(small_model)
    finally:
        loader.close()


def test_the_manifests_crc_chain_ends_at_the_indexs_partition_crc(host, small_model):
    manifest = build_manifest(host, str(small_model))
    assert manifest.problems() == []
    assert manifest.bytes == host.index.file_bytes
    part = host.index.partitions[0]
    assert manifest.blocks[0].crc_start == 0 and manifest.blocks[-1].crc_end == part.crc32
    wire = Manifest.from_wire(manifest.to_wire())
    assert wire == manifest
    # A chain with a link broken, or a block left out, is refused.
    b = manifest.blocks[5]
    broken = manifest.to_wire()
    broken["blocks"][5] = [b.index, b.file, b.start, b.end, b.crc_start ^ 1, b.crc_end]
    assert any("block 5" in p for p in Manifest.from_wire(broken).problems())
    short = manifest.to_wire()
    del short["blocks"][-1]
    assert Manifest.from_wire(short).problems()


def test_a_source_whose_memory_differs_from_the_index_refuses_to_offer(small_model):
    loader = CheckpointLoader(LoaderSettings(dram_cache_bytes=0, dram_bytes_per_s=1e10))
    try:
        host = loader.host_checkpoint(small_model)
        buffer = next(iter(host.buffers.values()))
        buffer[12345] ^= 0xFF
        with pytest.raises(MulticastError, match="the index says"):
            build_manifest(host, str(small_model))
        buffer[12345] ^= 0xFF
        assert build_manifest(host, str(small_model)).problems() == []
    finally:
        loader.close()


def test_block_checksums_are_the_running_crc_of_the_partition(host, small_model):
    manifest = build_manifest(host, str(small_model), blocks=7)
    view = memoryview(next(iter(host.buffers.values())).numpy())
    for b in manifest.blocks:
        assert zlib.crc32(view[b.start:b.end], b.crc_start) == b.crc_end
    assert zlib.crc32(view[:manifest.blocks[3].end]) == manifest.blocks[3].crc_end
