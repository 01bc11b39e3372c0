"""A generation's output as the client reads it: text deltas, token ids and logprobs as they
arrive, then the result (:class:`GenerationStream`, which ``MultiplexedWorkerClient.generate``
returns)."""

from __future__ import annotations

import dataclasses
from typing import Any

from muxworker.transport.errors import MuxError
from muxworker.transport.messages import GenerationResult, TokenLogprob

from .connection import Connection, Request, fresh

__all__ = ["GenerationStream"]


class GenerationStream:
    """The output of one generation: ``async for text in stream``, then ``await stream.wait()``.

    Iteration yields the text deltas as the worker produces them; :meth:`wait` reads the rest and
    returns the :class:`GenerationResult` (or raises the request's error). :meth:`cancel` asks the
    worker to stop (a request not yet sent is never sent); :meth:`aclose` cancels and waits until the
    request has settled.
    """

    def __init__(self, connection: Connection, request: Request, session_id: str, *, logprobs: bool = False) -> None:
        self._connection = connection
        self._request = request
        self.session_id = session_id
        self._chunks: list[str] = []
        self._token_ids: list[int] = []
        self._logprobs: list[TokenLogprob] | None = [] if logprobs else None
        self._result: GenerationResult | None = None
        self._error: BaseException | None = None

    @property
    def request_id(self) -> int:
        return self._request.rid

    @property
    def text(self) -> str:
        """The text received so far."""
        return "".join(self._chunks)

    @property
    def token_ids(self) -> list[int]:
        """The token ids received so far (a copy)."""
        return list(self._token_ids)

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """One :class:`TokenLogprob` per token id received so far (a copy), when the request asked
        for ``logprobs``; None otherwise."""
        return None if self._logprobs is None else list(self._logprobs)

    def logprobs_from(self, start: int) -> list[TokenLogprob]:
        """The logprobs received from token ``start`` on (empty when none were asked for)."""
        return [] if self._logprobs is None else self._logprobs[start:]

    @property
    def finished(self) -> bool:
        """Whether the request has ended (its result or error is known; unread text may remain)."""
        return self._request.settled

    @property
    def _ended(self) -> bool:
        # The consumer has reached the end: the outcome has been taken from the request.
        return self._result is not None or self._error is not None

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> str:
        while True:
            if self._ended:
                if self._error is not None:
                    raise fresh(self._error)
                raise StopAsyncIteration
            frame = await self._connection.next_token_frame(self._request)
            if frame is None:
                self._finish()
                continue
            text = self._take(frame.control)
            if text:
                return text

    def _take(self, control: dict[str, Any]) -> str:
        """Keep a token frame's ids, text and logprobs; returns its text."""
        self._token_ids.extend(control["token_ids"])
        if self._logprobs is not None:
            self._logprobs.extend(TokenLogprob.from_wire(control))
        text = control["text"]
        if text:
            self._chunks.append(text)
        return text

    def _finish(self) -> None:
        try:
            result = self._connection.outcome(self._request)
        except BaseException as exc:
            self._error = exc
            raise
        if self._logprobs is not None:
            result = dataclasses.replace(result, logprobs=tuple(self._logprobs))
        self._result = result

    async def wait(self) -> GenerationResult:
        """Read the rest of the output and return the result (raises the request's error)."""
        while not self._ended:
            frame = await self._connection.next_token_frame(self._request)
            if frame is None:
                self._finish()
            else:
                self._take(frame.control)
        if self._error is not None:
            raise fresh(self._error)
        assert self._result is not None
        return self._result

    def cancel(self) -> None:
        """Ask for the generation to stop; it ends with finish_reason "cancelled". Idempotent."""
        self._connection.cancel_request(self._request)

    async def aclose(self) -> None:
        """Cancel unless finished, and wait until the request has settled (errors are dropped)."""
        if not self._request.settled:
            self.cancel()
        try:
            await self.wait()
        except MuxError:
            pass

    async def __aenter__(self) -> GenerationStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
