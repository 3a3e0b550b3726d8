"""The server's request handling apart from HTTP: requests validated into queued jobs, and the
one worker thread that owns the model and runs them one at a time (HTTP threads only parse,
enqueue and format, so generations never interleave). The queue is bounded: 503 when full.

The worker drives a backend (`reap.serve.backend.EngineBackend` or any object with its members).
Detokenization, stop strings, end-of-turn ids and `max_tokens` are handled here, identically
for every backend. With no `seed`, requests use seed 0: the same request gives the same text.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from reap.errors import EXIT_USAGE, ReapError
from reap.serve.params import (
    Params,
    RequestError,
    check_prompt_chars,
    completion_ids,
    parse_messages,
    parse_params,
    template_kwargs,
    thinking_option,
)
from reap.serve.stream import Reply, TextStream
from reap.tokenizer import encode_prompt

_ERROR_TYPE = {400: "invalid_request_error", 500: "server_error"}


class ApiError(Exception):
    """An HTTP error with OpenAI's error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param,
                          "code": self.code}}


@dataclass
class Job:
    """One queued generation; the worker posts ("delta", text), ("done", finish_reason, n_tokens)
    or ("error", ApiError) to `events`."""

    ids: list[int]
    params: Params
    stop: tuple[str, ...] = ()
    stop_ids: set = field(default_factory=set)  # token ids that end generation (EOS, turn end)
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)


def wait_events(job: Job) -> Iterator[tuple]:
    """The job's events until its final one."""
    while True:
        ev = job.events.get()
        yield ev
        if ev[0] != "delta":
            return


class Worker:
    """The one thread that owns the backend; runs queued jobs one at a time, in order."""

    def __init__(self, backend, queue_size: int = 16):
        self.backend = backend
        self.jobs: queue.Queue = queue.Queue(maxsize=queue_size)
        self.served, self.current, self.stopping = 0, None, False
        self.thread = threading.Thread(target=self._loop, name="reap-engine", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        """Enqueue `job`; ApiError(503) when the queue is full."""
        try:
            if self.stopping:
                raise queue.Full
            self.jobs.put_nowait(job)
        except queue.Full:
            raise ApiError(503, "the server is busy: request queue is full, retry later",
                           type_="server_error", code="queue_full") from None

    def stop(self, seconds: float = 5.0) -> bool:
        """Cancel the running job and fail the queued ones (503); True when the engine thread
        ended within `seconds`."""
        self.stopping = True
        if (job := self.current) is not None:
            job.cancelled.set()
        gone = ApiError(503, "the server is shutting down", "server_error")
        with contextlib.suppress(queue.Empty):
            while True:
                if (job := self.jobs.get_nowait()) is not None:
                    job.events.put(("error", gone))
        self.jobs.put(None)  # the queue was just drained and takes no new job: never blocks
        self.thread.join(timeout=seconds)
        return not self.thread.is_alive()

    def _loop(self) -> None:
        while (job := self.jobs.get()) is not None:
            self.current = job
            try:
                self._run(job)
            except ApiError as e:
                job.events.put(("error", e))
            except ReapError as e:  # the engine refused the request, or failed
                status = 400 if e.exit_code == EXIT_USAGE else 500
                job.events.put(("error", ApiError(status, str(e), _ERROR_TYPE[status])))
            except Exception as e:  # noqa: BLE001 - must not kill the server
                job.events.put(("error", ApiError(500, f"generation failed: {e}", "server_error")))
            self.served += 1

    def _run(self, job: Job) -> None:
        p, b = job.params, self.backend
        failed = len(b.expert_failures)
        stream = TextStream(b.decode, job.stop + p.stop)
        it = b.tokens(job.ids, max_tokens=p.max_tokens, temperature=p.temperature,
                      top_p=p.top_p, seed=p.seed)
        n, reason = 0, "length"
        try:
            for token in it:
                n += 1
                if token in job.stop_ids or job.cancelled.is_set():
                    reason = "stop"
                    break
                delta = stream.feed(token)
                if delta:
                    job.events.put(("delta", delta))
                if stream.done or n >= p.max_tokens:
                    reason = "stop" if stream.done else reason
                    break
        finally:
            it.close()  # ends the engine's generation early, if it is still running
        if tail := stream.flush():
            job.events.put(("delta", tail))
        if lost := b.expert_failures[failed:]:  # untrustworthy tokens: an error, not text
            layer, expert, why = lost[0]
            raise ApiError(500, f"{len(lost)} routed expert load(s) failed (first: layer {layer} "
                                f"expert {expert}: {why}); the output is not trustworthy",
                           "server_error", code="expert_load_failed")
        job.events.put(("done", reason, n))


class App:
    """Request handling independent of HTTP plumbing: validation, queueing, models list."""

    def __init__(self, backend, queue_size: int, max_tokens_limit: int, max_prompt_chars: int):
        self.backend = backend
        self.limit = max_tokens_limit
        self.max_prompt_chars = max_prompt_chars  # longer prompts are refused untokenized
        self.worker = Worker(backend, queue_size)
        self.created = int(time.time())

    def models(self) -> dict:
        card = {"id": self.backend.model_id, "object": "model", "created": self.created,
                "owned_by": "reap"}
        return {"object": "list", "data": [card]}

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model not in (None, "", self.backend.model_id):
            raise ApiError(404, f"model {model!r} does not exist; this server serves "
                                f"{self.backend.model_id!r}", param="model", code="model_not_found")

    def prepare(self, route: str, body: dict) -> tuple[Job, Reply]:
        """Validate a POST body and build its job and reply formatter (ApiError on bad input)."""
        self._check_model(body)
        b, is_chat = self.backend, route == "chat"
        stop, thinking = (), False
        try:
            if not is_chat:
                ids = completion_ids(body, b.encode, b.special, self.max_prompt_chars)
            else:
                messages = parse_messages(body.get("messages"))
                check_prompt_chars(sum(len(m.content) + len(m.reasoning) for m in messages),
                                   self.max_prompt_chars, "messages")
                prompt = b.template.render(messages, thinking_option(body), template_kwargs(body),
                                           self.max_prompt_chars)
                check_prompt_chars(len(prompt), self.max_prompt_chars, "messages")
                ids = encode_prompt(prompt, b.encode, b.special,
                                    protected=bool(b.template.protected))
                stop, thinking = b.template.stop, b.template.opens_thinking(prompt)
            context = getattr(b, "context", None)
            room = self.limit if context is None else min(self.limit, context - len(ids))
            if room < 1:
                where = "messages" if is_chat else "prompt"
                raise RequestError(f"the prompt of {len(ids)} tokens leaves no room in the "
                                   f"{context}-token context", where, "context_length_exceeded")
            default = room if is_chat else min(16, room)
            sampling = parse_params(body, default_max=default, limit=room)
        except RequestError as e:
            raise ApiError(400, str(e), param=e.param, code=e.code) from None
        stop_ids = {b.special[s] for s in stop if s in b.special} | {b.eos_id}
        reply = Reply(b.model_id, len(ids), is_chat, thinking, b.template.think_close,
                      b.template.think_open)
        return Job(ids, sampling, stop, stop_ids), reply
