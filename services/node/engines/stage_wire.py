"""What crosses a layer stage's link (services/node/engines/stage_server.py): every message is a
frame `!II` (header bytes, buffer count), a msgpack header, then each buffer as `!Q` length + raw
bytes (a tensor's memory, sent with one sendall and received with recv_into straight into a fresh
tensor: no encoding); the header lists each buffer's dtype and shape. Also the requests' K/V of
some layers, out of a paged cache and into one, as the tensors such a message carries."""

from __future__ import annotations

import socket
import struct

import msgpack
import torch

from .kv_cache import PagedKVCache

FRAME = struct.Struct("!II")  # header bytes, number of buffers
LENGTH = struct.Struct("!Q")
MAX_HEADER_BYTES = 16 << 20
MAX_BUFFERS = 1 << 16


class StageError(RuntimeError):
    """A stage refused a call for a reason other than a full KV cache, or its link broke."""



def send_message(sock: socket.socket, header: dict, tensors: list[torch.Tensor] = ()) -> None:
    tensors = [t.detach().to("cpu").contiguous() for t in tensors]
    meta = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]
    head = msgpack.packb({**header, "_t": meta}, use_bin_type=True)
    sock.sendall(FRAME.pack(len(head), len(tensors)) + head)
    for t in tensors:
        raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        sock.sendall(LENGTH.pack(raw.numel()))
        if raw.numel():
            sock.sendall(memoryview(raw.numpy()))


def recv_message(sock: socket.socket) -> tuple[dict, list[torch.Tensor]]:
    """One message; ConnectionError when the peer closed (cleanly between messages or not)."""
    head_len, count = FRAME.unpack(_recv_bytes(sock, FRAME.size))
    if head_len > MAX_HEADER_BYTES or count > MAX_BUFFERS:
        raise ValueError(f"frame too large: header {head_len} bytes, {count} buffers")
    header = msgpack.unpackb(_recv_bytes(sock, head_len), raw=False)
    meta = header.pop("_t", [])
    if not isinstance(header, dict) or len(meta) != count:
        raise ValueError("malformed frame header")
    tensors = []
    for dtype_name, shape in meta:
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {dtype_name!r}")
        (size,) = LENGTH.unpack(_recv_bytes(sock, LENGTH.size))
        expected = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if size != expected:
            raise ValueError(f"buffer of {size} bytes for a {dtype_name}{shape} tensor")
        raw = torch.empty(size, dtype=torch.uint8)
        if size:
            _recv_into(sock, memoryview(raw.numpy()))
        tensors.append(raw.view(dtype).view(shape) if size else torch.empty(shape, dtype=dtype))
    return header, tensors


def _recv_bytes(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("stage link closed")
        got += n


def export_kv(cache: PagedKVCache, kv_layers: list[int], ids: list[str], lengths: list[int]
              ) -> list[torch.Tensor]:
    """K and V of `ids`' first `lengths` tokens in each of `kv_layers`, rows concatenated in
    request order: [K_0, V_0, K_1, V_1, ...], each [sum(lengths), kv_heads, head_dim]."""
    slots = _slots(cache, ids, lengths)
    out = []
    for kv in kv_layers:
        for pool in (cache.k[kv], cache.v[kv]):
            out.append(pool.view(-1, cache.n_kv_heads, cache.head_dim).index_select(0, slots))
    return out


def import_kv(cache: PagedKVCache, kv_layers: list[int], ids: list[str], lengths: list[int],
              tensors: list[torch.Tensor]) -> None:
    """Write what `export_kv` gave into `cache` (reserving the requests' blocks first)."""
    if len(tensors) != 2 * len(kv_layers):
        raise ValueError(f"{len(tensors)} K/V tensors for {len(kv_layers)} layers")
    cache.reserve(dict(zip(ids, lengths)))
    slots = _slots(cache, ids, lengths)
    for i, kv in enumerate(kv_layers):
        k, v = tensors[2 * i], tensors[2 * i + 1]
        if k.shape[0] != slots.numel() or v.shape != k.shape:
            raise ValueError(f"K/V of {k.shape[0]} tokens for {slots.numel()} slots")
        cache.write(kv, slots, k.to(cache.device), v.to(cache.device))
    for rid, n in zip(ids, lengths):
        cache.set_length(rid, max(n, cache.lengths.get(rid, 0)))


def _slots(cache: PagedKVCache, ids: list[str], lengths: list[int]) -> torch.Tensor:
    parts = [cache.slots(rid, 0, n) for rid, n in zip(ids, lengths) if n]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=cache.device)
