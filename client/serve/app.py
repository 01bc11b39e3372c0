"""The ASGI application: OpenAI's HTTP API over a :class:`~.service.ModelService`.

Starlette routes the requests; the two generation endpoints are plain ASGI callables so that one
trio nursery per request can watch for the client going away while the generation runs (a
disconnect cancels the generation, streamed or not). Every error leaves as OpenAI's error object
with its HTTP status (:func:`.openai_api.error_from_mux`), and no request can take the worker down:
a request's error ends that request only.

Owner: the server's trio thread (hypercorn's trio worker runs the app in the client's event loop).
"""

from __future__ import annotations

import contextvars
import hmac
import logging
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from muxworker.client.params import CheckedParams

if sys.version_info < (3, 11):  # pragma: no cover - trio brings the backport
    from exceptiongroup import BaseExceptionGroup
from muxworker.client.runtime import RuntimeStream
from muxworker.transport.checkpoint import CheckpointNotFound
from muxworker.transport.errors import ContextOverflow, InvalidArgument, MuxError

from . import defaults
from . import openai_api as oa
from . import responses as rs
from . import responses_api as ra
from .metrics import CONTENT_TYPE_LATEST, ServerMetrics
from .policy import HttpPolicy
from .reasoning import ReasoningParser
from .reuse import SERVER_SESSION_ID
from .service import ModelService, SavePolicy, session_object
from .tenants import IMPLICIT, RESPONSE, Tenant, internal_id
from .tools import OutputParser

__all__ = ["AppConfig", "SESSION_HEADER", "SAVE_ERROR_HEADER", "create_app", "read_body"]

log = logging.getLogger("muxworker.serve")
access_log = logging.getLogger("muxworker.serve.access")  # one line per request, at info

SESSION_HEADER = "x-session-id"
#: On a turn of a session whose last save failed: that failure (docs/SERVER.md, "Saving").
SAVE_ERROR_HEADER = "x-muxworker-save-error"
BODY_TIMEOUT_S = 30.0  # a request body dripping in slower than this holds no connection longer
#: Bytes of a response its client has not taken yet before the generation feeding it waits (_Sender).
UNSENT_LIMIT = 8 << 20


@dataclass(frozen=True)
class AppConfig:
    model: oa.ServedModel  # its names (the first is the id /v1/models lists) and request defaults
    policy: HttpPolicy = field(default_factory=HttpPolicy)  # keys, Host, Origin, body limits
    internal_token: str | None = None  # enables GET /v1/internal/routing for this token alone (Ray replicas)


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(obj, status_code=status, headers=headers)


def _error_response(err: oa.APIError) -> JSONResponse:
    return _json(err.body(), err.status, err.headers)


class _Guard:
    """Authentication and request accounting shared by every endpoint."""

    def __init__(self, config: AppConfig, metrics: ServerMetrics) -> None:
        self.policy = config.policy
        self.metrics = metrics

    def tenant(self, headers: Any) -> Tenant:
        return self.policy.tenant(headers)

    def count(self, endpoint: str, status: int) -> None:
        self.metrics.requests.labels(endpoint, str(status)).inc()


