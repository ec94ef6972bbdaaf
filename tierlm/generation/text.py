"""A row's text as its tokens come: stop strings found, text held back that may begin one."""

from __future__ import annotations

from dataclasses import dataclass, field

from tierlm.generation.config import GenerationConfig


@dataclass
class TextTracker:
    """Incremental text of one row; finds stop strings and holds back text that may start one."""

    decoder: object  # the tokenizer's stream decoder
    stops: tuple[str, ...]
    text: str = ""
    emitted: int = 0
    stopped_at: int | None = None
    after: int = 0  # the row's min_new_tokens: stop strings are looked for in the text of later tokens only
    include: bool = False  # the text keeps the stop string it ends with (vLLM's include_stop_str_in_output)
    pushed: int = 0
    cut: int | None = None  # where the text ends once a stop string was found
    matched: str | None = None  # that stop string
    _hold: int = field(init=False)

    def __post_init__(self) -> None:
        self._hold = max((len(s) for s in self.stops), default=1) - 1

    def push(self, token: int) -> None:
        if self.stopped_at is not None:
            return
        start = max(0, len(self.text) - self._hold)
        self.text += self.decoder.push(token)
        self.pushed += 1
        if self.pushed <= self.after:  # no stop string ends the text of a row's first `after` tokens
            return
        hits = [(i, k) for k, s in enumerate(self.stops) if (i := self.text.find(s, start)) >= 0]
        if hits:  # the earliest; at one place, the first in the list
            self.stopped_at, k = min(hits)
            self.matched = self.stops[k]
            self.cut = self.stopped_at + (len(self.stops[k]) if self.include else 0)

    def finish(self) -> None:
        if self.stopped_at is None:
            self.text += self.decoder.flush()

    @property
    def final(self) -> str:
        return self.text if self.cut is None else self.text[: self.cut]

    def delta(self, finished: bool) -> str:
        """New text safe to show: all of it when finished, else all but what could begin a stop string."""
        end = len(self.final) if finished or self.stopped_at is not None else len(self.text) - self._hold
        out = self.final[self.emitted : max(end, self.emitted)]
        self.emitted += len(out)
        return out


def text_tracker(tokenizer, stops: tuple[str, ...], config: GenerationConfig) -> TextTracker:
    """A row's TextTracker with its config's stop settings."""
    return TextTracker(
        tokenizer.stream_decoder(skip_special_tokens=config.skip_special_tokens),
        stops,
        after=config.min_new_tokens,
        include=config.include_stop_str_in_output,
    )


def stop_reason(tracker: TextTracker, config: GenerationConfig, token: int) -> int | str | None:
    """vLLM's stop_reason of a row that ended with finish reason "stop" on `token`: that token where it is
    one of the row's stop_token_ids, else the stop string its text ended on; None for EOS or a complete
    response_format document."""
    return token if token in config.stop_token_ids else tracker.matched
