"""Every error the gateway returns, in OpenAI's shape, from one place.

`{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`. Route code raises
`APIError` (or a helper below); the handlers registered by `install_error_handlers` turn it, and
FastAPI's own validation and routing errors, into that JSON. Nothing a client sends reaches the
client as a bare 500 trace.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("slinfer.gateway")

INVALID_REQUEST = "invalid_request_error"


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# --- the errors, named ---------------------------------------------------------------------------


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(name: str) -> APIError:
    # Same answer for "absent" and "another tenant's private model", so names never leak.
    return APIError(404, f"The model {name!r} does not exist or you do not have access to it.",
                    param="model", code="model_not_found")


def invalid_api_key() -> APIError:
    return APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"Request body is larger than the limit of {limit} bytes.",
                    code="request_too_large")


def request_dropped(detail: str | None = None) -> APIError:
    message = "The server is overloaded and dropped the request: it could not be served within its SLO."
    if detail:
        message += f" ({detail})"
    return APIError(503, message, type="server_overloaded", code="request_dropped",
                    headers={"Retry-After": "1"})


def model_not_ready(message: str) -> APIError:
    """A registered model still converting or profiling (GET /admin/models shows its progress)."""
    return APIError(503, message, type="server_error", param="model", code="model_not_ready",
                    headers={"Retry-After": "5"})


def model_failed(message: str) -> APIError:
    """A registered model whose lifecycle failed (its profiling, or its files found missing or
    broken by a load): retrying does not help, the operator must. A 500, not a 503: nothing is
    overloaded or temporarily away, and clients back off and retry on a 503."""
    return APIError(500, message, type="server_error", param="model", code="model_failed")


def backend_unavailable(detail: str) -> APIError:
    return APIError(503, f"The inference backend is unavailable: {detail}", type="server_error",
                    code="backend_unavailable")


def registry_unavailable() -> APIError:
    return APIError(503, "The model registry (Redis) is unavailable; retry shortly.",
                    type="server_error", code="registry_unavailable", headers={"Retry-After": "1"})


def request_timeout(seconds: float) -> APIError:
    return APIError(504, f"The request did not finish within {seconds:g} s and was cancelled.",
                    type="timeout_error", code="request_timeout")


def inference_failed(detail: str | None) -> APIError:
    return APIError(500, f"Inference failed: {detail or 'unknown error'}", type="server_error",
                    code="inference_error")


# --- handlers ------------------------------------------------------------------------------------


# Tags pydantic puts in an error location for a union member; they are not parameter names.
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("body", "query", "path", "header") and not out:
            continue
        elif isinstance(part, str) and part.isidentifier() and part not in _UNION_TAGS:
            out += f".{part}" if out else part
    return out or None


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """A pydantic/FastAPI error list -> one 400 naming the first offending parameter."""
    if not errors:
        return invalid_request("Invalid request.")
    first = errors[0]
    param = _loc_to_param(tuple(first.get("loc", ())))
    kind = first.get("type", "")
    if kind == "json_invalid":
        return invalid_request("We could not parse the JSON body of your request: "
                               f"{first.get('ctx', {}).get('error', first.get('msg'))}.",
                               code="invalid_json")
    if kind == "extra_forbidden":
        return invalid_request(f"Unrecognized request argument supplied: {param}", param=param,
                               code="unknown_parameter")
    if kind == "missing":
        return invalid_request(f"Missing required parameter: {param!r}.", param=param,
                               code="missing_required_parameter")
    if kind in ("model_type", "dict_type") and param is None:
        return invalid_request("The request body must be a JSON object.", code="invalid_type")
    message = first.get("msg", "invalid value")
    where = f"Invalid value for {param!r}: " if param else "Invalid request: "
    return invalid_request(where + message + ".", param=param, code="invalid_value")


def answer(request: Request, exc: Exception) -> JSONResponse:
    """The answer to a request whose handler raised `exc` (before any of its response went out):
    an `APIError` as itself, Redis unreachable as 503, anything else as a logged 500. The app's
    exception handlers give these, and the inference routes' way in (hot_routes.py) too."""
    if isinstance(exc, APIError):
        return exc.response()
    if isinstance(exc, RedisError):
        log.warning("registry unavailable on %s %s: %r", request.method, request.url.path, exc)
        return registry_unavailable().response()
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return APIError(500, "Internal server error.", type="server_error", code="internal_error").response()


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return answer(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _fastapi_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            err = APIError(404, f"Unknown route: {request.method} {request.url.path}", code="unknown_route")
        elif exc.status_code == 405:
            err = APIError(405, f"Method {request.method} not allowed on {request.url.path}",
                           code="method_not_allowed")
        else:
            err = APIError(exc.status_code, str(exc.detail), code=None)
        return err.response()

    @app.exception_handler(RedisError)
    async def _redis_down(request: Request, exc: RedisError) -> JSONResponse:
        return answer(request, exc)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return answer(request, exc)
