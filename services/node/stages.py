"""Layer stages: an instance's decoder layers run across processes (λScale's execution pipelines,
CoCoServe's module replication and migration).

A *stage* is a process that hosts a contiguous range [start, end) of one model's decoder layers:
only those layers' weights (read from the converted checkpoint's partitions, else the safetensors
files: those tensors' bytes only) and its own paged KV cache for those layers. It serves, over one
direct TCP connection per engine, the same iterations the torch engine runs:

    forward(step, hidden)  -> hidden      the step's rows through the stage's layers; the stage
                                          reserves, writes and reads its own KV (StepSpec says
                                          which requests, from which position, how many tokens)
    release(ids)                           free requests' KV
    resize(blocks)                         the KV pool, in blocks (the engine's block count)
    export_kv(ids) -> K/V per layer        the requests' cached K/V of the stage's layers
    import_kv(ids, lengths, K/V)           write them (a layer migration or a mode switch)
    info / memory / shutdown

Wire: every message is a frame `!II` (header bytes, buffer count), a msgpack header, then each
buffer as `!Q` length + raw bytes (a tensor's memory, sent with one sendall and received with
recv_into straight into a fresh tensor: no encoding). The header lists each buffer's dtype and
shape. Replies carry {"ok": true, ...} or {"ok": false, "type", "error"}; a KVCacheFull on the
stage is a KVCacheFull on the engine, so the node scheduler's scale-up path works unchanged.

The engine side is `Split` (used by `TorchEngine.split`): which layers run where. Each layer has
one primary executor (this process, or a stage link); a range of local layers may also have
replica stages (CoCoServe): each request is assigned to one executor of the range when it is
first computed, and keeps it (its K/V of those layers live there), so a decode batch is split
among the replicas, which run concurrently. Layers move with their K/V: `shed` (local -> a stage
that has loaded them: migration under memory pressure), `take` (stage -> local once this process
has the weights: λScale's mode switch), `replicate` / `drop_replica`.

Mode switch choice: the local instance *receives* the remote layers' K/V (export_kv) rather than
recomputing it from the tokens. Receiving is exact (the bytes the stage computed, so greedy output
cannot change at the switch) and costs one transfer of n tokens x the moved layers' K/V (64 KiB a
token for all 16 layers of llama-3.2-1b in float32) over a link that already carries activations,
while recomputing is a prefill of every request's whole context through those layers on the
node's own cores, seconds on a CPU for long contexts, during which nothing decodes.

Run one stage as its own process (the node spawns it with `spawn_stage`):

    python -m services.node.stages --model-dir M --layers 4:8 [--port 0] [--dtype bfloat16]

It prints one JSON line {"host", "port", "weight_bytes", "load_s"} on stdout once it listens.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import torch

from services.node.engines.base import KVCacheFull
from services.node.engines.kv_cache import PagedKVCache
from services.node.engines.torch_engine import (
    DECODE_WORKSPACE_BYTES, DEFAULT_BLOCK_SIZE, DTYPES, StepSpec, _check_supported,
    _config_dtype, _rebuild_meta_buffers, _Workspace, abort_step, decoder_layer, finish_step,
    open_attention, reserve_step)
from services.node.loader.checkpoint_format import default_checkpoint_dir, read_index

log = logging.getLogger("slinfer.stages")

FRAME = struct.Struct("!II")  # header bytes, number of buffers
LENGTH = struct.Struct("!Q")
MAX_HEADER_BYTES = 16 << 20
MAX_BUFFERS = 1 << 16
LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")


class StageError(RuntimeError):
    """A stage refused a call for a reason other than a full KV cache, or its link broke."""


# -- wire --------------------------------------------------------------------------------------


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


# -- weights -----------------------------------------------------------------------------------


def layer_of(name: str) -> int | None:
    """The decoder layer a checkpoint tensor belongs to (None: embeddings, final norm, head)."""
    match = LAYER_NAME.match(name)
    return int(match.group(1)) if match else None


def read_tensors(model_dir: str | Path, wanted: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """The checkpoint tensors whose names `wanted` accepts, reading only their bytes: from the
    converted checkpoint's partitions when there is one (one pread per tensor), else from the
    safetensors files (safetensors reads a tensor's own byte range)."""
    model_dir = Path(model_dir)
    ckpt = default_checkpoint_dir(model_dir)
    index = read_index(ckpt)
    out: dict[str, torch.Tensor] = {}
    if index is not None:
        fds: dict[str, int] = {}
        try:
            for entry in index.tensors:
                if not wanted(entry.name):
                    continue
                fd = fds.get(entry.file)
                if fd is None:
                    fd = fds[entry.file] = os.open(ckpt / entry.file, os.O_RDONLY)
                raw = torch.empty(entry.size, dtype=torch.uint8)
                view = memoryview(raw.numpy())
                got = 0
                while got < entry.size:
                    n = os.preadv(fd, [view[got:]], entry.offset + got)
                    if n <= 0:
                        raise OSError(f"{ckpt / entry.file} ends inside {entry.name}")
                    got += n
                out[entry.name] = raw.view(getattr(torch, entry.dtype)).view(entry.shape)
        finally:
            for fd in fds.values():
                os.close(fd)
        return out
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds neither a converted checkpoint nor safetensors")
    for path in files:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                if wanted(name):
                    out[name] = f.get_tensor(name)
    return out


def partial_model(config, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None,
                  device: torch.device, local: Callable[[str], bool]) -> torch.nn.Module:
    """The model built on the meta device with `tensors` as its parameters (assign: on CPU they
    are the tensors read, no copy); parameters `local` rejects stay on the meta device (no
    memory). ValueError when a parameter `local` accepts is missing."""
    from transformers import AutoModelForCausalLM

    state = dict(tensors)
    dtype = dtype or _config_dtype(config, state)
    state = {k: t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device)
             for k, t in state.items()}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    _rebuild_meta_buffers(model, config, device)
    if missing := [n for n, p in model.named_parameters() if p.is_meta and local(n)]:
        raise ValueError(f"the checkpoint lacks {missing[:5]}")
    return model.eval()


