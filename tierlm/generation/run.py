"""generate() and stream(): prompts in, tokens and text out, through the cache and the compile decision."""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass

import torch

from tierlm.cache import DynamicCache, StaticCache, bucket_length
from tierlm.compile import CompileDecision, decide, warn_if_skipped
from tierlm.errors import RequestError
from tierlm.generation.bad_words import BadWords
from tierlm.generation.beam import BeamSearch, run_beams
from tierlm.generation.config import GenerationConfig
from tierlm.generation.grammar import GrammarMask
from tierlm.generation.loop import (
    Batch,
    LoopState,
    Sampler,
    StepEvent,
    TokenLogprob,
    left_pad,
    run_decode,
)
from tierlm.generation.prompts import PromptLogprobs, check_ids, check_vocab_settings, encode_prompts
from tierlm.generation.slots import RowsView
from tierlm.generation.text import stop_reason, text_tracker


def eos_token_ids(model, config) -> tuple[int, ...]:
    """The token ids that end a sequence: the config's, else the tokenizer's (else the model config's)."""
    tok = model.tokenizer
    return config.eos_token_id or tuple(tok.eos_token_ids if tok else model.config.eos_token_ids)


@dataclass
class GenerationStats:
    prompt_tokens: int
    new_tokens: int
    prefill_seconds: float
    decode_seconds: float
    decode_tokens_per_s: float  # all rows together (with beam search: every beam's token of every step)
    batch_size: int
    cache: str
    compile: CompileDecision


@dataclass
class GenerationResult:
    """One row per prompt and sample (prompt-major: with n=2, rows 0 and 1 are the first prompt's)."""

    token_ids: list[list[int]]
    texts: list[str]
    finish_reasons: list[str]
    stats: GenerationStats
    logprobs: list[list[TokenLogprob]] | None = None  # per generated token, when config.logprobs is set
    prompt_logprobs: list[list[TokenLogprob | None]] | None = None  # per prompt token; the first is None
    scores: list[float] | None = None  # beam search: each sequence's score (transformers' sequences_scores)


