"""The loading-optimized format and `slinfer convert-checkpoint`: layout, alignment, round trip,
idempotence, verification."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from services.node.loader import CheckpointLoader, LoaderSettings, convert_checkpoint, read_index
from services.node.loader.checkpoint_format import ALIGNMENT, INDEX_FILE, default_checkpoint_dir
from services.node.loader.convert import main, source_tensors, verify_checkpoint
from shared.core.pipeline import layer_index
from tests.loader.conftest import odd_tensors


def _source_state(model: Path) -> dict[str, torch.Tensor]:
    state = {}
    for path in sorted(model.glob("*.safetensors")):
        state.update(load_file(path))
    return state


def _assert_bit_exact(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        other = got[name]
        assert other.dtype == tensor.dtype and other.shape == tensor.shape, name
        # Compare bytes, not values: NaN payloads and -0.0 must survive too.
        assert tensor.contiguous().view(-1).view(torch.uint8).tolist() == \
            other.contiguous().view(-1).view(torch.uint8).tolist(), name


def _load(path: Path) -> dict[str, torch.Tensor]:
    loader = CheckpointLoader(LoaderSettings(dram_bytes_per_s=1e10))
    try:
        return loader.load(path).state_dict
    finally:
        loader.close()


def test_every_tensor_round_trips_bit_exactly(odd_model):
    result = convert_checkpoint(odd_model, partition_bytes=32 << 10)
    assert result.converted and result.path == default_checkpoint_dir(odd_model)
    _assert_bit_exact(odd_tensors(), _load(odd_model))


def test_tiny_model_round_trips_and_partitions(tiny_model):
    result = convert_checkpoint(tiny_model, partition_bytes=1 << 20)
    index = result.index
    assert len(index.partitions) > 2  # ~4 MB in partitions of about 1 MB
    _assert_bit_exact(_source_state(tiny_model), _load(tiny_model))


def test_layout_is_aligned_and_packed_in_source_order(odd_model):
    index = convert_checkpoint(odd_model, partition_bytes=32 << 10).index
    for part in index.partitions:
        size = (default_checkpoint_dir(odd_model) / part.file).stat().st_size
        assert size == part.size and size % ALIGNMENT == 0
    by_file: dict[str, list] = {}
    for entry in index.tensors:
        assert entry.offset % ALIGNMENT == 0, entry
        by_file.setdefault(entry.file, []).append(entry)
    for entries in by_file.values():  # no overlaps, and each inside its partition
        entries.sort(key=lambda e: e.offset)
        for a, b in zip(entries, entries[1:]):
            assert a.offset + a.size <= b.offset
    # A tensor larger than the partition target gets a partition of its own.
    big = next(e for e in index.tensors if e.name == "f.big")
    assert [e.name for e in by_file[big.file]] == ["f.big"]
    # No decoder layers: the source order kept, file by file, by position of the data in the file.
    assert [e.name for e in index.tensors] == [t.name for t in source_tensors(odd_model)]
    assert sorted(e.name for e in index.tensors) == sorted(odd_tensors())


def test_the_head_comes_first_then_the_layers_by_number(tiny_model):
    """Run order (execute-while-load runs from a prefix of the bytes): the source files sort by
    name (layers 0, 1, 10, 11, 2, ...), the checkpoint holds the head, then layer 0, 1, 2, ..."""
    source = [t.name for t in source_tensors(tiny_model)]
    index = convert_checkpoint(tiny_model, partition_bytes=1 << 20).index
    by_position = sorted(index.tensors, key=lambda e: (e.file, e.offset))
    layers = [layer_index(e.name) for e in by_position]
    head = [e.name for e, i in zip(by_position, layers) if i is None]
    assert layers[:len(head)] == [None] * len(head) and head  # the head first
    assert layers[len(head):] == sorted(layers[len(head):])  # then layer by layer
    assert head == [n for n in source if layer_index(n) is None]  # each in source order
    assert sorted(e.name for e in index.tensors) == sorted(source)


def test_second_conversion_does_nothing(odd_model):
    first = convert_checkpoint(odd_model)
    stamps = {p: p.stat().st_mtime_ns for p in first.path.iterdir()}
    second = convert_checkpoint(odd_model)
    assert not second.converted and second.index == first.index
    assert {p: p.stat().st_mtime_ns for p in first.path.iterdir()} == stamps


def test_a_changed_or_damaged_checkpoint_is_converted_again(odd_model):
    first = convert_checkpoint(odd_model)
    part = first.path / first.index.partitions[0].file
    os.truncate(part, 0)  # a partition of the wrong size: not a complete checkpoint
    assert read_index(first.path) is None
    assert convert_checkpoint(odd_model).converted
    # A new source (another mtime on a weight file) makes the old checkpoint stale.
    weights = next(odd_model.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    again = convert_checkpoint(odd_model)
    assert again.converted and again.index.fingerprint != first.index.fingerprint


def test_cli_is_idempotent_and_verifies(odd_model, tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert main(["--model", str(odd_model), "--out", str(out), "--verify"]) == 0
    assert capsys.readouterr().out.startswith("converted: ")
    assert main(["--model", str(odd_model), "--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith("up to date: ")
    assert (out / INDEX_FILE).is_file() and not list(tmp_path.glob(".ckpt-*"))  # no leftovers
    assert main(["--model", str(tmp_path / "missing")]) == 2


def test_verify_finds_a_flipped_byte(odd_model):
    result = convert_checkpoint(odd_model)
    assert verify_checkpoint(result.path) == []
    part = result.path / result.index.partitions[0].file
    data = bytearray(part.read_bytes())
    data[5] ^= 0xFF
    part.write_bytes(bytes(data))
    assert len(verify_checkpoint(result.path)) == 1


def test_a_directory_without_safetensors_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="safetensors"):
        convert_checkpoint(tmp_path)
