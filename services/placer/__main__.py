"""`slinfer placer`: consume the request stream and place requests on nodes."""

from __future__ import annotations

import logging
import sys

from services.placer.placer import Placer
from services.placer.settings import PlacerSettings
from shared.service import run_service


async def serve(settings: PlacerSettings, nc, redis, stop, telemetry) -> None:
    placer = Placer(settings, nc, redis, telemetry)
    await placer.start()
    logging.getLogger("slinfer.placer").info("placer ready")
    await placer.run(stop)


def main(argv: list[str] | None = None) -> int:
    return run_service("placer", PlacerSettings.from_env, lambda s: s.name, serve)


if __name__ == "__main__":
    sys.exit(main())