class _Refuse:
    """ASGI middleware: what a browser could forge is refused before routing (Host 421, Origin
    403, a body that is not JSON 415, a Content-Length over the limit 413; :mod:`.policy`),
    preflights are answered, and responses to an allowed cross-origin page carry CORS headers."""

    def __init__(self, app: ASGIApp, guard: _Guard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        policy = self.guard.policy
        err = policy.refusal(scope["method"], headers, scope.get("server"))
        origin = headers.get("origin")
        if err is not None:
            self.guard.count("refused", err.status)
            if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
                err.headers["Connection"] = "close"  # its body is never read: no pooled connection reuses it
            await _error_response(err)(scope, receive, send)
            return
        if scope["method"] == "OPTIONS" and origin is not None:
            extra = policy.preflight_headers(origin)
            if not extra:  # the page's own origin needs no preflight; anything else was refused above
                extra = [(b"access-control-allow-methods", b"GET, POST, DELETE, OPTIONS")]
            await send({"type": "http.response.start", "status": 204, "headers": extra})
            await send({"type": "http.response.body", "body": b""})
            return
        cors = policy.cors_headers(origin)
        if not cors:
            await self.app(scope, receive, send)
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        await self.app(scope, receive, send_with_cors)


@dataclass
class _Usage:
    """The tokens of a request's generations, for its access log line."""

    prompt: int | None = None  # the first generation's (n > 1: every choice has the same prompt)
    cached: int | None = None
    completion: int = 0


_USAGE: contextvars.ContextVar[_Usage | None] = contextvars.ContextVar("muxworker_request_usage", default=None)


def note_usage(result: Any) -> None:
    """Add a generation's tokens (a GenerationResult) to the access log line of the request whose
    task (or a child task of it) calls this; a no-op outside a request."""
    usage = _USAGE.get()
    if usage is None:
        return
    if usage.prompt is None:
        usage.prompt, usage.cached = result.prompt_tokens, result.reused_prompt_tokens
    usage.completion += result.completion_tokens


class _AccessLog:
    """ASGI middleware: one info line per HTTP request when it is done, whoever answered it (a
    refusal, an endpoint, a route not found): method, path, status, the tokens of its
    generations (:func:`note_usage`) and milliseconds. 499: the client went away unanswered."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not access_log.isEnabledFor(logging.INFO):
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        usage = _Usage()
        token = _USAGE.set(usage)
        status = 499

        async def send_noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        except BaseException:
            status = 500 if status == 499 else status
            raise
        finally:
            _USAGE.reset(token)
            tokens = ""
            if usage.prompt is not None:
                tokens = f" prompt={usage.prompt} cached={usage.cached} completion={usage.completion}"
            ms = (time.perf_counter() - t0) * 1000
            access_log.info("%s %s %d%s %.0f ms", scope["method"], _printable(scope["path"]), status, tokens, ms)


def _printable(text: str, limit: int = 200) -> str:
    """``text`` for a log line: no control characters (a path is the client's), bounded."""
    text = text if len(text) <= limit else text[:limit] + "..."
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def _endpoint(guard: _Guard, name: str, *, auth: bool = True) -> Callable:
    """Wrap a ``handler(request, tenant) -> Response`` with authentication, error mapping and metrics."""

    def wrap(handler: Callable[[Request, Tenant], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                tenant = guard.tenant(request.headers) if auth else Tenant.of_key(None)
                response = await handler(request, tenant)
            except Exception as exc:  # every error is an OpenAI error object, never a bare 500 page
                if not isinstance(exc, (oa.APIError, MuxError)):
                    log.exception("%s failed", name)
                response = _error_response(oa.error_from_mux(exc))
            guard.count(name, response.status_code)
            return response

        return endpoint

    return wrap


async def read_body(receive: Receive, limit: int) -> bytes:
    """The whole request body, refusing one over ``limit`` bytes (413) as soon as it is (a
    declared Content-Length over it was refused before, by :class:`_Refuse`)."""
    parts: list[bytes] = []
    total = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise oa.APIError(499, "the client went away", code="client_disconnected")
        chunk = message.get("body", b"")
        total += len(chunk)
        if total > limit:
            raise oa.APIError(
                413,
                f"the request body exceeds the limit of {limit} bytes",
                code="request_too_large",
                headers={"Connection": "close"},
            )
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


class _GenerationEndpoint:
    """``POST /v1/chat/completions``, ``/v1/completions`` or ``/v1/responses`` (``api``: chat,
    completions or responses), as an ASGI app of its own. A Responses request is the chat turn it
    means (responses_api.py), answered in its own shapes."""

    def __init__(self, service: ModelService, guard: _Guard, config: AppConfig, api: str) -> None:
        self.service = service
        self.guard = guard
        self.config = config
        self.api = api
        self.chat = api != "completions"  # rendered from chat messages
        self.name = {"chat": "chat_completions", "completions": "completions", "responses": "responses"}[api]
        self.metrics = guard.metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        t0 = time.perf_counter()
        status = 499  # unless set below: cancelled (the server's graceful timeout) or gone
        out = _Sender(send)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(out.run)
                try:
                    status = await self._serve(scope, receive, out.send, t0)
                except Exception as exc:  # every error is an OpenAI error object, never a bare 500 page
                    err = oa.error_from_mux(exc)
                    if not isinstance(exc, (oa.APIError, MuxError)):
                        log.exception("%s failed", self.name)
                    status = err.status
                    if status != 499 and not out.failed:
                        await _error_response(err)(scope, receive, out.send)
                # The generation has settled and given its slot back: only the connection waits for
                # the client to take the rest (cut by the kernel after --send-timeout without progress).
                await out.flush()
                nursery.cancel_scope.cancel()
        finally:
            self.guard.count(self.name, status)

    async def _serve(self, scope: Scope, receive: Receive, send: Send, t0: float) -> int:
        request = Request(scope, receive)
        try:
            tenant = self.guard.tenant(request.headers)  # before the body: a keyless one is never read
        except oa.APIError as exc:
            exc.headers["Connection"] = "close"
            raise
        with trio.move_on_after(BODY_TIMEOUT_S) as body_scope:
            raw = await read_body(receive, self.config.policy.max_request_bytes)
        if body_scope.cancelled_caught:
            raise oa.APIError(
                408,
                f"the request body did not arrive within {BODY_TIMEOUT_S:.0f} s",
                code="timeout",
                headers={"Connection": "close"},
            )
        body = oa.parse_json(raw)
        served = self.config.model
        rq: ra.ResponsesRequest | None = None
        if self.api == "responses":
            rq = await self._parse_responses(tenant, body)
            parsed: oa.ChatRequest | oa.CompletionRequest = rq.chat
            parsed.ignored = tuple(rq.ignored)
        elif self.chat:
            parsed = oa.parse_chat_request(body, served, self.service.max_messages())
        else:
            parsed = oa.parse_completion_request(body, served)
        self._note_ignored(parsed)
        header_sid = request.headers.get(SESSION_HEADER)
        if header_sid is not None:
            oa.check_session_id(header_sid, "the X-Session-Id header")
            if parsed.session_id is not None and parsed.session_id != header_sid:
                raise oa.bad_request(
                    f"X-Session-Id {header_sid!r} and session_id {parsed.session_id!r} differ", param="session_id"
                )
        public_sid = header_sid or parsed.session_id or oa.cache_key_session(body.get("prompt_cache_key"))
        params, parser = parsed.params, OutputParser()
        try:
            if isinstance(parsed, oa.ChatRequest):
                fmt = self.service.tool_format()
                prompt: list[int] = await self._render(parsed, rq)
                if parsed.tools is not None:
                    if parsed.tools.content_schema is not None and not fmt.accepts_content_schema:
                        raise oa.bad_request(
                            f"response_format together with tools is not served for the {fmt.name} tool format "
                            "(its calls are JSON objects themselves)",
                            param="response_format",
                            code="unsupported",
                        )
                    parser = fmt.parser(parsed.tools)
                    constraint = fmt.constraint(parsed.tools)
                    if constraint is not None:
                        params = CheckedParams(params.session_id, {**params.fields, "constraint": constraint})
                thinking = self.service.thinking()
                if thinking is not None:  # reasoning apart from the answer, which alone the tool parser reads
                    start = thinking.start(prompt)
                    parser = thinking.parser(start, parser)
                    given = params.fields.get("constraint")
                    constraint = thinking.constrain(given, start)
                    if constraint is not given:
                        params = CheckedParams(params.session_id, {**params.fields, "constraint": constraint})
            elif isinstance(parsed.prompt, str):
                prompt = await self.service.encode(parsed.prompt)
            else:
                prompt = parsed.prompt
            try:
                await self.service.check_constraint(params.fields.get("constraint"))
            except InvalidArgument as exc:  # the schema or grammar the request's fields became
                where = "tools" if getattr(parsed, "tools", None) is not None else "response_format"
                where = {"response_format": "text.format"}.get(where, where) if rq is not None else where
                raise oa.bad_request(f"{where}: {exc}", param=where) from None
            await self.service.check_store_quota(tenant)
        except Exception as exc:
            raise oa.error_from_mux(exc) from None
        units = parsed.n  # each choice runs on a session of its own
        # Waits in the queue while no slot is free, fair between tenants (a keyless server's: clients).
        grant = await self.service.admit(tenant.admission_party(scope.get("client")), units)
        try:
            named = internal_id(tenant, public_sid) if public_sid is not None else None
            kind = RESPONSE if rq is not None and rq.store else IMPLICIT  # a stored response's history stays
            hint = rq.previous_session if rq is not None else None
            plan = await self.service.place(tenant, prompt, named, kind, salt=parsed.cache_salt, hint=hint)
        except BaseException as exc:
            grant.release()
            if isinstance(exc, Exception):
                raise oa.error_from_mux(exc) from None
            raise
        sid = plan.target
        params = self._fit_max_tokens(parsed, params, prompt)
        salt = tenant.cache_salt(parsed.cache_salt)
        extras: list[_Choice] = []
        cached: int | None = None
        try:
            if parsed.n > 1:
                cached, extras = await self._forks(tenant, sid, prompt, params, salt, parsed.n, parser)
            stream, runtime = self.service.generate(sid, prompt, params, salt)
        except BaseException as exc:
            grant.release()
            self.service.unplace(plan)
            self._release(extras)
            if isinstance(exc, Exception):
                raise oa.error_from_mux(exc) from None
            raise
        turn = _Turn(self.service, runtime, sid, public_sid, stream, parser, extras, cached)
        self.metrics.in_flight.inc()
        try:
            error: oa.APIError | None = None
            status = 200
            async with trio.open_nursery() as nursery:
                streams = [stream] + [c.stream for c in extras if c.stream is not None]
                nursery.start_soon(self._watch_disconnect, receive, streams)
                try:
                    if rq is not None:
                        status = await self._respond(scope, receive, send, turn, rq, tenant, t0)
                    elif parsed.stream:
                        status = await self._stream(send, turn, parsed, t0)
                    else:
                        status = await self._complete(scope, receive, send, turn, parsed, t0)
                except oa.APIError as exc:
                    error = exc  # raised outside the nursery, so not inside an exception group
                finally:
                    nursery.cancel_scope.cancel()
            if error is not None:
                raise error
            return status
        finally:
            self.metrics.in_flight.dec()
            stream.cancel()  # a no-op once it has ended
            self._release(extras)
            # In the background, once the generation has settled: reuse, saves.
            self.service.after_stream(runtime, sid, stream, saved=turn.saved, prompt=prompt, grant=grant)

    async def _forks(
        self,
        tenant: Tenant,
        sid: str,
        prompt: str | list[int],
        params: CheckedParams,
        salt: str,
        n: int,
        parser: OutputParser,
    ) -> tuple[int, list[_Choice]]:
        """For ``n`` choices: prefill the prompt once, on the request's own session (one greedy
        token, which the first choice then replaces), fork its rows into ``n - 1`` stateless
        sessions and start their generations; each samples with its own seed (the request's seed
        plus its index, when it gave one). Returns the prompt tokens the prefill reused, and the
        choices 1..n-1."""
        once = CheckedParams("", {"max_new_tokens": 1, "temperature": 0.0, "stop_token_ids": []})
        stream, runtime = self.service.generate(sid, prompt, once, salt)
        prefill = await stream.wait()
        if prefill.finish_reason == "cancelled":
            raise oa.APIError(499, "the client went away", code="cancelled")
        extras: list[_Choice] = []
        try:
            for index in range(1, n):
                fork, fork_runtime = await self.service.open_ephemeral(tenant)
                extras.append(_Choice(index, fork, fork_runtime, None, parser.fresh()))
                await self.service.fork(fork_runtime, sid, fork, prefill.prompt_tokens)
            for choice in extras:
                fields = dict(params.fields)
                if fields.get("seed") is not None:
                    fields["seed"] = (fields["seed"] + choice.index) % 2**63
                choice.stream, _ = self.service.generate(choice.sid, prompt, CheckedParams("", fields), salt)
        except BaseException:
            self._release(extras)
            raise
        return prefill.reused_prompt_tokens, extras

    def _release(self, choices: list[_Choice]) -> None:
        for choice in choices:
            if choice.stream is not None:
                choice.stream.cancel()
            self.service.release_ephemeral(choice.runtime, choice.sid)
        choices.clear()

    async def _send_delta(self, out: _Out, choice: _Choice, text: str) -> None:
        """One text delta of ``choice`` as a chunk (what of it is content: a tool call's text is not)."""
        assert choice.stream is not None
        entries = choice.stream.logprobs_from(choice.sent)
        content = choice.parser.feed(text)
        reasoning = choice.parser.pop_reasoning()
        if content or entries or reasoning:
            await out.send(out.writer.delta(content, entries, choice.index, reasoning))
        choice.sent += len(entries)
        deltas = choice.parser.pop_deltas()
        if deltas:
            await out.send(out.writer.call_deltas(deltas, choice.index))

    async def _end_choice(self, out: _Out, choice: _Choice, result: Any, session: dict | None = None) -> None:
        content, calls = choice.parser.finish()
        reasoning = choice.parser.pop_reasoning()
        if content or reasoning:
            await out.send(out.writer.delta(content, (), choice.index, reasoning))
        deltas = choice.parser.pop_deltas()
        if deltas:
            await out.send(out.writer.call_deltas(deltas, choice.index))
        rest = (result.logprobs or ())[choice.sent :]  # tokens no text chunk carried (a stop token)
        await out.send(out.writer.finish(result, session, rest, calls, choice.index))

    # -- the Responses API (responses_api.py) ----------------------------------------------------------

    async def _parse_responses(self, tenant: Tenant, body: dict[str, Any]) -> ra.ResponsesRequest:
        previous = None
        previous_id = body.get("previous_response_id")
        if previous_id is not None:
            previous = await self.service.load_response(tenant, previous_id)
            if previous is None:
                raise oa.bad_request(
                    f"previous response {previous_id!r:.80} is not stored here (never stored, deleted or expired)",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
        rq = ra.parse_responses_request(body, self.config.model, previous, self.service.max_messages())
        rq.previous_session = previous["session"] if previous is not None else None
        return rq

    async def _render(self, parsed: oa.ChatRequest, rq: ra.ResponsesRequest | None) -> list[int]:
        """The prompt of a chat turn; with Responses' ``truncation: auto``, the oldest messages
        after the instructions are dropped until it fits the context, as OpenAI does."""
        room = self.service.max_model_len()
        if rq is None or rq.truncation != "auto" or room is None:
            return await self.service.render_chat(parsed.messages, parsed.tools)
        max_new = parsed.params.fields.get("max_new_tokens", -1)
        room -= max(1, max_new if max_new > 0 else 1)
        messages = list(parsed.messages)
        first = 1 if messages and messages[0]["role"] == "system" else 0
        while True:
            try:  # a history far too long for the context is refused before it is tokenized whole
                prompt: list[int] | None = await self.service.render_chat(messages, parsed.tools)
            except ContextOverflow:
                if len(messages) <= first + 1:
                    raise
                prompt = None
            if prompt is not None and (len(prompt) <= room or len(messages) <= first + 1):
                return prompt
            del messages[first]
            while len(messages) > first + 1 and messages[first]["role"] == "tool":  # no result without its call
                del messages[first]

    async def _store(
        self, tenant: Tenant, rid: str, response: dict[str, Any], rq: ra.ResponsesRequest, sid: str
    ) -> None:
        """Keep the response; where the store fails (or the record is over its limit) it is answered
        anyway, with ``store`` false: the turn happened, only its record is missing."""
        try:
            await self.service.store_response(tenant, rid, ra.record(response, rq, sid), sid)
        except Exception as exc:
            log.error("storing response %s failed: %s: %s", rid, type(exc).__name__, exc)
            response["store"] = False

    async def _respond(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        turn: _Turn,
        rq: ra.ResponsesRequest,
        tenant: Tenant,
        t0: float,
    ) -> int:
        rid = ra.new_id("resp")
        logprobs = self._logprobs(rq.chat)
        if not rq.chat.stream:
            try:
                choice = await self._collect(_Choice(0, turn.sid, turn.runtime, turn.stream, turn.parser), t0)
            except MuxError as exc:
                raise oa.error_from_mux(exc) from None
            self._account(choice.result)
            if choice.result.finish_reason == "cancelled":
                return 499
            await turn.settle(choice.result)
            entries = ra.logprob_entries(logprobs, choice.result.logprobs)
            status = "incomplete" if choice.result.finish_reason == "length" else "completed"
            output = ra.output_items(choice.text, choice.calls, choice.result, entries, choice.reasoning)
            body = ra.response_object(
                rid,
                rq,
                time.time(),
                status=status,
                output=output,
                result=choice.result,
                reasoning_tokens=choice.reasoning_tokens,
            )
            if rq.store:
                await self._store(tenant, rid, body, rq, turn.sid)
            await _json(body, 200, turn.headers())(scope, receive, send)
            return 200
        stream, parser = turn.stream, turn.parser
        gone, first = await self._first_delta(turn, t0)
        if gone:
            return 499
        writer = ra.EventWriter(rid, rq, logprobs)
        thinks = isinstance(parser, ReasoningParser)
        await _start_events(send, turn)
        await _body(send, writer.start())
        sent = 0

        async def piece(text: str) -> None:
            nonlocal sent
            entries = stream.logprobs_from(sent)
            content = parser.feed(text)
            reasoning = parser.pop_reasoning()
            out = writer.reasoning(reasoning) if reasoning else b""
            # The message's logprobs are every token's, as the body's are: those of reasoning
            # wait for its first text.
            if content or (entries and not thinks):
                out += writer.text(content, entries)
                sent += len(entries)
            deltas = parser.pop_deltas()
            await _body(send, out + (writer.calls(deltas) if deltas else b""))

        overhead = self.metrics.stream_overhead
        try:
            if first is not None:
                await piece(first)
                async for text in stream:
                    got = time.perf_counter()
                    await piece(text)
                    overhead.observe(time.perf_counter() - got)
            result = await stream.wait()
        except MuxError as exc:
            await _body(send, writer.fail(oa.error_from_mux(exc)), more=False)
            return 200
        self._account(result)
        if result.finish_reason == "cancelled":
            return 499
        await turn.settle(result)
        rest, calls = parser.finish()
        reasoning = parser.pop_reasoning()
        tail = writer.reasoning(reasoning) if reasoning else b""
        if rest:
            tail += writer.text(rest, stream.logprobs_from(sent) if thinks else ())
        deltas = parser.pop_deltas()
        tail += writer.calls(deltas) if deltas else b""
        events, final = writer.finish(result, calls, parser.reasoning_tokens(result.generated_token_ids))
        if rq.store:
            await self._store(tenant, rid, final, rq, turn.sid)
        await _body(send, tail + events, more=False)
        return 200

    def _logprobs(self, parsed: Any) -> rs.Logprobs | None:
        return rs.Logprobs(self.service.token_bytes, self.chat) if parsed.logprobs is not None else None

    async def _watch_disconnect(self, receive: Receive, streams: list[RuntimeStream]) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not all(stream.finished for stream in streams):
                    self.metrics.disconnects.inc()
                for stream in streams:
                    stream.cancel()
                return

    def _account(self, stream_result: Any) -> None:
        note_usage(stream_result)  # the request's access log line
        self.metrics.prompt_tokens.inc(stream_result.prompt_tokens)
        self.metrics.cached_tokens.inc(stream_result.reused_prompt_tokens)
        self.metrics.completion_tokens.inc(stream_result.completion_tokens)

    async def _collect(self, choice: _Choice, t0: float | None = None) -> rs.Choice:
        """Read one choice to its end (``t0``: observe its time to first token)."""
        assert choice.stream is not None
        parts: list[str] = []
        async for text in choice.stream:
            if t0 is not None:
                self.metrics.ttft.observe(time.perf_counter() - t0)
                t0 = None
            parts.append(choice.parser.feed(text))
        result = await choice.stream.wait()
        rest, calls = choice.parser.finish()
        parts.append(rest)
        parser = choice.parser
        return rs.Choice(
            choice.index,
            "".join(parts),
            result,
            calls,
            reasoning=parser.reasoning,
            reasoning_tokens=parser.reasoning_tokens(result.generated_token_ids),
        )

    async def _complete(self, scope: Scope, receive: Receive, send: Send, turn: _Turn, parsed: Any, t0: float) -> int:
        first = _Choice(0, turn.sid, turn.runtime, turn.stream, turn.parser)
        everyone = [first, *turn.extras]
        done: dict[int, rs.Choice] = {}

        async def collect(choice: _Choice) -> None:
            done[choice.index] = await self._collect(choice, t0 if choice is first else None)

        try:
            async with trio.open_nursery() as nursery:
                for choice in everyone:
                    nursery.start_soon(collect, choice)
        except MuxError as exc:
            raise oa.error_from_mux(exc) from None
        except BaseExceptionGroup as group:
            raise oa.error_from_mux(_first_error(group)) from None
        choices = [done[i] for i in range(len(everyone))]
        for c in choices:
            self._account(c.result)
        if any(c.result.finish_reason == "cancelled" for c in choices):
            return 499  # nobody to answer
        session = await turn.settle(choices[0].result)
        lp = self._logprobs(parsed)
        for c in choices:
            c.logprobs = lp
        rid = rs.new_id("chatcmpl" if self.chat else "cmpl")
        body = rs.completion_body(self.chat, rid, parsed.model, choices, turn.public_sid, session, turn.cached)
        await _json(body, 200, turn.headers())(scope, receive, send)
        return 200

    async def _first_delta(self, turn: _Turn, t0: float) -> tuple[bool, str | None]:
        """A streamed turn's first delta (None: it ended without one), read before the headers so
        that an error at admission or prefill (context overflow, capacity, a resume that fails)
        still gets its own HTTP status; and whether the client went away before it (nobody to
        answer: 499)."""
        stream = turn.stream
        try:
            first: str | None = await stream.__aiter__().__anext__()
        except StopAsyncIteration:
            first = None
        except MuxError as exc:
            raise oa.error_from_mux(exc) from None
        if first is None:
            return (await stream.wait()).finish_reason == "cancelled", None
        self.metrics.ttft.observe(time.perf_counter() - t0)
        return False, first

    async def _stream(self, send: Send, turn: _Turn, parsed: Any, t0: float) -> int:
        stream = turn.stream
        gone, first = await self._first_delta(turn, t0)
        if gone:
            return 499
        now = time.perf_counter()
        writer = rs.ChunkWriter(
            rs.new_id("chatcmpl" if self.chat else "cmpl"), parsed.model, self.chat, self._logprobs(parsed)
        )
        await _start_events(send, turn)
        out = _Out(send, writer)
        main = _Choice(0, turn.sid, turn.runtime, stream, turn.parser)
        results: dict[int, Any] = {}

        async def others(choice: _Choice) -> None:
            assert choice.stream is not None
            if self.chat:
                await out.send(writer.role(choice.index))
            async for text in choice.stream:
                await self._send_delta(out, choice, text)
            results[choice.index] = result = await choice.stream.wait()
            if result.finish_reason != "cancelled":
                await self._end_choice(out, choice, result)

        overhead, inter = self.metrics.stream_overhead, self.metrics.inter_token
        last = now
        try:
            async with trio.open_nursery() as nursery:
                if self.chat:
                    await out.send(writer.role())
                for choice in turn.extras:
                    nursery.start_soon(others, choice)
                if first is not None:
                    await self._send_delta(out, main, first)
                    async for text in stream:
                        got = time.perf_counter()
                        inter.observe(got - last)
                        await self._send_delta(out, main, text)
                        last = time.perf_counter()
                        overhead.observe(last - got)
                results[0] = await stream.wait()
        except (MuxError, BaseExceptionGroup) as exc:
            # Headers are gone: the error travels as an event, as OpenAI's API does mid-stream.
            error = _first_error(exc) if isinstance(exc, BaseExceptionGroup) else exc
            await _body(send, writer.error(oa.error_from_mux(error)))
            await _body(send, rs.DONE, more=False)
            return 200
        ordered = [results[i] for i in range(1 + len(turn.extras))]
        for result in ordered:
            self._account(result)
        if any(r.finish_reason == "cancelled" for r in ordered):
            return 499
        await self._end_choice(out, main, ordered[0], await turn.settle(ordered[0]))
        if parsed.include_usage:
            parsers = [main.parser, *(c.parser for c in turn.extras)]
            reasoning = rs.reasoning_total(
                [p.reasoning_tokens(r.generated_token_ids) for p, r in zip(parsers, ordered)]
            )
            await _body(send, writer.usage(ordered, turn.cached, reasoning))
        await _body(send, rs.DONE, more=False)
        return 200

    def _note_ignored(self, parsed: oa.ChatRequest | oa.CompletionRequest) -> None:
        """Unknown fields are ignored (as vLLM does), so a new SDK field breaks no client: logged
        at debug and counted (``muxworker_unknown_fields_total``)."""
        if parsed.ignored:
            log.debug("%s: ignoring unknown fields %s", self.name, ", ".join(map(repr, parsed.ignored[:20])))
            self.metrics.count_unknown_fields(parsed.ignored)

    def _fit_max_tokens(self, parsed: Any, params: CheckedParams, prompt: str | list[int]) -> CheckedParams:
        """A ``max_tokens`` the request left out is the default, cut to the room the rendered prompt
        leaves (a request's own max_tokens beyond it is refused by the worker, as OpenAI does)."""
        if not parsed.default_max_tokens:
            return params
        size = len(prompt) if isinstance(prompt, list) else None
        return defaults.clamp(params, size, self.service.max_model_len())


@dataclass
class _Choice:
    """One choice of a request: the session it runs on and its stream, parser and progress."""

    index: int
    sid: str
    runtime: Any
    stream: RuntimeStream | None
    parser: OutputParser
    sent: int = 0  # tokens whose logprobs have been sent


class _Out:
    """The response's body chunks, one writer at a time (choices stream from their own tasks)."""

    def __init__(self, send: Send, writer: rs.ChunkWriter) -> None:
        self.writer = writer
        self._send = send
        self._lock = trio.Lock()

    async def send(self, chunk: bytes) -> None:
        async with self._lock:
            await _body(self._send, chunk)


class _Sender:
    """A response's ASGI messages, sent in order by a task of their own (:meth:`run`), so that the
    generation feeding them never waits for its client: one that stops reading holds no generation
    slot (the turn settles, is saved and gives its slot back as usual), only its connection and
    the bytes it has not taken, up to ``limit`` (then the feeder waits, as a plain send would).
    Waiting bodies go out together. The connection is cut by the kernel once the client has taken
    nothing for ``--send-timeout`` (TCP_USER_TIMEOUT on the listening socket, __main__.py):
    hypercorn shields its socket writes from cancellation, so no timeout here could stop one."""

    def __init__(self, send: Send, limit: int = UNSENT_LIMIT) -> None:
        self._send = send
        self._limit = limit
        self._queue: deque[Message] = deque()
        self._unsent = 0  # body bytes queued or being sent
        self._busy = False  # run() is in a send
        self._lot = trio.lowlevel.ParkingLot()  # every change: the waiters look again
        self._error: Exception | None = None  # the send that failed (later sends raise it)

    async def send(self, message: Message) -> None:
        if self._error is not None:
            raise self._error
        self._queue.append(message)
        self._unsent += len(message.get("body", b""))
        self._lot.unpark_all()
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            return  # the response is complete: nothing more to hold back (__call__ flushes it)
        while self._unsent > self._limit and self._error is None:
            await self._lot.park()

    @property
    def failed(self) -> bool:
        return self._error is not None

    async def flush(self) -> None:
        """Wait until every message has gone (or sending failed)."""
        while (self._queue or self._busy) and self._error is None:
            await self._lot.park()

    async def run(self) -> None:
        while True:
            while not self._queue:
                await self._lot.park()
            message = self._queue.popleft()
            if message["type"] == "http.response.body" and message.get("more_body", False):
                parts = [message.get("body", b"")]
                while message.get("more_body", False) and self._queue and self._queue[0]["type"] == message["type"]:
                    message = self._queue.popleft()
                    parts.append(message.get("body", b""))
                if len(parts) > 1:
                    more = message.get("more_body", False)
                    message = {"type": message["type"], "body": b"".join(parts), "more_body": more}
            self._busy = True
            try:
                await self._send(message)
            except Exception as exc:
                self._error = exc
                return
            finally:
                self._busy = False
                self._unsent -= len(message.get("body", b""))
                self._lot.unpark_all()


def _first_error(exc: BaseException) -> BaseException:
    """The first leaf of an exception group (a choice's error)."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


class _Turn:
    """One generation's session bookkeeping: the save error its session carried in (a header
    and a field of the final chunk or body), and, with ``--save sync``, the save that makes the
    turn durable before its final chunk."""

    def __init__(
        self,
        service: ModelService,
        runtime: Any,
        sid: str,
        public_sid: str | None,
        stream: RuntimeStream,
        parser: OutputParser,
        extras: list[_Choice] | None = None,
        cached: int | None = None,
    ) -> None:
        self.service = service
        self.parser = parser  # the reply's content and tool calls (client/serve/tools.py)
        self.extras = extras or []  # choices 1..n-1 (n > 1), on stateless forks of the session
        self.cached = cached  # n > 1: the prompt tokens the one prefill reused
        self.runtime = runtime
        self.sid = sid
        self.public_sid = public_sid
        self.stream = stream
        self.result: Any = None  # set once the generation ended well enough to answer
        self.saved = False
        record = service.record(sid) if public_sid is not None else None
        self.carried_error = record.save_error if record is not None else None

    def headers(self) -> dict[str, str]:
        out = {}
        if self.public_sid is not None:
            out["X-Session-Id"] = self.public_sid
        if self.carried_error is not None:
            out[SAVE_ERROR_HEADER] = _header_text(self.carried_error)
        return out

    async def settle(self, result: Any) -> dict[str, Any] | None:
        """The turn's ``session`` field (None for a stateless request), after its synchronous
        save under ``--save sync``."""
        self.result = result
        if self.public_sid is None:
            return None
        error = self.carried_error
        tokens = None
        if self.service.config.save_policy is SavePolicy.SYNC:
            with trio.CancelScope(shield=True):  # a save begun is finished, even if the client leaves
                outcome = await self.service.save_turn(self.runtime, self.sid, result)
            self.saved, tokens = outcome.saved, outcome.tokens
            error = outcome.error if not outcome.saved else None
        return {"id": self.public_sid, "durable": self.saved, "durable_tokens": tokens, "save_error": error}


def _header_text(text: str) -> str:
    """``text`` as a header value: printable ASCII, bounded."""
    return "".join(c if " " <= c <= "~" else "?" for c in text)[:300]


async def _start_events(send: Send, turn: _Turn) -> None:
    """The headers of a server-sent event stream, with the turn's own (session, save error)."""
    headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
    headers += [(k.lower().encode(), v.encode()) for k, v in turn.headers().items()]
    await send({"type": "http.response.start", "status": 200, "headers": headers})


async def _body(send: Send, data: bytes, more: bool = True) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": more})


def create_app(service: ModelService, metrics: ServerMetrics, config: AppConfig) -> ASGIApp:
    """The server's ASGI app over ``service``, behind the refusals of :class:`_Refuse`."""
    guard = _Guard(config, metrics)
    started = int(time.time())

    def model_object(name: str) -> dict[str, Any]:
        # max_model_len: the context length (vLLM's field, which aider and others read)
        return {
            "id": name,
            "object": "model",
            "created": started,
            "owned_by": "muxworker",
            "max_model_len": service.max_model_len(),
            # muxworker's own: how each tensor type is held (mapped GGUF blocks, dense) and which
            # passes run it.
            "weights": service.weight_groups(),
        }

    @_endpoint(guard, "health", auth=False)
    async def health(request: Request, tenant: Tenant) -> Response:
        # A failing store does not make the server unhealthy (restarting it would not help, and
        # every replica shares the store): it says "degraded" and what failed.
        store = service.store_health()
        if service.ready:
            return _json({"status": "ok" if store["status"] == "ok" else "degraded", "store": store})
        body = {"status": "unavailable", "reason": service.last_error or "starting", "store": store}
        return _json(body, 503, {"Retry-After": "1"})

    @_endpoint(guard, "routing", auth=False)
    async def routing(request: Request, tenant: Tenant) -> Response:
        # Only for the Ray replica that started this server (its own random token), whatever the API keys.
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {config.internal_token}".encode()):
            raise oa.APIError(401, "invalid internal token", type="authentication_error", code="invalid_api_key")
        return _json(service.routing_stats())

    @_endpoint(guard, "metrics", auth=False)
    async def metrics_endpoint(request: Request, tenant: Tenant) -> Response:
        config.policy.check_admin(request.headers)  # server-wide figures: not for a tenant's key
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @_endpoint(guard, "models")
    async def models(request: Request, tenant: Tenant) -> Response:
        return _json({"object": "list", "data": [model_object(config.model.id)]})

    @_endpoint(guard, "model")
    async def model(request: Request, tenant: Tenant) -> Response:
        return _json(model_object(config.model.named(request.path_params["model"])))

    @_endpoint(guard, "sessions")
    async def list_sessions(request: Request, tenant: Tenant) -> Response:
        return _json({"object": "list", "data": await service.list_sessions(tenant)})

    def _sid(request: Request, tenant: Tenant) -> tuple[str, str]:
        """The path's session id, public and internal: a client's id, or one of the implicit and
        response sessions the server opened for this tenant (as ``GET /v1/sessions`` lists them).
        Always within the caller's tenant: no path names another's session."""
        public = request.path_params["session_id"]
        if not (isinstance(public, str) and SERVER_SESSION_ID.fullmatch(public)):
            public = oa.check_session_id(public, "the session id in the path")
        return public, internal_id(tenant, public)

    @_endpoint(guard, "session")
    async def get_session(request: Request, tenant: Tenant) -> Response:
        public, sid = _sid(request, tenant)
        state = service.session_state(sid)
        info = None
        try:
            info = await service.session_info(sid)
        except CheckpointNotFound:
            if state is None:
                raise oa.APIError(404, f"no session {public!r}", code="session_not_found") from None
        return _json(session_object(tenant, sid, state, info, service.record(sid)))

    @_endpoint(guard, "session_delete")
    async def delete_session(request: Request, tenant: Tenant) -> Response:
        public, sid = _sid(request, tenant)
        if not await service.delete_session(sid):
            raise oa.APIError(404, f"no session {public!r}", code="session_not_found")
        return _json({"id": public, "object": "session.deleted", "deleted": True})

    @_endpoint(guard, "session_save")
    async def save_session(request: Request, tenant: Tenant) -> Response:
        public, sid = _sid(request, tenant)
        try:
            info = await service.save_now(sid)
        except CheckpointNotFound:
            raise oa.APIError(404, f"no session {public!r}", code="session_not_found") from None
        return _json(session_object(tenant, sid, service.session_state(sid), info, service.record(sid)))

    async def _stored(request: Request, tenant: Tenant) -> dict[str, Any]:
        rid = request.path_params["response_id"]
        doc = await service.load_response(tenant, rid)
        if doc is None:
            raise oa.APIError(404, f"no stored response {rid!r:.80}", code="response_not_found", param="response_id")
        return doc

    @_endpoint(guard, "response")
    async def get_response(request: Request, tenant: Tenant) -> Response:
        return _json((await _stored(request, tenant))["response"])

    @_endpoint(guard, "response_delete")
    async def delete_response(request: Request, tenant: Tenant) -> Response:
        rid = request.path_params["response_id"]
        if not await service.delete_response(tenant, rid):
            raise oa.APIError(404, f"no stored response {rid!r:.80}", code="response_not_found", param="response_id")
        return _json({"id": rid, "object": "response.deleted", "deleted": True})

    @_endpoint(guard, "response_input_items")
    async def response_input_items(request: Request, tenant: Tenant) -> Response:
        items = (await _stored(request, tenant))["input_items"]
        return _json(ra.item_page(items, request.query_params))

    async def not_found(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        err = oa.APIError(status, message.get(status, str(exc)), code="not_found" if status == 404 else "bad_method")
        guard.count("unrouted", status)
        return _error_response(err)

    chat = _GenerationEndpoint(service, guard, config, "chat")
    completions = _GenerationEndpoint(service, guard, config, "completions")
    responses_ep = _GenerationEndpoint(service, guard, config, "responses")
    routes = [
        Route("/health", health, methods=["GET"]),
        *([Route("/v1/internal/routing", routing, methods=["GET"])] if config.internal_token else []),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/responses", responses_ep, methods=["POST"]),
        Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", response_input_items, methods=["GET"]),
        Route("/v1/sessions", list_sessions, methods=["GET"]),
        Route("/v1/sessions/{session_id}", get_session, methods=["GET"]),
        Route("/v1/sessions/{session_id}", delete_session, methods=["DELETE"]),
        Route("/v1/sessions/{session_id}/save", save_session, methods=["POST"]),
    ]
    # Unversioned, as llama.cpp's server also serves them (clients given a base URL without /v1).
    routes += [
        Route("/models", models, methods=["GET"]),
        Route("/models/{model:path}", model, methods=["GET"]),
        Route("/chat/completions", chat, methods=["POST"]),
        Route("/completions", completions, methods=["POST"]),
        Route("/responses", responses_ep, methods=["POST"]),
        Route("/responses/{response_id}", get_response, methods=["GET"]),
        Route("/responses/{response_id}", delete_response, methods=["DELETE"]),
        Route("/responses/{response_id}/input_items", response_input_items, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})
    return _AccessLog(_Refuse(app, guard))
