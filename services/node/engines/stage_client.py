"""An engine's link to a layer stage (services/node/engines/stage_server.py): blocking
request-reply over one TCP connection, one call at a time; a stage's KVCacheFull is raised here
as the engine's own."""

from __future__ import annotations

import socket
import threading

import torch

from .base import KVCacheFull
from .stage_wire import StageError, recv_message, send_message
from .torch_kernel import StepSpec


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