def assign_layers(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor],
                  device: torch.device, dtype: torch.dtype) -> None:
    """Give a partial model the parameters in `tensors` (layers it now holds)."""
    state = {k: t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device)
             for k, t in tensors.items()}
    model.load_state_dict(state, strict=False, assign=True)


def drop_layers(model: torch.nn.Module, layers: range) -> None:
    """Hand back the memory of decoder layers this process no longer runs (meta parameters)."""
    for i in layers:
        model.model.layers[i].to("meta")


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)


def holding_of(index, blocks: list, held: set[int], node: str = ""):
    """What a node receiving a checkpoint by multicast can run now (shared.core.pipeline): the
    layers, and the head, whose every byte lies in the `held` blocks of `index`'s partitions."""
    from shared.core.pipeline import TensorSpan, layers_held

    spans = [TensorSpan(t.name, t.file, t.offset, t.offset + t.size) for t in index.tensors]
    return layers_held(spans, blocks, held, node)


def held_tensors(host, holding) -> dict[str, torch.Tensor]:
    """Views of the tensors of a partly received host checkpoint (`HostCheckpoint`) that the
    node holds whole (`holding_of`): what a head engine (`weights=`) or an in-process stage
    (`LayerStage(tensors=)`) may use; never a tensor with bytes still missing."""
    views = host.tensors(torch.device("cpu"))
    return {n: t for n, t in views.items()
            if ((i := layer_of(n)) is None and holding.head) or i in holding.layers}


# -- K/V moves ---------------------------------------------------------------------------------


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


# -- the stage process -------------------------------------------------------------------------


