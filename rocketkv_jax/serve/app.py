"""`build_app(engine, served_model_name, api_key)`: the FastAPI app of the OpenAI-compatible
server over a started `Engine`.

Each HTTP request becomes one engine request whose `Output`s are handed from the engine's
thread to the event loop (`call_soon_threadsafe` into an `asyncio.Queue`). A client that goes
away cancels its request (`engine.abort`), which frees its slot at the engine's next step:
a stream when Starlette cancels it, a plain request through a task that waits for the
disconnect. Errors are OpenAI's body, `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid

from rocketkv_jax.serve import _extra

try:  # the serve extra
  from fastapi import FastAPI, Request
  from fastapi.responses import JSONResponse, Response, StreamingResponse
  from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as e:
  raise _extra.missing(e) from None

from rocketkv_jax.runtime.engine import Engine, EngineClosed, QueueFull
from rocketkv_jax.serve import protocol, responses
from rocketkv_jax.serve.metrics import CONTENT_TYPE, Metrics
from rocketkv_jax.serve.protocol import APIError

RETRY_AFTER_S = 1  # what a 503 (queue full) asks the client to wait


def build_app(engine: Engine, served_model_name: str, api_key: str | None = None) -> FastAPI:
  """The app. `engine` must be started (`engine.start()`); the app never stops it: whoever
  runs the server calls `engine.shutdown()` (`server.serve` does, on SIGTERM / Ctrl-C).
  `app.state.closing = True` makes `/health` answer 503 while the server drains."""
  app = FastAPI(title="rocketkv-jax", docs_url=None, redoc_url=None, openapi_url=None)
  app.state.closing = False
  metrics = Metrics(engine)
  created = int(time.time())

  @app.exception_handler(APIError)
  async def _api_error(request: Request, e: APIError):
    del request
    headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 503 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)

  @app.exception_handler(StarletteHTTPException)
  async def _http_error(request: Request, e: StarletteHTTPException):
    del request
    return JSONResponse(APIError(str(e.detail), status=e.status_code,
                                 code=str(e.status_code)).body(),
                        status_code=e.status_code, headers=getattr(e, "headers", None))

  @app.middleware("http")
  async def _auth(request: Request, call_next):
    if api_key is not None and request.url.path.startswith("/v1"):
      scheme, _, token = request.headers.get("authorization", "").partition(" ")
      if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(),
                                                                  api_key.encode()):
        e = APIError("invalid or missing API key (Authorization: Bearer <key>)", status=401,
                     type="authentication_error", code="invalid_api_key")
        return JSONResponse(e.body(), status_code=401)
    return await call_next(request)

  @app.get("/health")
  async def health():
    return Response(status_code=503 if app.state.closing else 200)

  @app.get("/metrics")
  async def get_metrics():
    return Response(metrics.render(), media_type=CONTENT_TYPE)

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{
        "id": served_model_name, "object": "model", "created": created,
        "owned_by": "rocketkv-jax", "max_model_len": engine.config.max_model_len}]}

  @app.post("/v1/completions")
  async def completions(request: Request):
    return await _serve(request, chat=False)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    return await _serve(request, chat=True)

  async def _serve(request: Request, chat: bool):
    try:
      body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise APIError(f"the request body is not valid JSON: {e}") from None
    req = protocol.parse(body, chat)
    if req.model is not None and req.model != served_model_name:
      raise APIError(f"the model `{req.model}` does not exist (this server serves "
                     f"`{served_model_name}`)", status=404, param="model",
                     code="model_not_found")
    ids = _prompt_ids(engine, req)
    try:
      params = req.sampling_params(req.max_tokens or _default_max_tokens(engine, len(ids)))
    except ValueError as e:  # protocol.parse checks the same rules; this is a safety net
      raise APIError(str(e)) from None
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    timer = metrics.timer()

    def on_output(out):  # on the engine's thread; timed here, so a request whose client left
      timer.observe(time.monotonic(), out)  # is still counted to its end
      try:
        loop.call_soon_threadsafe(events.put_nowait, out)
      except RuntimeError:  # the event loop is closed: nobody is listening any more
        pass

    try:
      engine.add_request(ids, params, request_id=rid, on_output=on_output)
    except QueueFull as e:
      raise APIError(f"the server is busy ({e}); retry later", status=503,
                     type="server_error", code="queue_full") from None
    except EngineClosed:
      raise APIError("the server is shutting down", status=503, type="server_error",
                     code="shutting_down") from None
    except ValueError as e:
      prompt_param = "messages" if chat else "prompt"
      too_long = str(e).startswith("prompt has")  # else max_tokens does not fit beside it
      raise APIError(str(e), param=prompt_param if too_long else "max_tokens") from None
    name = req.model or served_model_name
    if req.stream:
      return StreamingResponse(_stream(rid, name, chat, req.include_usage, events,
                                       req.continuous_usage),
                               media_type="text/event-stream")
    return await _whole(request, rid, name, chat, events)

  async def _whole(request: Request, rid, name, chat, events):
    """Waits for the whole completion; a disconnect meanwhile aborts the request."""
    watcher = asyncio.ensure_future(_abort_on_disconnect(request, engine, rid))
    text, out = [], None
    try:
      while out is None or not out.finished:
        out = await events.get()
        text.append(out.text)
    finally:
      watcher.cancel()
      if out is None or not out.finished:  # this handler was cancelled (server shutdown)
        engine.abort(rid)
    if out.finish_reason == "error":
      raise APIError(f"generation failed: {out.error}", status=500, type="server_error")
    if out.finish_reason == "abort":
      raise APIError("the request was aborted (the server is shutting down)", status=503,
                     type="server_error", code="aborted")
    return responses.completion(rid, int(time.time()), name, chat, "".join(text),
                                out.finish_reason,
                                responses.usage(out.prompt_tokens, out.completion_tokens))

  async def _stream(rid, name, chat, include_usage, events, continuous=False):
    """Server-sent chunks; a cancelled generator (the client left) aborts the request.
    `continuous`: every chunk carries the usage so far (vLLM's continuous_usage_stats)."""
    now = int(time.time())
    counts = [0, 0]  # prompt, completion tokens so far

    def mk(**kw):
      now_use = responses.usage(*counts) if continuous else None
      return responses.sse(responses.chunk(rid, now, name, chat, with_usage=include_usage,
                                           usage_now=now_use, **kw))

    try:
      if chat:
        yield mk(role=True)
      while True:
        out = await events.get()
        counts[:] = [out.prompt_tokens, out.completion_tokens]
        if out.finish_reason == "error":
          yield responses.sse(APIError(f"generation failed: {out.error}", status=500,
                                       type="server_error").body())
          break
        if out.text:
          yield mk(text=out.text)
        if out.finished:
          yield mk(finish_reason=out.finish_reason)
          if include_usage:
            yield responses.sse(responses.chunk(
                rid, now, name, chat, use=responses.usage(out.prompt_tokens,
                                                          out.completion_tokens)))
          break
      yield responses.DONE
    finally:
      engine.abort(rid)  # nothing if it finished; else the client left mid-stream

  return app


def _prompt_ids(engine: Engine, req: protocol.CompletionRequest) -> list[int]:
  """The request's prompt as token ids (chat: the template with the generation prompt)."""
  tok = engine.tokenizer
  param = "messages" if req.messages is not None else "prompt"
  if isinstance(req.prompt, list):
    try:
      return engine.encode(req.prompt)
    except ValueError as e:
      raise APIError(str(e), param=param) from None
  if tok is None:
    raise APIError("the model has no tokenizer: send the prompt as token ids", param=param)
  if req.prompt is not None:
    return tok.encode(req.prompt)
  try:
    text = tok.apply_chat_template(req.messages, add_generation_prompt=True)
  except Exception as e:  # pylint: disable=broad-except  (the template's own errors)
    raise APIError(f"the chat template failed: {e}", param=param) from None
  return tok.encode(text, add_special_tokens=False)


def _default_max_tokens(engine: Engine, prompt_len: int) -> int:
  """Without `max_tokens`: the engine's planned new tokens, within what the slot holds."""
  return max(1, min(engine.config.max_new_tokens, engine.max_tokens_for(prompt_len)))


async def _abort_on_disconnect(request: Request, engine: Engine, rid: str) -> None:
  """Aborts `rid` when the client disconnects (the body is read: the next ASGI message is the
  disconnect)."""
  while True:
    message = await request.receive()
    if message["type"] == "http.disconnect":
      engine.abort(rid)
      return