class Generation:
    """One generate() call over a batch: builds the cache, decides compilation, runs the loop."""

    def __init__(
        self,
        model,
        prompts,
        config: GenerationConfig,
        row_max_new_tokens: list[int] | None = None,
        row_stops: list[tuple[str, ...]] | None = None,
        own_cache: bool = False,
        row_configs: list[GenerationConfig] | None = None,
    ) -> None:
        """Rows share `config`, except optional per-row max_new_tokens (<= config's), stop strings and
        sampling settings (`row_configs`, one per prompt). With config.n > 1 each prompt gets n rows; with
        config.num_beams > 1, num_beams rows (its beams), and the result the best n of them.

        own_cache: a static cache of its own rather than the model's reusable one of this shape, for a
        generation that runs beside another of the same shape; it cannot use the model's compiled step.
        """
        self.model, self.config = model, config
        tok = model.tokenizer
        n = config.num_beams if config.num_beams > 1 else config.n  # rows per prompt
        if config.num_beams > 1 and row_configs is not None:
            raise RequestError("beam search runs one GenerationConfig for all its prompts (no row_configs)")
        prompt_rows = encode_prompts(tok, prompts)
        check_ids(prompt_rows, model.config.vocab_size)
        check_vocab_settings([config, *(row_configs or [])], model.config.vocab_size)
        rows = [r for r in prompt_rows for _ in range(n)]
        self.n, self.prompt_count = n, len(prompt_rows)
        self.row_configs = [c for c in (row_configs or [config] * len(prompt_rows)) for _ in range(n)]
        self.choices = [i % n for i in range(len(rows))]
        row_max_new_tokens = _repeat(row_max_new_tokens, n)
        row_stops = _repeat(row_stops, n)
        cfg = model.config
        self.eos_ids = eos_token_ids(model, config)
        pad = tok.pad_token_id if tok is not None else cfg.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)
        self.batch: Batch = left_pad(rows, self.pad_id, model.device)
        self.holder = object()  # what this generation stamps on the model's shared cache it takes
        self.cache = self._make_cache(self.batch.ids.shape[1], own_cache)
        if row_max_new_tokens is not None and max(row_max_new_tokens) > config.max_new_tokens:
            raise RequestError("per-row max_new_tokens may not exceed the config's max_new_tokens")
        self.decision = self._decide(own_cache)
        self.step = self._step()  # taken now, beside the cache it is built for
        self.prefilled = False  # the whole prompt is in the cache
        self._units: Iterator[list[StepEvent]] | None = None
        self.state = LoopState(limits=list(row_max_new_tokens or [config.max_new_tokens] * len(rows)))
        self.prompt_logprobs: list[list[TokenLogprob | None]] | None = None
        self.search, self._final = None, None
        if config.num_beams > 1:
            ends = () if config.ignore_eos else tuple(dict.fromkeys(self.eos_ids + config.stop_token_ids))
            self.search = BeamSearch(len(prompt_rows), config, ends, model.device)
        stops = row_stops or [config.stop] * len(rows)
        self.trackers = None
        if tok is not None:
            self.trackers = [text_tracker(tok, s, c) for s, c in zip(stops, self.row_configs)]
        elif any(stops):
            raise RequestError("stop strings need a tokenizer; this model has none")

    def _decide(self, own_cache: bool):
        """The compile decision for this generation's cache (warned once per cause when it skips a compile
        the config asked for)."""
        model, config = self.model, self.config
        decision = decide(
            model.device_map,
            self.cache,
            config,
            uncompilable=model.uncompilable_reasons(),
            device=str(model.device),  # the resolved execution device: it honours execution_device=
            layers=model.config.num_layers,
        )
        warn_if_skipped(decision, config)
        if own_cache and decision.compile:
            raise RequestError(
                "a generation with its own cache cannot use the compiled step (set disable_compile)"
            )
        return decision

    def _make_cache(self, width: int, own: bool):
        c, cfg, device = self.config, self.model.config, self.model.device
        b = self.batch.ids.shape[0]
        length = static_cache_length(c, cfg, width)
        if length is None:  # the eager step grows the rotary tables as a dynamic cache grows
            self.model.decoder.ensure_rope(width + 1, device)
            return DynamicCache(cfg, b, device)
        try:
            self.model.decoder.ensure_rope(length, device)
            if own:
                return StaticCache(cfg, b, length, self.model.dtype, device)
            with self.model.work_lock:  # not while another generation's unit of work runs on it
                cache = self.model.static_cache(b, length)
                cache.holder = self.holder
        except (RuntimeError, OverflowError) as e:
            if isinstance(e, RuntimeError) and not _out_of_memory(e):
                raise  # not the size (a device error, a bug): as it is
            raise RequestError(
                f"a static cache of {length} slots (prompt of {width} tokens plus max_new_tokens="
                f"{c.max_new_tokens}) cannot be allocated: {str(e).splitlines()[0]}; lower max_new_tokens or set "
                "max_cache_len"
            ) from None
        return cache

    def _check_holder(self) -> None:
        """One clear error where a later generation of this shape took the model's shared cache: this one's
        keys and values are gone (it would go on from another prompt's)."""
        if getattr(self.cache, "holder", self.holder) is not self.holder:
            raise RequestError(
                "this generation's cache was taken by a later generation of the same shape on this model (one "
                "reusable cache per batch and length): finish a stream before starting another, or start it "
                "with own_cache=True"
            )

    def _prefill(self) -> Generator[list[StepEvent], None, torch.Tensor]:
        """Feed the prompt to the cache `prefill_chunk` columns at a time, yielding [] between chunks.

        Each chunk attends to the cached keys of the chunks before it: the same attention as one forward of
        the whole prompt, in smaller matmuls (and a [chunk, length] score matrix, not [width, width]).
        With n > 1 and a static cache, one row per prompt is prefilled and copied to its n - 1 siblings
        (every row is prefilled where the model has sliding-window layers).
        """
        ids, mask = self.batch.ids, self.batch.mask
        # n > 1 shares one prefill per prompt, copied slot for slot: not into a sliding layer's ring buffer
        share = self.n > 1 and isinstance(self.cache, StaticCache) and not any(self.model.decoder.sliding)
        cache = RowsView(self.cache, slice(None, None, self.n)) if share else self.cache
        if share:
            ids, mask = ids[:: self.n], mask[:: self.n]
        width = ids.shape[1]
        chunk = self.config.prefill_chunk or width
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # as the decoder computes them for a whole row
        wanted = [c.prompt_logprobs for c in self.row_configs[:: self.n]]
        top = None if all(w is None for w in wanted) else max(w or 0 for w in wanted)
        prompt_lp = PromptLogprobs(ids, mask, top) if top is not None else None
        for start in range(0, width, chunk):
            began, end = time.perf_counter(), min(start + chunk, width)
            logits = self.model.decoder(
                ids[:, start:end],
                attention_mask=mask[:, start:end],
                positions=positions[:, start:end],
                cache=cache,
                slots=torch.arange(start, end, device=ids.device),
                last_only=prompt_lp is None,
                length=end,  # read only the slots written so far (a dynamic cache holds no more)
            )
            if prompt_lp is not None:
                prompt_lp.add(logits, start)
            self.state.prefill_seconds += time.perf_counter() - began
            if end < width:
                yield []
        if prompt_lp is not None:
            self.prompt_logprobs = _repeat(prompt_lp.rows(wanted), self.n)
        last = logits[:, -1].float()
        if share:
            cache.copy_to_siblings(self.n, width)
            last = last.repeat_interleave(self.n, dim=0)
        self.prefilled = True
        return last

    def _step(self):
        if self.decision.compile:
            return self.model.compiled_step(self.cache, self.decision.config)  # scope "layer" under offload
        return self.model.eager_step(self.cache)

    def events(self) -> Iterator[list[StepEvent]]:
        should_stop = None
        if self.trackers is not None and any(t.stops for t in self.trackers):

            def should_stop(row: int) -> bool:
                return self.trackers[row].stopped_at is not None

        if self.search is not None:
            loop = run_beams(self._prefill(), self.step, self.batch, self.search, self.cache, self.state)
        else:
            loop = self._sampled(should_stop)
        while True:  # each unit of work (a prefill chunk, a decode step) holds the model's cache
            with self.model.work_lock:
                self._check_holder()
                events = next(loop, None)
            if events is None:
                return
            yield events

    def _sampled(self, should_stop) -> Iterator[list[StepEvent]]:
        sampler = self._sampler()
        return run_decode(
            self._prefill(),
            self.step,
            self.batch,
            sampler,
            self.pad_id,
            self.state,
            self._tracked(should_stop, sampler),
        )

    def _sampler(self) -> Sampler:
        eos = torch.tensor(self.eos_ids, dtype=torch.long, device=self.batch.ids.device)  # may be empty
        b = self.batch.ids.shape[0]
        sampler = Sampler(b, self.model.config.vocab_size, eos, self.batch.ids.device)
        if self.model.tokenizer is not None:
            sampler.bad_words = BadWords(self.model.tokenizer, b)
        if any(c.response_format is not None for c in self.row_configs):
            sampler.grammar = GrammarMask(self.model.tokenizer, b, self.model.config.vocab_size, self.eos_ids)
        for row in range(b):
            prompt = self.batch.ids[row][self.batch.mask[row]].tolist()
            sampler.set_row(row, self.row_configs[row], prompt, self.choices[row], self.state.limits[row])
        return sampler

    def _tracked(self, should_stop, sampler: Sampler):
        """Feed each new token to its row's text tracker before the loop asks whether to stop; a token that
        ends the row (EOS, stop_token_ids) adds no text unless include_stop_str_in_output, as vLLM's."""
        if self.trackers is None:
            return should_stop

        def check(row: int) -> bool:
            token = self.state.tokens[row][-1]
            tracker = self.trackers[row]
            if tracker.include or not sampler.ends_with(row, token):
                tracker.push(token)
            return should_stop(row) if should_stop else False

        return check

    def advance(self) -> list[tuple[int, str, bool, str | None]] | None:
        """Run one unit of work (a prefill chunk or a decode step) and return its (row, text delta, finished,
        finish_reason) updates, [] for a prefill chunk; None once the generation is over."""
        if self.trackers is None:
            raise RequestError("streaming text needs a tokenizer; this model has none")
        if self.search is not None:
            return self._beam_advance()
        if self._units is None:
            self._units = self.events()
        with torch.inference_mode():  # entered per unit: generations may be advanced in turns
            events = next(self._units, None)
        if events is None:
            return None
        updates = []
        for e in events:
            if e.finished:
                self.trackers[e.row].finish()
            updates.append((e.row, self.trackers[e.row].delta(e.finished), e.finished, e.finish_reason))
        return updates

    def _beam_advance(self) -> list[tuple[int, str, bool, str | None]] | None:
        """A beam search's units give [] until it ends; then one update per returned beam (row i: the i-th
        best) with its whole text, and `state` holds their tokens."""
        if self._final is not None:
            return None
        if self._units is None:
            self._units = self.events()
        with torch.inference_mode():
            if next(self._units, None) is not None:
                return []
        result = self.result()
        self.state.tokens, self.state.finish_reasons = result.token_ids, result.finish_reasons
        return [
            (row, text, True, why) for row, (text, why) in enumerate(zip(result.texts, result.finish_reasons))
        ]

    def stream(self) -> Iterator[tuple[int, str, bool, str | None]]:
        """Yield (row, text delta, finished, finish_reason) per row and step."""
        while (updates := self.advance()) is not None:
            yield from updates

    def stop_reason(self, row: int) -> int | str | None:
        """vLLM's stop_reason of a row that ended with finish reason "stop" (`stop_reason()`)."""
        if self.search is not None:  # a returned beam: no stop strings
            token = self.state.tokens[row][-1]
            return token if token in self.config.stop_token_ids else None
        return stop_reason(self.trackers[row], self.row_configs[row], self.state.tokens[row][-1])

    def cancel(self, row: int) -> None:
        """End `row` at the next step boundary (e.g. its client went away)."""
        self.state.cancelled.add(row)

    def result(self) -> GenerationResult:
        if self.search is not None:
            self._final = self._final or self._beam_result()
            return self._final
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
        logprobs = s.logprobs if any(c.logprobs is not None for c in self.row_configs) else None
        reasons = [r or "length" for r in s.finish_reasons]
        return GenerationResult(s.tokens, texts, reasons, stats, logprobs, self.prompt_logprobs)

    def _beam_result(self) -> GenerationResult:
        """Each prompt's best config.n finished beams, best first, with their scores."""
        k, n, tok = self.n, self.config.n, self.model.tokenizer
        hyps = [h for best in self.search.best(n) for h in best]
        texts = []
        for h in hyps if tok is not None else ():
            tracker = text_tracker(tok, (), self.config)
            for token in h.tokens[:-1] if h.ended and not tracker.include else h.tokens:
                tracker.push(token)  # an ending token adds no text, as in a sampled row
            tracker.finish()
            texts.append(tracker.final)
        s, rows = self.state, self.batch.ids.shape[0]
        stats = GenerationStats(
            prompt_tokens=int(self.batch.mask[::k].sum()),
            new_tokens=sum(len(h.tokens) for h in hyps),
            prefill_seconds=s.prefill_seconds,
            decode_seconds=s.decode_seconds,
            decode_tokens_per_s=s.decode_steps * rows / s.decode_seconds if s.decode_seconds > 0 else 0.0,
            batch_size=rows,
            cache=self.cache.kind,
            compile=self.decision,
        )
        prompt_lp = None if self.prompt_logprobs is None else _repeat(self.prompt_logprobs[::k], n)
        reasons = ["stop" if h.ended else "length" for h in hyps]
        tokens, scores = [h.tokens for h in hyps], [h.score for h in hyps]
        return GenerationResult(tokens, texts, reasons, stats, None, prompt_lp, scores)