class LayerStage:
    """Decoder layers [start, end) of a model with their own paged KV cache (one process)."""

    def __init__(self, model_dir: str | Path, start: int, end: int, device: str = "cpu",
                 dtype: str | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
                 tensors: Mapping[str, torch.Tensor] | None = None) -> None:
        """`tensors`: the layers' weights by checkpoint name (e.g. views of the blocks a node
        received by multicast so far); None: read from the model's checkpoint files."""
        from transformers import AutoConfig

        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)} or None, not {dtype!r}")
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        _check_supported(config)
        if not 0 <= start < end <= config.num_hidden_layers:
            raise ValueError(f"layers {start}:{end} are not a range of the model's "
                             f"{config.num_hidden_layers}")
        started = time.perf_counter()
        self.model_dir, self.start, self.end = Path(model_dir), start, end
        self.device = torch.device(device)
        mine = lambda n: (i := layer_of(n)) is not None and start <= i < end  # noqa: E731
        if tensors is None:
            tensors = read_tensors(model_dir, mine)
        else:
            tensors = {k: t for k, t in tensors.items() if mine(k)}
        self.model = partial_model(config, tensors, DTYPES.get(dtype or ""), self.device, mine)
        self.layers = self.model.model.layers
        self.rotary = self.model.model.rotary_emb
        self.dtype = next(self.layers[start].parameters()).dtype
        self.load_s = time.perf_counter() - started
        self.weight_bytes = weight_bytes(self.model)
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)
        self.cache = PagedKVCache(end - start, 0, block_size, config.num_key_value_heads,
                                  head_dim, self.dtype, self.device)
        self.workspace = _Workspace(self.cache, DECODE_WORKSPACE_BYTES)
        self.config = config
        # Seconds its forwards ran, all told: its host samples it to measure the stage's share
        # of its compute (services/node/layer_moves.py).
        self.forward_s = 0.0

    def info(self) -> dict:
        return {"start": self.start, "end": self.end, "block_size": self.cache.block_size,
                "dtype": str(self.dtype).removeprefix("torch."),
                "hidden_size": self.config.hidden_size, "weight_bytes": self.weight_bytes,
                "kv_block_bytes": self.cache.block_bytes, "load_s": self.load_s,
                "model_dir": str(self.model_dir)}

    def memory(self) -> dict:
        c = self.cache
        return {"weight_bytes": self.weight_bytes, "kv_blocks": c.num_blocks,
                "kv_used_blocks": c.used_blocks, "kv_block_bytes": c.block_bytes}

    def forward(self, spec: StepSpec, hidden: torch.Tensor, last_only: bool) -> torch.Tensor:
        started = time.perf_counter()
        try:
            return self._forward(spec, hidden, last_only)
        finally:
            self.forward_s += time.perf_counter() - started

    @torch.inference_mode()
    def _forward(self, spec: StepSpec, hidden: torch.Tensor, last_only: bool) -> torch.Tensor:
        hidden = hidden.to(self.device, self.dtype)
        positions = spec.positions(self.device)
        cos, sin = self.rotary(hidden, positions)
        reserve_step(self.cache, spec)
        try:
            attention = open_attention(self.cache, spec, self.workspace)
            for index in range(self.start, self.end):
                hidden = decoder_layer(index, index - self.start, self.layers[index], hidden,
                                       cos, sin, attention)
        except BaseException:
            abort_step(self.cache, spec)
            raise
        finish_step(self.cache, spec)
        return hidden[:, -1:] if last_only else hidden

    def handle(self, header: dict, tensors: list[torch.Tensor]) -> tuple[dict, list]:
        op = header.get("op")
        if op == "forward":
            spec = StepSpec(header["kind"], tuple(header["ids"]), tuple(header["starts"]),
                            tuple(header["counts"]))
            if len(tensors) != 1:
                raise ValueError("forward takes one tensor: the hidden states")
            return {}, [self.forward(spec, tensors[0], bool(header.get("last_only")))]
        if op == "release":
            for rid in header["ids"]:
                self.cache.free(rid)
            return {}, []
        if op == "resize":
            self.cache.resize(int(header["blocks"]))
            return {}, []
        if op == "export_kv":
            ids = list(header["ids"])
            lengths = [self.cache.lengths.get(rid, 0) for rid in ids]
            kv = list(range(self.end - self.start))
            return {"lengths": lengths}, export_kv(self.cache, kv, ids, lengths)
        if op == "import_kv":
            kv = list(range(self.end - self.start))
            import_kv(self.cache, kv, list(header["ids"]), list(header["lengths"]), tensors)
            return {}, []
        if op == "info":
            return self.info(), []
        if op == "memory":
            return self.memory(), []
        raise ValueError(f"unknown op {op!r}")


