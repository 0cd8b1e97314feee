"""`python -m services.gateway` / `slinfer gateway`: read settings from the environment and serve."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

import uvicorn

from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slinfer gateway", description=(
        "OpenAI-compatible HTTP gateway. Configured by SLINFER_* environment variables "
        "(see services/gateway/settings.py); the flags below override them."))
    parser.add_argument("--host", help="bind address (SLINFER_GATEWAY_HOST)")
    parser.add_argument("--port", type=int, help="port (SLINFER_GATEWAY_PORT)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = GatewaySettings.from_env()
        overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
        settings = dataclasses.replace(settings, **overrides)
    except ValueError as exc:
        print(f"slinfer gateway: configuration error: {exc}", file=sys.stderr)
        return 2
    config = uvicorn.Config(create_app(settings), host=settings.host, port=settings.port,
                            log_level=args.log_level, lifespan="on", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
