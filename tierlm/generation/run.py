"""generate() and stream(): prompts in, tokens and text out, through the cache and the compile decision."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from tierlm.cache import DynamicCache, StaticCache, bucket_length
from tierlm.compile import CompileDecision, decide, warn_if_skipped
from tierlm.generation.config import GenerationConfig
from tierlm.generation.loop import Batch, LoopState, StepEvent, left_pad, run_decode


@dataclass
class GenerationStats:
    prompt_tokens: int
    new_tokens: int
    prefill_seconds: float
    decode_seconds: float
    decode_tokens_per_s: float  # all rows together
    batch_size: int
    cache: str
    compile: CompileDecision


@dataclass
class GenerationResult:
    token_ids: list[list[int]]
    texts: list[str]
    finish_reasons: list[str]
    stats: GenerationStats


@dataclass
class TextTracker:
    """Incremental text of one row; finds stop strings and holds back text that may start one."""

    decoder: object  # the tokenizer's stream decoder
    stops: tuple[str, ...]
    text: str = ""
    emitted: int = 0
    stopped_at: int | None = None
    _hold: int = field(init=False)

    def __post_init__(self) -> None:
        self._hold = max((len(s) for s in self.stops), default=1) - 1

    def push(self, token: int) -> None:
        if self.stopped_at is not None:
            return
        start = max(0, len(self.text) - self._hold)
        self.text += self.decoder.push(token)
        hits = [i for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if hits:
            self.stopped_at = min(hits)

    def finish(self) -> None:
        if self.stopped_at is None:
            self.text += self.decoder.flush()

    @property
    def final(self) -> str:
        return self.text if self.stopped_at is None else self.text[: self.stopped_at]

    def delta(self, finished: bool) -> str:
        """New text safe to show: all of it when finished, else all but what could begin a stop string."""
        end = len(self.final) if finished or self.stopped_at is not None else len(self.text) - self._hold
        out = self.final[self.emitted : max(end, self.emitted)]
        self.emitted += len(out)
        return out


class Generation:
    """One generate() call over a batch: builds the cache, decides compilation, runs the loop."""

    def __init__(
        self,
        model,
        prompts,
        config: GenerationConfig,
        row_max_new_tokens: list[int] | None = None,
        row_stops: list[tuple[str, ...]] | None = None,
    ) -> None:
        """Rows share `config`, except optional per-row max_new_tokens (<= config's) and stop strings."""
        self.model, self.config = model, config
        tok = model.tokenizer
        rows = encode_prompts(tok, prompts)
        cfg = model.config
        self.eos_ids = config.eos_token_id or tuple(tok.eos_token_ids if tok else cfg.eos_token_ids)
        pad = tok.pad_token_id if tok is not None else cfg.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)
        self.batch: Batch = left_pad(rows, self.pad_id, model.device)
        self.cache = self._make_cache(self.batch.ids.shape[1])
        if row_max_new_tokens is not None and max(row_max_new_tokens) > config.max_new_tokens:
            raise ValueError("per-row max_new_tokens may not exceed the config's max_new_tokens")
        self.decision = decide(
            model.device_map, self.cache, config, uncompilable=model.uncompilable_reasons()
        )
        warn_if_skipped(self.decision, config)
        self.state = LoopState(limits=list(row_max_new_tokens or []))
        stops = row_stops or [config.stop] * len(rows)
        self.trackers = None
        if tok is not None:
            self.trackers = [TextTracker(tok.stream_decoder(), s) for s in stops]
        elif any(stops):
            raise ValueError("stop strings need a tokenizer; this model has none")

    def _make_cache(self, width: int):
        c, cfg = self.config, self.model.config
        needed = width + c.max_new_tokens
        if width > cfg.max_position_embeddings:
            raise ValueError(
                f"prompt of {width} tokens exceeds the model's context of {cfg.max_position_embeddings}"
            )
        b = self.batch.ids.shape[0]
        if c.cache_implementation == "dynamic":
            self.model.decoder.ensure_rope(needed, self.model.device)
            return DynamicCache(cfg, b, self.model.device)
        length = c.max_cache_len or bucket_length(needed, cfg.max_position_embeddings)
        if width > length:
            raise ValueError(
                f"prompt of {width} tokens is longer than the static cache (max_cache_len={length})"
            )
        if needed > length:
            raise ValueError(
                f"prompt of {width} tokens plus max_new_tokens={c.max_new_tokens} needs {needed} cache slots, "
                f"more than max_cache_len={length}"
            )
        self.model.decoder.ensure_rope(length, self.model.device)
        return self.model.static_cache(b, length)

    def _prefill(self) -> torch.Tensor:
        width = self.batch.ids.shape[1]
        if isinstance(self.cache, StaticCache):
            self.cache.limit = width
        logits = self.model.decoder(
            self.batch.ids, attention_mask=self.batch.mask, cache=self.cache, last_only=True
        )
        return logits[:, -1].float()

    def _step(self):
        if self.decision.compile:
            return self.model.compiled_step(self.cache, self.config.compile_config)
        return self.model.eager_step(self.cache)

    def events(self) -> Iterator[list[StepEvent]]:
        should_stop = None
        if self.trackers is not None and any(t.stops for t in self.trackers):

            def should_stop(row: int) -> bool:
                return self.trackers[row].stopped_at is not None

        loop = run_decode(
            self._prefill,
            self._step(),
            self.batch,
            self.config,
            self.eos_ids,
            self.pad_id,
            self.model.config.vocab_size,
            self.state,
            self._tracked(should_stop),
        )
        yield from loop

    def _tracked(self, should_stop):
        """Feed each new token to its row's text tracker before the loop asks whether to stop."""
        if self.trackers is None:
            return should_stop

        def check(row: int) -> bool:
            self.trackers[row].push(self.state.tokens[row][-1])
            return should_stop(row) if should_stop else False

        return check

    def stream(self) -> Iterator[tuple[int, str, bool, str | None]]:
        """Yield (row, text delta, finished, finish_reason) per row and step."""
        if self.trackers is None:
            raise ValueError("streaming text needs a tokenizer; this model has none")
        with torch.inference_mode():
            for events in self.events():
                for e in events:
                    if e.finished:
                        self.trackers[e.row].finish()
                    yield e.row, self.trackers[e.row].delta(e.finished), e.finished, e.finish_reason

    def cancel(self, row: int) -> None:
        """End `row` at the next step boundary (e.g. its client went away)."""
        self.state.cancelled.add(row)

    def result(self) -> GenerationResult:
        texts = []
        if self.trackers is not None:
            for t in self.trackers:
                t.finish()
                texts.append(t.final)
        s = self.state
        new = sum(len(t) for t in s.tokens)
        decode_tokens = new - len(s.tokens)
        stats = GenerationStats(
            prompt_tokens=int(self.batch.mask.sum()),
            new_tokens=new,
            prefill_seconds=s.prefill_seconds,
            decode_seconds=s.decode_seconds,
            decode_tokens_per_s=decode_tokens / s.decode_seconds if s.decode_seconds > 0 else 0.0,
            batch_size=len(s.tokens),
            cache=self.cache.kind,
            compile=self.decision,
        )
        return GenerationResult(s.tokens, texts, [r or "length" for r in s.finish_reasons], stats)


