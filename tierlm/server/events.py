"""What the asyncio side and the worker thread hand each other: a queued `Request`, the `Event`s that answer
it, and the two refusals (`QueueFull`, `ShuttingDown`)."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

from tierlm.generation.config import GenerationConfig
from tierlm.generation.loop import TokenLogprob, row_seed

SHUTDOWN_MESSAGE = "the server is shutting down; the request was not completed"


class QueueFull(Exception):
    """More requests are waiting than the server queues."""


class ShuttingDown(Exception):
    """The server no longer accepts requests."""


@dataclass(frozen=True)
class Event:
    """What the worker tells a request: a text delta, its end ("done"), or a failure ("error")."""

    kind: str
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop token id or string a "stop" finish ended on
    completion_tokens: int = 0
    tokens: int = 0  # the choice's tokens so far (a delta's)
    index: int = 0  # the choice's index in the response
    logprobs: tuple[TokenLogprob, ...] = ()  # of the tokens this event adds, when the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with a choice's first event, when asked


_ids = itertools.count()


@dataclass(eq=False)
class Request:
    """One queued generation; `queue` lives on the asyncio side and receives Events."""

    prompt_ids: list[int]
    max_tokens: int
    stops: tuple[str, ...]
    config: (
        GenerationConfig  # this request's sampling settings; config.n choices, max_new_tokens = max_tokens
    )
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # requests of one response may share one
    index: int = 0  # the response's index of this request's first choice (several prompts, one response)
    id: int = field(default_factory=lambda: next(_ids))
    cancelled: bool = False  # set by the asyncio side when the client goes away
    ended: bool = False  # every choice sent "done", or one an "error"
    tokens: int = 0
    choices_done: int = 0

    @property
    def n(self) -> int:
        return self.config.n

    def choice_config(self, choice: int) -> GenerationConfig:
        """The settings of one choice sampled on its own row: a seeded request's choice i draws from
        row_seed(seed, i), as the library's n samples do."""
        seed = None if self.config.seed is None else row_seed(self.config.seed, choice)
        return self.config.replace(n=1, seed=seed)

    def emit(self, event: Event) -> None:
        """Hand an event to the request's event loop; never blocks the worker."""
        if self.ended:
            return
        if event.kind == "done":
            self.choices_done += 1
        self.ended = event.kind == "error" or self.choices_done == self.n
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass
