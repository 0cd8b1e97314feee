"""`python -m services.gateway` / `slinfer gateway`: read settings from the environment and serve."""

from __future__ import annotations

import argparse
import dataclasses
import sys

import uvicorn

from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings
from shared import telemetry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slinfer gateway", description=(
        "OpenAI-compatible HTTP gateway. Configured by SLINFER_* environment variables "
        "(see services/gateway/settings.py); the flags below override them."))
    parser.add_argument("--host", help="bind address (SLINFER_GATEWAY_HOST)")
    parser.add_argument("--port", type=int, help="port (SLINFER_GATEWAY_PORT)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)

    try:
        # Logs (JSON by default, trace ids inside a request), traces and metrics, from OTEL_*.
        tel = telemetry.setup("gateway", level=args.log_level.upper())
        settings = GatewaySettings.from_env()
        overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
        settings = dataclasses.replace(settings, **overrides)
    except ValueError as exc:
        print(f"slinfer gateway: configuration error: {exc}", file=sys.stderr)
        return 2
    # log_config=None: uvicorn's own loggers go through the handler telemetry installed. Its
    # access log is off: the app writes that line when a response ends (access_log.py).
    config = uvicorn.Config(create_app(settings, tel), host=settings.host, port=settings.port,
                            log_level=args.log_level, lifespan="on", timeout_graceful_shutdown=5,
                            log_config=None, access_log=False)
    server = uvicorn.Server(config)
    try:
        server.run()
    finally:
        tel.shutdown()  # flush the spans still buffered
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
