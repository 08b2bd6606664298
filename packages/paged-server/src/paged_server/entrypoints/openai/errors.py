"""OpenAI-style error bodies and the exception handlers that produce them.

Every error the server returns has the shape OpenAI clients parse:
``{"error": {"message", "type", "param", "code"}}``. ``param`` names the
offending request field so a client can tell *what* to fix.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("paged_server.entrypoints.openai")

# The `type` values OpenAI uses, keyed by status.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_unavailable",
}


class APIError(Exception):
    """An error with an HTTP status and an OpenAI error body.

    Raised anywhere in a request handler; the app's handler turns it into a
    JSON response, so handlers never build error responses by hand.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {...}}``."""
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error envelope."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_bytes(status: int, message: str, *, param: str | None = None, code: str | None = None) -> bytes:
    """The encoded error body, for raw ASGI middleware that has no JSONResponse."""
    body = error_body(message, _TYPES.get(status, "invalid_request_error"), param, code)
    return json.dumps(body).encode()


def _loc_to_param(loc: tuple[Any, ...] | list[Any]) -> str | None:
    """``("body", "messages", 0, "content")`` -> ``"messages[0].content"``."""
    parts = [p for p in loc if p != "body"]
    # pydantic adds the union member's type name to a location ("str", "list[int]")
    parts = [p for p in parts if not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS))]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += f".{p}" if out else str(p)
    return out or None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "function-after", "function-plain"}


def validation_error(exc: RequestValidationError) -> APIError:
    """Turn FastAPI's 422 into a 400 that names the first offending field."""
    errors = list(exc.errors())
    if not errors:
        return APIError(400, "invalid request body")
    first = _most_specific(errors)
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return APIError(
            400, f"request body is not valid JSON: {detail}".rstrip(": "), code="invalid_json"
        )
    body_level = [p for p in first.get("loc", ()) if p != "body"] == []
    if body_level and first.get("type") in ("model_attributes_type", "missing", "model_type"):
        return _body_error(first.get("input"))
    param = _loc_to_param(first.get("loc", ()))
    msg = _friendly(first)
    named = re.match(r"^([a-z_][a-z_0-9.\[\]]*): ", msg)
    if named and param is None:  # model-level validators say "field: problem"
        param, msg = named.group(1), msg[named.end() :]
    top = next((p for p in first.get("loc", ()) if p != "body"), None)
    union_hint = _UNION_HINTS.get(str(top))
    if first.get("type") == "missing":
        message = f"{param}: field required"
    elif union_hint and _is_union_failure(errors, first):
        param = str(top)
        message = f"{param}: {union_hint}"
    elif param and not msg.startswith(f"{param}: "):
        message = f"{param}: {msg}"
    else:
        message = msg
    return APIError(400, message, param=param, code="invalid_value")


def model_error(exc: ValidationError, *loc: str | int) -> APIError:
    """A 400 for a model validated by a handler (not by FastAPI), naming the
    field as ``validation_error`` does, under ``loc`` (``"input", 2``)."""
    errors = [{**e, "loc": ("body", *loc, *e["loc"])} for e in exc.errors()]
    return validation_error(RequestValidationError(errors))


def rename_param(err: APIError, names: dict[str, str]) -> APIError:
    """``err`` with its field named as another API names it (chat's
    ``max_tokens`` is the Responses API's ``max_output_tokens``); a name
    maps by its first part, so ``tools[0].function.parameters`` follows
    ``tools``' entry when it has one."""
    if err.param is None:
        return err
    head = re.split(r"[.\[]", err.param, maxsplit=1)[0]
    new = names.get(err.param) or (names[head] + err.param[len(head):] if head in names else None)
    if new is None:
        return err
    message = err.message
    if message.startswith(f"{err.param}:"):
        message = new + message[len(err.param):]
    return APIError(err.status, message, param=new, code=err.code, type=err.type, headers=err.headers)


# What a field that accepts several shapes must look like, said once.
_UNION_HINTS = {
    "prompt": "must be a string, a list of token ids, or a list of (at most 16) strings or "
    "token-id lists",
    "stop": "must be a string or a list of strings",
}


def _is_union_failure(errors: list[Any], first: Any) -> bool:
    """Several errors on one field, one per union member that did not match."""
    field = first.get("loc", ())[:2]
    return sum(1 for e in errors if tuple(e.get("loc", ()))[:2] == tuple(field)) > 1


def _body_error(raw: Any) -> APIError:
    """The body as a whole is wrong: missing, not JSON, or not an object."""
    if raw is None or raw == b"":
        return APIError(400, "request body is missing: send a JSON object", code="invalid_json")
    if isinstance(raw, bytes | str):
        try:
            json.loads(raw)
        except ValueError as exc:
            return APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json")
        return APIError(
            400,
            "request body must be sent with the header 'Content-Type: application/json'",
            code="invalid_content_type",
        )
    return APIError(400, "request body must be a JSON object", code="invalid_json")


_BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"),
           "less_than_equal": ("<=", "le"), "less_than": ("<", "lt")}
_EXPECTED = {"int_type": "an integer", "int_from_float": "an integer", "float_type": "a number",
             "bool_type": "true or false", "string_type": "a string", "list_type": "a list",
             "dict_type": "an object", "model_type": "an object", "model_attributes_type": "an object",
             "finite_number": "a finite number"}


def _shown(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, str | int | float | bool | None) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _friendly(e: Any) -> str:
    """pydantic's message, said the way this API says things: 'must be >= 1, got -1'."""
    kind, ctx = e.get("type"), e.get("ctx") or {}
    if kind in _BOUNDS:
        op, key = _BOUNDS[kind]
        return f"must be {op} {ctx.get(key)}, got {_shown(e.get('input'))}"
    if kind in _EXPECTED:
        return f"must be {_EXPECTED[kind]}, got {_shown(e.get('input'))}"
    # pydantic prefixes custom ValueError messages with "Value error, "
    return str(e.get("msg", "invalid value")).removeprefix("Value error, ")


def _most_specific(errors: list[Any]) -> Any:
    """The error to report: the first field's deepest error.

    A value that matches no member of a union (``prompt``: str | list[int] | ...)
    yields one error per member; the deepest one names the actual bad element.
    """
    def field(e: Any) -> Any:
        loc = [p for p in e.get("loc", ()) if p != "body"]
        return loc[0] if loc else None

    first_field = field(errors[0])
    same = [e for e in errors if field(e) == first_field]
    return max(same, key=lambda e: len(e.get("loc", ())))


def install_error_handlers(
    app: FastAPI, shapes: dict[str, Callable[[APIError], dict[str, Any]]] | None = None
) -> None:
    """Map every failure to an OpenAI error body (or, on a path in
    ``shapes``, the body its API's clients read); unexpected ones to a
    logged 500."""

    def respond(request: Request, err: APIError) -> JSONResponse:
        shape = (shapes or {}).get(request.url.path.removeprefix(request.scope.get("root_path", "")))
        if shape is None:
            return err.response()
        return JSONResponse(shape(err), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return respond(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(request, validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "HTTP error"
        if exc.status_code == 404:
            message = "no such endpoint; see /docs for the API"
        return respond(request, APIError(exc.status_code, message, headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in request handler")
        return respond(request, APIError(500, f"internal server error: {type(exc).__name__}: {exc}"))