def encode_prompts(tokenizer, prompts) -> list[list[int]]:
    """A string, a list of strings, or token ids ([s] or [b, s] LongTensor, or lists of ints)."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dtype not in (torch.long, torch.int32) or prompts.dim() not in (1, 2):
            raise ValueError("token-id prompts must be a LongTensor of shape [seq] or [batch, seq]")
        rows = prompts.reshape(-1, prompts.shape[-1]).tolist()
    elif isinstance(prompts, str):
        rows = [_encode(tokenizer, prompts)]
    elif isinstance(prompts, list) and prompts and all(isinstance(p, str) for p in prompts):
        rows = [_encode(tokenizer, p) for p in prompts]
    elif isinstance(prompts, list) and prompts and all(isinstance(p, list) for p in prompts):
        rows = [list(map(int, p)) for p in prompts]
    else:
        raise ValueError(
            "prompts must be a string, a non-empty list of strings, or a LongTensor of token ids"
        )
    if any(len(r) == 0 for r in rows):
        raise ValueError("empty prompt: every prompt needs at least one token")
    return rows


def _encode(tokenizer, text: str) -> list[int]:
    if tokenizer is None:
        raise ValueError("text prompts need a tokenizer; this model has none (pass token ids)")
    if not text:
        raise ValueError("empty prompt: every prompt needs at least one token")
    return tokenizer.encode(text)
