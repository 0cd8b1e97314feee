"""The stage wire format and the pure parts of a step (no process, no model)."""

from __future__ import annotations

import socket
import struct
import threading

import msgpack
import pytest
import torch

from services.node.engines.kv_cache import PagedKVCache
from services.node.engines.stage_wire import export_kv, import_kv, recv_message, send_message
from services.node.engines.torch_kernel import StepSpec
from services.node.engines.weights import layer_of


def test_message_round_trip_keeps_bytes_dtypes_and_shapes():
    a, b = socket.socketpair()
    tensors = [torch.randn(3, 5, 7).to(torch.bfloat16), torch.arange(6).view(2, 3),
               torch.empty(0, 4), torch.randn(1, 1, 512)]
    sender = threading.Thread(target=send_message, args=(a, {"op": "forward", "ids": ["x"]},
                                                          tensors))
    sender.start()
    header, got = recv_message(b)
    sender.join()
    assert header == {"op": "forward", "ids": ["x"]}
    assert [t.dtype for t in got] == [t.dtype for t in tensors]
    assert [t.shape for t in got] == [t.shape for t in tensors]
    assert all(torch.equal(x, y) for x, y in zip(got, tensors))
    a.close()
    b.close()


def test_a_frame_whose_sizes_disagree_is_refused():
    a, b = socket.socketpair()
    head = msgpack.packb({"op": "x", "_t": [["float32", [4]]]})
    a.sendall(struct.pack("!II", len(head), 1) + head + struct.pack("!Q", 8) + bytes(8))
    with pytest.raises(ValueError, match="buffer of 8 bytes"):
        recv_message(b)
    a.close()
    b.close()


def test_a_closed_link_is_a_connection_error():
    a, b = socket.socketpair()
    a.close()
    with pytest.raises(ConnectionError):
        recv_message(b)
    b.close()


def test_layer_of_names():
    assert layer_of("model.layers.12.mlp.up_proj.weight") == 12
    assert layer_of("model.embed_tokens.weight") is None
    assert layer_of("lm_head.weight") is None


def test_step_spec_checks_its_rows():
    with pytest.raises(ValueError):
        StepSpec("prefill", ("a", "b"), (0, 0), (3, 3))
    with pytest.raises(ValueError):
        StepSpec("decode", ("a",), (4,), (2,))
    with pytest.raises(ValueError):
        StepSpec("sideways", ("a",), (0,), (1,))
    spec = StepSpec("decode", ("a", "b", "c"), (4, 9, 2), (1, 1, 1))
    assert spec.rows([2, 0]) == StepSpec("decode", ("c", "a"), (2, 4), (1, 1))
    assert spec.positions(torch.device("cpu")).tolist() == [[4], [9], [2]]


def test_kv_export_import_moves_exactly_the_requests_tokens():
    src = PagedKVCache(3, 8, 4, 2, 8, torch.float32, "cpu")
    src.reserve({"a": 6, "b": 3})
    for layer in range(3):
        for rid, n in (("a", 6), ("b", 3)):
            slots = src.slots(rid, 0, n)
            src.write(layer, slots, torch.randn(n, 2, 8), torch.randn(n, 2, 8))
    dst = PagedKVCache(2, 8, 4, 2, 8, torch.float32, "cpu")
    dst.reserve({"z": 5})  # another request first: the moved ones land in other blocks
    moved = export_kv(src, [1, 2], ["a", "b"], [6, 3])
    import_kv(dst, [0, 1], ["a", "b"], [6, 3], moved)
    for src_layer, dst_layer in ((1, 0), (2, 1)):
        for rid, n in (("a", 6), ("b", 3)):
            table = torch.tensor([src.block_tables[rid]])
            want_k, _ = src.gather(src_layer, table)
            got_k, _ = dst.gather(dst_layer, torch.tensor([dst.block_tables[rid]]))
            assert torch.equal(got_k[0, :n], want_k[0, :n])
    assert dst.lengths["a"] == 6 and dst.lengths["b"] == 3
    with pytest.raises(ValueError):
        import_kv(dst, [0, 1], ["a"], [6], moved[:2])


def test_cache_layers_can_be_added_and_removed():
    cache = PagedKVCache(2, 4, 4, 1, 4, torch.float32, "cpu")
    per_layer = cache.bytes_per_token // 2
    assert cache.add_layers(2) == [2, 3]
    assert cache.bytes_per_token == 4 * per_layer and cache.k[3].shape == cache.k[0].shape
    marker = cache.k[2]
    remap = cache.remove_layers([0, 1])
    assert remap == {2: 0, 3: 1} and cache.k[0] is marker and cache.num_layers == 2
