"""A router over vLLM OpenAI servers: prefill on one instance, decode on another, the client sees one completion.

``POST /v1/completions`` first sends the request to a prefill instance (``max_tokens`` 1, not streamed,
``kv_transfer_params {"do_remote_decode": true}``), then the request with the ``kv_transfer_params`` the prefill
returned to a decode instance, whose answer (JSON, or server-sent events) goes back as it is. Any connector that
speaks vLLM's ``kv_transfer_params`` works behind it: nixl_kv's or vLLM's own NixlConnector.

Balancing and failures follow ``nixl_kv.serving.router``: the instance of a role with the fewest requests in flight;
one that cannot be connected to is passed over; a 4xx passes on as it is, another failure before the response
starts is a 502 (503/504 pass on). A streamed answer that breaks off ends with an OpenAI-style error event and no
``data: [DONE]``.
"""

from __future__ import annotations

import argparse
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from nixl_kv.serving.router import Backends, Unreachable, _call, _detail, _first_reachable, _passed_on

MAX_BODY_BYTES = 4 << 20
DONE = "data: [DONE]"
PATH = "/v1/completions"


class CompletionFields(BaseModel):
    """The fields the router reads (strictly typed); the rest of the body goes to vLLM as it is."""

    model_config = ConfigDict(extra="allow")
    prompt: list[StrictInt] | StrictStr = Field(min_length=1)
    max_tokens: StrictInt = Field(default=16, ge=1)
    stream: StrictBool = False


def create_app(prefill_urls: list[str], decode_urls: list[str], timeout_s: float = 120.0) -> FastAPI:
    app = FastAPI(title="nixl_kv router for vLLM")
    prefill, decode = Backends(list(prefill_urls)), Backends(list(decode_urls))
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "prefill": prefill.urls, "decode": decode.urls}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await _body(request)
        fields = _fields(body)
        first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        first.pop("stream_options", None)
        prefilled, prefill_url = await _first_reachable(
            prefill, "prefill", lambda url: _call(client, url, PATH, first, "prefill")
        )
        prefill.done(prefill_url)
        params = prefilled.get("kv_transfer_params")
        if not isinstance(params, dict):
            raise HTTPException(502, f"prefill server {prefill_url} returned no kv_transfer_params (no KV connector?)")
        second = {**body, "kv_transfer_params": params}
        if not fields.stream:
            answer, decode_url = await _first_reachable(
                decode, "decode", lambda url: _call(client, url, PATH, second, "decode")
            )
            decode.done(decode_url)
            return JSONResponse(answer)
        lines, decode_url = await _first_reachable(decode, "decode", lambda url: _open_stream(client, url, second))
        return StreamingResponse(_relay(lines, lambda: decode.done(decode_url)), media_type="text/event-stream")

    @app.on_event("shutdown")
    async def close_client() -> None:
        await client.aclose()

    return app


async def _body(request: Request) -> dict:
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > MAX_BODY_BYTES):
        raise HTTPException(413, f"the request body exceeds {MAX_BODY_BYTES} bytes")
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise HTTPException(413, f"the request body exceeds {MAX_BODY_BYTES} bytes")
    try:
        body = json.loads(raw)
    except ValueError:
        raise HTTPException(400, "the request body is not JSON") from None
    if not isinstance(body, dict):
        raise HTTPException(422, "the request body must be a JSON object")
    return body


def _fields(body: dict) -> CompletionFields:
    try:
        return CompletionFields(**body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise HTTPException(422, f"{where}: {first['msg']}") from None


async def _open_stream(client: httpx.AsyncClient, base: str, payload: dict) -> AsyncIterator[str]:
    """The decode's event stream; its status is known before anything is passed on."""
    try:
        response = await client.send(client.build_request("POST", base + PATH, json=payload), stream=True)
    except httpx.ConnectError as exc:
        raise Unreachable(502, f"{base} cannot be reached: {exc}") from None
    except httpx.HTTPError as exc:
        raise HTTPException(502, f"{base} failed: {type(exc).__name__}: {exc}") from None
    if response.status_code >= 400:
        await response.aread()
        await response.aclose()
        raise HTTPException(_passed_on(response.status_code), f"{base}: {_detail(response)}")

    async def lines() -> AsyncIterator[str]:
        try:
            async for line in response.aiter_lines():
                if line:
                    yield line
        finally:
            await response.aclose()

    return lines()


async def _relay(lines: AsyncIterator[str], on_end: Any) -> AsyncIterator[bytes]:
    done, failure = False, "the decode server's stream ended before [DONE]"
    try:
        async for line in lines:
            done = line.strip() == DONE
            yield f"{line}\n\n".encode()
    except httpx.HTTPError as exc:
        failure = f"the decode server failed mid-stream: {type(exc).__name__}: {exc}"
    finally:
        on_end()
    if not done:
        yield f"data: {json.dumps(error_event(failure))}\n\n".encode()


def error_event(message: str) -> dict:
    """An OpenAI-style error in a completion stream: a choice that says so, and the error object."""
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "choices": [{"index": 0, "text": "", "finish_reason": "error"}],
        "error": {"message": message, "type": "upstream_error", "code": 502},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nixl_kv.vllm.router", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--prefill", action="append", required=True, help="a prefill vLLM server's URL (repeatable)")
    parser.add_argument("--decode", action="append", required=True, help="a decode vLLM server's URL (repeatable)")
    args = parser.parse_args(argv)
    import uvicorn

    uvicorn.run(create_app(args.prefill, args.decode), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
