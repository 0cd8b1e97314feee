"""A layer stage: a process that hosts a contiguous range [start, end) of one model's decoder
layers, only those layers' weights and its own paged KV cache for them, and serves the engine's
iterations over one direct TCP connection per engine (the wire: stage_wire.py):

    forward(step, hidden)  -> hidden      the step's rows through the stage's layers; the stage
                                          reserves, writes and reads its own KV
    release(ids)                           free requests' KV
    resize(blocks)                         the KV pool, in blocks (the engine's block count)
    export_kv(ids) -> K/V per layer        the requests' cached K/V of the stage's layers
    import_kv(ids, lengths, K/V)           write them (a layer migration or a mode switch)
    info / memory / shutdown

Replies carry {"ok": true, ...} or {"ok": false, "type", "error"}. Run one as its own process
(the node spawns it with `spawn_stage`):

    python -m services.node.engines.stage_server --model-dir M --layers 4:8 [--port 0]

It prints one JSON line {"host", "port", "weight_bytes", "load_s"} on stdout once it listens.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .base import KVCacheFull
from .kv_cache import PagedKVCache
from .stage_wire import StageError, export_kv, import_kv, recv_message, send_message
from .torch_kernel import (DECODE_WORKSPACE_BYTES, DEFAULT_BLOCK_SIZE, StepSpec, Workspace,
                           abort_step, decoder_layer, finish_step, open_attention, reserve_step)
from .weights import DTYPES, check_supported, layer_of, partial_model, read_tensors, weight_bytes

log = logging.getLogger("slinfer.stages")


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
        check_supported(config)
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
        self.workspace = Workspace(self.cache, DECODE_WORKSPACE_BYTES)
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
    """Start `python -m services.node.engines.stage_server` for layers [start, end) and wait until it listens
    (its weights are loaded then). The process dies with this one."""
    from shared.servers import popen_tied

    argv = [sys.executable, "-m", "services.node.engines.stage_server", "--model-dir", str(model_dir),
            "--layers", f"{start}:{end}", "--host", host, "--device", device]
    if dtype:
        argv += ["--dtype", dtype]
    if threads:
        argv += ["--threads", str(threads)]
    err = open(log_path, "ab") if log_path else subprocess.DEVNULL
    root = Path(__file__).resolve().parents[3]  # the repository
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


if __name__ == "__main__":
    sys.exit(main())