def serve(stage: LayerStage, listener: socket.socket, stop: threading.Event,
          conns: set[socket.socket] | None = None) -> None:
    """Accept engines' connections; each gets a thread, calls run one at a time (the stage's
    state is one cache). A bad message answers an error and keeps the connection; a broken
    connection ends only its own thread. `conns`: the open connections are kept there (a
    server that stops closes them, so no thread keeps the stage's memory alive)."""
    lock = threading.Lock()
    listener.settimeout(0.2)
    while not stop.is_set():
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            continue
        except OSError:
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if conns is not None:
            conns.add(conn)
        threading.Thread(target=_connection, args=(stage, conn, lock, stop, conns),
                         daemon=True).start()


def _connection(stage: LayerStage, conn: socket.socket, lock: threading.Lock,
                stop: threading.Event, conns: set[socket.socket] | None = None) -> None:
    try:
        _serve_connection(stage, conn, lock, stop)
    finally:
        if conns is not None:
            conns.discard(conn)


def _serve_connection(stage: LayerStage, conn: socket.socket, lock: threading.Lock,
                      stop: threading.Event) -> None:
    with conn:
        while not stop.is_set():
            try:
                header, tensors = recv_message(conn)
            except (ConnectionError, OSError):
                return
            except Exception as exc:  # noqa: BLE001 - a malformed frame ends this link only
                log.warning("stage %s:%s: bad frame: %s", stage.start, stage.end, exc)
                return
            if header.get("op") == "shutdown":
                send_message(conn, {"ok": True})
                stop.set()
                return
            try:
                with lock:
                    reply, out = stage.handle(header, tensors)
                reply = {"ok": True, **reply}
            except KVCacheFull as exc:
                reply, out = {"ok": False, "type": "KVCacheFull", "error": str(exc)}, []
            except Exception as exc:  # noqa: BLE001 - the engine gets the reason, stage lives on
                reply, out = {"ok": False, "type": type(exc).__name__, "error": str(exc)}, []
            try:
                send_message(conn, reply, out)
            except OSError:
                return


class StageServer:
    """A stage served from a thread of this process (a node worker that holds the layers'
    bytes in its own memory, e.g. blocks received by multicast, serves them without a copy)."""

    def __init__(self, stage: LayerStage, host: str = "127.0.0.1", port: int = 0) -> None:
        self.stage = stage
        self._listener = socket.create_server((host, port))
        self.host, self.port = self._listener.getsockname()[:2]
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._thread = threading.Thread(target=serve,
                                        args=(stage, self._listener, self._stop, self._conns),
                                        name=f"stage-{stage.start}-{stage.end}", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        """Stop accepting, and end the open links (an engine still using one gets a
        StageError on its next call)."""
        self._stop.set()
        self._thread.join()
        self._listener.close()
        for conn in list(self._conns):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="host a range of a model's decoder layers")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--layers", required=True, help="start:end (end exclusive)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES))
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    if args.threads:
        torch.set_num_threads(args.threads)
    start, _, end = args.layers.partition(":")
    stage = LayerStage(args.model_dir, int(start), int(end), args.device, args.dtype,
                       args.block_size)
    listener = socket.create_server((args.host, args.port))
    host, port = listener.getsockname()[:2]
    print(json.dumps({"host": host, "port": port, "weight_bytes": stage.weight_bytes,
                      "load_s": stage.load_s}), flush=True)
    stop = threading.Event()
    try:
        serve(stage, listener, stop)
    finally:
        listener.close()
    return 0