def _out_of_memory(error: RuntimeError) -> bool:
    """torch's out-of-memory error, or an allocator's message for a size it cannot allocate or compute."""
    message = str(error)
    return isinstance(error, torch.OutOfMemoryError) or any(
        words in message for words in ("allocate", "out of memory", "Storage size calculation overflowed")
    )


def _repeat(rows: list | None, n: int) -> list | None:
    """Each entry n times in a row (the rows of n samples of one prompt), or None."""
    return None if rows is None else [r for r in rows for _ in range(n)]


def static_cache_length(config: GenerationConfig, model_config, width: int) -> int | None:
    """Slots of the static cache a `width`-token batch needs under `config`; None for a dynamic cache."""
    needed = width + config.max_new_tokens
    if width > model_config.max_position_embeddings:
        raise RequestError(
            f"prompt of {width} tokens exceeds the model's context of {model_config.max_position_embeddings}"
        )
    if config.cache_implementation == "dynamic":
        return None
    length = config.max_cache_len or bucket_length(needed, model_config.max_position_embeddings)
    if width > length:
        raise RequestError(
            f"prompt of {width} tokens is longer than the static cache (max_cache_len={length})"
        )
    if needed > length:
        raise RequestError(
            f"prompt of {width} tokens plus max_new_tokens={config.max_new_tokens} needs {needed} cache slots, "
            f"more than max_cache_len={length}"
        )
    return length
