"""`slinfer node`: one node worker (a CPU socket or a GPU)."""

from __future__ import annotations

import sys

from services.node.settings import NodeSettings
from services.node.worker import NodeWorker
from shared.service import run_service


async def serve(settings: NodeSettings, nc, redis, stop, telemetry) -> None:
    worker = NodeWorker(settings, nc, redis, telemetry)
    await worker.start()
    await stop.wait()
    await worker.stop()


def main(argv: list[str] | None = None) -> int:
    return run_service("node", NodeSettings.from_env, lambda s: f"node-{s.node_id}", serve)


if __name__ == "__main__":
    sys.exit(main())