@dataclass
class StageProcess:
    """A stage process this node started."""

    proc: subprocess.Popen
    host: str
    port: int
    weight_bytes: int
    load_s: float
    start: int
    end: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def spawn_stage(model_dir: str | Path, start: int, end: int, dtype: str | None = None,
                device: str = "cpu", host: str = "127.0.0.1", threads: int = 0,
                timeout_s: float = 300.0, log_path: Path | None = None) -> StageProcess:
    """Start `python -m services.node.stages` for layers [start, end) and wait until it listens
    (its weights are loaded then). The process dies with this one."""
    from shared.servers import popen_tied

    argv = [sys.executable, "-m", "services.node.stages", "--model-dir", str(model_dir),
            "--layers", f"{start}:{end}", "--host", host, "--device", device]
    if dtype:
        argv += ["--dtype", dtype]
    if threads:
        argv += ["--threads", str(threads)]
    err = open(log_path, "ab") if log_path else subprocess.DEVNULL
    root = Path(__file__).resolve().parents[2]
    # A stage waits for its engine between iterations and the engine for it: idle OpenMP threads
    # that spin (the default) take the cores the other process computes on. Measured on 2 cores:
    # a hop of ~190 ms with spinning threads, ~1 ms with passive ones (bench/modules.py). The
    # engine's process should run with the same setting (set before torch starts).
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    proc = popen_tied(argv, stdout=subprocess.PIPE, stderr=err, cwd=root, env=env)
    if log_path:
        err.close()
    deadline = time.monotonic() + timeout_s
    line = b""
    while not line.endswith(b"\n"):
        if proc.poll() is not None:
            raise StageError(f"stage {start}:{end} exited with {proc.returncode} before listening")
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 4096)
            line += chunk
        if time.monotonic() > deadline:
            proc.kill()
            raise StageError(f"stage {start}:{end} did not listen within {timeout_s} s")
    ready_info = json.loads(line.decode().splitlines()[0])
    return StageProcess(proc, ready_info["host"], ready_info["port"], ready_info["weight_bytes"],
                        ready_info["load_s"], start, end)


# -- the engine side ---------------------------------------------------------------------------


class StageClient:
    """One engine's link to a stage: blocking request-reply, one call at a time."""

    def __init__(self, address: str, timeout_s: float = 600.0) -> None:
        host, _, port = address.rpartition(":")
        self.address = address
        self._sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._lock = threading.Lock()
        self.broken = False
        self.info = self.call({"op": "info"})[0]
        self.start, self.end = int(self.info["start"]), int(self.info["end"])

    def call(self, header: dict, tensors: list[torch.Tensor] = ()) -> tuple[dict, list]:
        with self._lock:
            if self.broken:
                raise StageError(f"stage {self.address}: link lost earlier")
            try:
                send_message(self._sock, header, list(tensors))
                reply, out = recv_message(self._sock)
            except (OSError, ValueError) as exc:
                # The link's framing is lost: no later call on it could be trusted.
                self.broken = True
                raise StageError(f"stage {self.address}: link failed: {exc}") from exc
        if not reply.pop("ok", False):
            if reply.get("type") == "KVCacheFull":
                raise KVCacheFull(f"stage {self.address}: {reply.get('error')}")
            raise StageError(f"stage {self.address}: {reply.get('type')}: {reply.get('error')}")
        return reply, out

    def forward(self, spec: StepSpec, hidden: torch.Tensor, last_only: bool) -> torch.Tensor:
        header = {"op": "forward", "kind": spec.kind, "ids": list(spec.request_ids),
                  "starts": list(spec.starts), "counts": list(spec.counts),
                  "last_only": last_only}
        return self.call(header, [hidden])[1][0].to(hidden.device)

    def release(self, ids: list[str]) -> None:
        self.call({"op": "release", "ids": list(ids)})

    def resize(self, blocks: int) -> None:
        self.call({"op": "resize", "blocks": int(blocks)})

    def export_kv(self, ids: list[str]) -> tuple[list[int], list[torch.Tensor]]:
        reply, out = self.call({"op": "export_kv", "ids": list(ids)})
        return list(reply["lengths"]), out

    def import_kv(self, ids: list[str], lengths: list[int], tensors: list[torch.Tensor]) -> None:
        self.call({"op": "import_kv", "ids": list(ids), "lengths": list(lengths)}, tensors)

    def memory(self) -> dict:
        return self.call({"op": "memory"})[0]

    def shutdown(self) -> None:
        """Ask the stage process to exit (it answers first)."""
        try:
            self.call({"op": "shutdown"})
        except StageError:
            pass
        self.close()

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass


@dataclass
class _Link:
    client: StageClient
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1))

    @property
    def start(self) -> int:
        return self.client.start

    @property
    def end(self) -> int:
        return self.client.end

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.client.close()


@dataclass(frozen=True)
class _Run:
    start: int
    end: int
    link: _Link | None  # None: this process
    replicas: tuple[_Link, ...] = ()  # (local runs only) stages holding the same layers


@dataclass(frozen=True)
class Layout:
    """Where an instance's layers run (for the node's reports and the core)."""

    layers: int
    local: tuple[tuple[int, int], ...]  # ranges run in this process
    remote: tuple[tuple[int, int, str], ...]  # (start, end, stage address)
    replicas: tuple[tuple[int, int, str], ...]  # local ranges also on these stages
    assigned: dict[str, int] = field(default_factory=dict)  # requests per replica address


class Split:
    """Which of a torch engine's layers run where, and the runs of one forward pass."""

    def __init__(self, engine, layers: int) -> None:
        self.engine = engine
        self.layers = layers
        self.owner: list[_Link | None] = [None] * layers
        self.kv_index: list[int | None] = list(range(layers))
        self.replicas: dict[tuple[int, int], list[_Link]] = {}
        self.assigned: dict[str, dict[tuple[int, int], _Link | None]] = {}
        self.runs: list[_Run] = [_Run(0, layers, None)]

    # -- layout ---------------------------------------------------------------------------------

    def local_layers(self) -> list[int]:
        return [i for i in range(self.layers) if self.owner[i] is None]

    def links(self) -> list[_Link]:
        seen: dict[int, _Link] = {}
        for link in [*self.owner, *(r for rs in self.replicas.values() for r in rs)]:
            if link is not None:
                seen[id(link)] = link
        return list(seen.values())

    def layout(self) -> Layout:
        local, remote = [], []
        for run in self.runs:
            if run.link is None:
                local.append((run.start, run.end))
            else:
                remote.append((run.start, run.end, run.link.client.address))
        reps = tuple((a, b, r.client.address) for (a, b), rs in self.replicas.items() for r in rs)
        counts: dict[str, int] = {}
        for per in self.assigned.values():
            for link in per.values():
                if link is not None:
                    counts[link.client.address] = counts.get(link.client.address, 0) + 1
        return Layout(self.layers, _merge(local), tuple(remote), reps, counts)

    def _rebuild_runs(self) -> None:
        runs: list[_Run] = []
        i = 0
        while i < self.layers:
            link = self.owner[i]
            rng = next((r for r in self.replicas if r[0] <= i < r[1]), None) if link is None \
                else None
            j = i + 1
            if rng is not None:
                j = rng[1]
            else:
                while j < self.layers and self.owner[j] is link and \
                        (link is not None or not any(r[0] <= j < r[1] for r in self.replicas)):
                    j += 1
            reps = tuple(self.replicas[rng]) if rng is not None else ()
            runs.append(_Run(i, j, link, reps))
            i = j
        self.runs = runs

    # -- a forward pass -------------------------------------------------------------------------

    def forward(self, layers, spec: StepSpec, hidden: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, attention) -> torch.Tensor:
        for k, run in enumerate(self.runs):
            last = k == len(self.runs) - 1
            if run.link is not None:
                hidden = run.link.client.forward(spec, hidden, last_only=last)
            elif run.replicas:
                hidden = self._replicated(layers, run, spec, hidden, cos, sin, attention)
            else:
                hidden = self._local(layers, run, hidden, cos, sin, attention)
        return hidden

    def _local(self, layers, run: _Run, hidden, cos, sin, attention) -> torch.Tensor:
        for index in range(run.start, run.end):
            hidden = decoder_layer(index, self.kv_index[index], layers[index], hidden, cos, sin,
                                   attention)
        return hidden

    def _replicated(self, layers, run: _Run, spec: StepSpec, hidden, cos, sin, attention
                    ) -> torch.Tensor:
        """The batch split among the range's executors, each row where its K/V lives; the
        replicas' shares run in their processes while this one computes its own."""
        key = (run.start, run.end)
        owners = [self._executor(rid, key, run) for rid in spec.request_ids]
        groups: dict[int, list[int]] = {}
        for row, owner in enumerate(owners):
            groups.setdefault(id(owner), []).append(row)
        if len(groups) == 1 and owners[0] is None:
            return self._local(layers, run, hidden, cos, sin, attention)
        futures: list[tuple[list[int], Future]] = []
        mine: list[int] = []
        for rows in groups.values():
            owner = owners[rows[0]]
            if owner is None:
                mine = rows
                continue
            part = hidden if len(rows) == len(owners) else hidden[rows]
            futures.append((rows, owner.pool.submit(owner.client.forward, spec.rows(rows),
                                                    part.contiguous(), False)))
        out = torch.empty_like(hidden) if len(futures) > 1 or mine else None
        if mine:
            index = torch.tensor(mine, device=hidden.device)
            sub = open_attention(self.engine.cache, spec.rows(mine), self.engine._workspace)
            local = self._local(layers, run, hidden.index_select(0, index),
                                cos.index_select(0, index), sin.index_select(0, index), sub)
            out.index_copy_(0, index, local)
        for rows, future in futures:
            result = future.result()
            if out is None:
                return result
            out.index_copy_(0, torch.tensor(rows, device=hidden.device), result)
        return out

    def _executor(self, rid: str, key: tuple[int, int], run: _Run) -> _Link | None:
        per = self.assigned.setdefault(rid, {})
        if key in per:
            return per[key]
        request = self.engine.requests.get(rid)
        if request is not None and request.computed:  # its K/V of these layers is here
            per[key] = None
            return None
        load = {id(r): 0 for r in run.replicas}
        mine = 0
        for other in self.assigned.values():
            owner = other.get(key, False)
            if owner is None:
                mine += 1
            elif owner is not False and id(owner) in load:
                load[id(owner)] += 1
        best = min(run.replicas, key=lambda r: load[id(r)])
        per[key] = None if mine <= load[id(best)] else best
        return per[key]

    # -- requests -------------------------------------------------------------------------------

    def release(self, rid: str) -> None:
        per = self.assigned.pop(rid, {})
        targets = {id(link): link for link in self.owner if link is not None}
        targets.update({id(link): link for link in per.values() if link is not None})
        for link in targets.values():
            try:
                link.client.release([rid])
            except StageError as exc:  # the request is gone here; a lost stage frees itself
                log.warning("release of %s on a stage failed: %s", rid, exc)

    def resize(self, blocks: int) -> None:
        for link in self.links():
            link.client.resize(blocks)

    def check_stage(self, client: StageClient) -> None:
        info, engine = client.info, self.engine
        if Path(info["model_dir"]).resolve() != engine.model_dir.resolve() and \
                Path(info["model_dir"]).name != engine.model_dir.name:
            raise ValueError(f"stage {client.address} serves {info['model_dir']}, "
                             f"not {engine.model_dir}")
        if info["block_size"] != engine.block_size or \
                info["dtype"] != str(engine.dtype).removeprefix("torch."):
            raise ValueError(f"stage {client.address} has block size {info['block_size']} / "
                             f"dtype {info['dtype']}, the engine {engine.block_size} / "
                             f"{engine.dtype}")

    def _prefilled(self) -> tuple[list[str], list[int]]:
        ids = [rid for rid, r in self.engine.requests.items() if r.computed]
        return ids, [self.engine.requests[rid].computed for rid in ids]

    # -- moves ----------------------------------------------------------------------------------

    def attach(self, client: StageClient) -> None:
        """A stage that holds layers this process never loaded (a split from the start)."""
        self.check_stage(client)
        link = _Link(client)
        client.resize(self.engine.cache.num_blocks)
        for i in range(client.start, client.end):
            self.owner[i] = link
            self.kv_index[i] = None
        self._rebuild_runs()

    def compact(self) -> None:
        """Local layers in order at the cache's slots 0..n-1 (a split from the start)."""
        slot = 0
        for i in range(self.layers):
            if self.owner[i] is None:
                self.kv_index[i] = slot
                slot += 1
            else:
                self.kv_index[i] = None

    def shed(self, client: StageClient) -> None:
        """Migration: the stage's layers (local, not replicated) move to it with their K/V;
        this process drops their weights and K/V pools."""
        self.check_stage(client)
        rng = range(client.start, client.end)
        if any(self.owner[i] is not None for i in rng) or \
                any(a < client.end and client.start < b for a, b in self.replicas):
            raise ValueError(f"layers {client.start}:{client.end} are not all local and "
                             f"unreplicated")
        if len(self.local_layers()) == len(rng):
            raise ValueError("an instance keeps at least one decoder layer in its own process")
        cache = self.engine.cache
        client.resize(cache.num_blocks)
        ids, lengths = self._prefilled()
        kv = [self.kv_index[i] for i in rng]
        client.import_kv(ids, lengths, export_kv(cache, kv, ids, lengths))
        link = _Link(client)
        for i in rng:
            self.owner[i] = link
        self._remove_local_kv(kv)
        drop_layers(self.engine.model, rng)
        self._rebuild_runs()

    def take(self, start: int, end: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Mode switch: layers [start, end), now loaded here (`tensors`), run in this process;
        their K/V comes from the stages that ran them, which are then let go."""
        links = {id(self.owner[i]): self.owner[i] for i in range(start, end)}
        if None in links.values() or not links:
            raise ValueError(f"layers {start}:{end} are not all remote")
        if any(link.start < start or link.end > end for link in links.values()):
            raise ValueError(f"layers {start}:{end} cut a stage's range; take whole stages")
        engine = self.engine
        assign_layers(engine.model, tensors, engine.device, engine.dtype)
        if any(p.is_meta for i in range(start, end)
               for p in engine.model.model.layers[i].parameters()):
            raise ValueError(f"tensors for layers {start}:{end} are incomplete")
        ids, lengths = self._prefilled()
        for link in links.values():
            got, kv = link.client.export_kv(ids)
            if got != lengths:
                raise StageError(f"stage {link.client.address} holds {got} tokens, the engine "
                                 f"{lengths}")
            new = engine.cache.add_layers(link.end - link.start)
            import_kv(engine.cache, new, ids, lengths, kv)
            for i, slot in zip(range(link.start, link.end), new):
                self.kv_index[i] = slot
                self.owner[i] = None
            link.client.release(ids)
            link.close()
        self._rebuild_runs()

    def replicate(self, client: StageClient) -> None:
        """CoCoServe replication: the stage holds copies of local layers; requests first
        computed from now on are spread over this process and the replicas."""
        self.check_stage(client)
        key = (client.start, client.end)
        if any(self.owner[i] is not None for i in range(*key)):
            raise ValueError(f"layers {key[0]}:{key[1]} are not all local")
        if any(r != key and r[0] < key[1] and key[0] < r[1] for r in self.replicas):
            raise ValueError(f"layers {key[0]}:{key[1]} overlap another replicated range")
        client.resize(self.engine.cache.num_blocks)
        self.replicas.setdefault(key, []).append(_Link(client))
        self._rebuild_runs()

    def drop_replica(self, address: str) -> None:
        """The replica's requests get their K/V of its layers back here; it is let go."""
        for key, links in self.replicas.items():
            link = next((r for r in links if r.client.address == address), None)
            if link is not None:
                break
        else:
            raise ValueError(f"no replica at {address}")
        ids = [rid for rid, per in self.assigned.items() if per.get(key) is link]
        if ids:
            lengths, kv = link.client.export_kv(ids)
            cache = self.engine.cache
            slots = [self.kv_index[i] for i in range(*key)]
            import_kv(cache, slots, ids, lengths, kv)
            for rid in ids:
                self.assigned[rid][key] = None
            link.client.release(ids)
        links.remove(link)
        if not links:
            del self.replicas[key]
        link.close()
        self._rebuild_runs()

    def _remove_local_kv(self, kv: list[int]) -> None:
        remap = self.engine.cache.remove_layers(kv)
        self.kv_index = [None if k is None or k in kv else remap[k] for k in self.kv_index]

    def close(self) -> None:
        for link in self.links():
            link.close()


def _merge(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


if __name__ == "__main__":
    sys.exit(main())
