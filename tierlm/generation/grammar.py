"""Structured output: OpenAI's `response_format` enforced token by token with llguidance.

A `ResponseFormat` (`tierlm.generation.response_format`) carries the llguidance grammar of a JSON
schema or of any JSON object. `GrammarMask` holds one matcher per row: before each sample it
writes the rows' allowed tokens as a bitmask and turns it into a [batch, vocab] boolean mask with tensor
ops (no Python loop over the vocabulary), and after it advances each matcher with the row's token. A row
whose grammar is complete ends (finish reason "stop"). Rows without a format are left unconstrained.

A row with a token budget always ends with a complete answer (JSON, or a choice). Before a sampled token
is taken, the tokens of the shortest text that would close the answer after it (`tierlm.generation.closing`,
its bytes tokenized by llguidance's view of the tokenizer) are counted; if they no longer fit in what the budget leaves after that
token, the sampled token is dropped and the closing of the answer so far (which fit, by the same check one
token earlier) is forced token by token instead. The matcher checks each closing before it is forced; a
closing it refuses, or a format without a closer (a regex, a Lark grammar), leaves the row unforced. A
forced row's finish reason is "length" (the budget cut the answer short), its content still valid.

Why llguidance. Compared on SmolLM2's tokenizer (49152 tokens) and a schema with nested objects, arrays,
enums, a pattern and required fields, on a contended 2-core CPU (so relative, not absolute numbers):
llguidance 1.9 compiles the schema in ~2-4 ms (its Earley parser computes masks lazily) and computes a mask
in ~0.06 ms median (~0.4 ms p90, a few ms for the first tokens); xgrammar 0.2 compiles in ~25-30 ms and
masks in ~0.01 ms, but imports transformers at module load and pulls triton, which tierlm keeps out of
its runtime; outlines-core 0.2 turns the schema into a regex and builds a vocabulary-wide DFA index, ~5 s
per schema, and cannot express a free-form JSON object. llguidance is one ~8 MB wheel with no Python
dependencies, reads the `tokenizers` JSON tierlm already has, and refuses unimplemented keywords by name.
Either of the first two costs far less than one decode step of the default model.
"""

from __future__ import annotations

import weakref

import torch

from tierlm.errors import RequestError
from tierlm.generation.closing import ChoiceCloser, JsonCloser
from tierlm.generation.response_format import ResponseFormat, llguidance_module

_NEG_INF = float("-inf")


# Building llguidance's view of a tokenizer takes about a second: once per tokenizer, vocabulary and EOS set.
_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def grammar_tokenizer(tokenizer, vocab: int, eos_ids: tuple[int, ...]):
    """llguidance's tokenizer for a tierlm Tokenizer whose logits have `vocab` columns (cached)."""
    per_tokenizer = _TOKENIZERS.setdefault(tokenizer, {})
    key = (vocab, tuple(eos_ids))
    if key not in per_tokenizer:
        if not eos_ids:
            raise RequestError("structured output needs an end-of-sequence token; this model names none")
        backend = tokenizer.backend.to_str()  # the tokenizers JSON, as llguidance reads it
        per_tokenizer[key] = llguidance_module().LLTokenizer(backend, n_vocab=vocab, eos_token=list(eos_ids))
    return per_tokenizer[key]


class GrammarMask:
    """One llguidance matcher per row of a batch (None: unconstrained); masks logits, follows sampled tokens.

    Rows are a batch's slots: `set_row` gives a slot to a new sequence, and `apply` / `advance` take the
    rows the logits and tokens belong to (all rows, or a subset in that order). Nothing is built until a
    row gets a format, so a batch may carry one whether or not any request asks for structured output.
    """

    def __init__(self, tokenizer, rows: int, vocab: int, eos_ids) -> None:
        self.source, self.vocab, self.eos_ids = tokenizer, vocab, tuple(eos_ids)
        self.rows = rows
        self.matchers: list = [None] * rows
        self.tokenizer = self.executor = self.bitmask = None  # built with the first format
        # per row with a budget: its closer (the answer so far, read incrementally; None: unforced), its
        # budget, the closing tokens of its answer so far, those still to force, whether a closing was forced
        self.closers: list = [None] * rows
        self.budgets: list[int | None] = [None] * rows
        self.closing: list[list[int] | None] = [None] * rows
        self.forcing: list[list[int]] = [[] for _ in range(rows)]
        self.forced = [False] * rows

    def set_row(self, row: int, fmt: ResponseFormat | None, budget: int | None = None) -> None:
        """Give `row` a fresh matcher for `fmt` (None: unconstrained), e.g. when a new sequence takes it; with
        a `budget` (its max_new_tokens) the answer is closed within it, and a budget below the format's shortest
        answer is a RequestError."""
        self.matchers[row], self.closers[row], self.budgets[row] = None, None, None
        self.closing[row], self.forcing[row], self.forced[row] = None, [], False
        if fmt is None:
            return
        if self.tokenizer is None:
            self._build()
        matcher = llguidance_module().LLMatcher(self.tokenizer, fmt.grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(f"response_format cannot be enforced: {matcher.get_error()}")
        self.matchers[row] = matcher
        closer = closer_of(fmt)
        if closer is None or budget is None:
            return
        shortest = _checked(matcher, self._closing(closer))
        if shortest is None:
            return  # a closer that cannot close this grammar: unforced
        if len(shortest) > budget:
            raise RequestError(too_short("max_new_tokens", budget, self.source, shortest))
        self.closers[row], self.budgets[row], self.closing[row] = closer, budget, shortest

    def within_budget(self, rows: list[int], tokens: list[int], steps: list[int]) -> list[int] | None:
        """`tokens` (sampled for `rows`, each with `steps` tokens before it) with the tokens that keep each
        budgeted row closable within its budget in their place; None when nothing changed."""
        changed = False
        out = list(tokens)
        for i, (row, token, done) in enumerate(zip(rows, tokens, steps)):
            if self.forcing[row]:
                out[i] = self.forcing[row].pop(0)
            elif self.closers[row] is not None and self._live(row) and token not in self.eos_ids:
                after = self.closers[row].after(self.tokenizer.decode_bytes([token]))
                closing = self._closing(after)
                before = self.closing[row]  # the closing of the answer so far: it fit, by the last check
                left = self.budgets[row] - done - 1  # after this token
                if closing is not None and len(closing) <= left:  # it still fits
                    self.closers[row], self.closing[row] = after, closing
                    continue
                if closing is None or not self._can_force(row, before):  # unknown, or refused: unforced
                    self.closers[row], self.closing[row] = None, None
                    continue
                forced = before or [self.eos_ids[0]]  # a complete answer that could go on: it ends here
                out[i], self.forcing[row], self.forced[row] = forced[0], forced[1:], True
            changed = changed or out[i] != token
        return out if changed else None

    def budgeted(self, rows: list[int]) -> bool:
        """Whether any of `rows` is closed within a budget (`within_budget` has work to do)."""
        return any(self.closers[r] is not None or self.forcing[r] for r in rows)

    def _can_force(self, row: int, closing: list[int] | None) -> bool:
        if closing is None:
            return False
        if not closing:  # nothing left to write: the end-of-sequence token, where the answer may end
            return bool(self.eos_ids) and self.matchers[row].is_accepting()
        return _closes(self.matchers[row], closing)

    def _closing(self, closer) -> list[int] | None:
        return closing_tokens(self.tokenizer, closer)

    def closed_by_budget(self, row: int) -> bool:
        """True when `row`'s answer was closed early because its budget ran out (finish reason "length")."""
        return self.forced[row]

    def _build(self) -> None:
        if self.source is None:
            raise RequestError("structured output needs a tokenizer; this model has none")
        self.tokenizer = grammar_tokenizer(self.source, self.vocab, self.eos_ids)
        self.executor = llguidance_module().LLExecutor(2)
        self.bitmask = torch.full((self.rows, (self.vocab + 31) // 32), -1, dtype=torch.int32)
        # byte value -> its 8 bits, lowest first: the bitmask read as bytes gives token order (little endian)
        self.bits = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()

    def apply(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """logits [len(rows), vocab] with the tokens each row's grammar forbids set to -inf (float32)."""
        live = [(self.matchers[r], i) for i, r in enumerate(rows) if self._live(r)]
        if not live:
            return logits
        bitmask = self.bitmask[: len(rows)]
        bitmask.fill_(-1)  # rows without a live grammar stay unconstrained
        self.executor.unsafe_compute_mask_ptr(live, bitmask.data_ptr(), bitmask.shape[1] * 4, len(rows))
        # bit j of word w allows token 32w + j: a table lookup per byte, no loop over the vocabulary
        allowed = self.bits[bitmask.view(torch.uint8).long()].view(len(rows), -1)[:, : logits.shape[-1]]
        return torch.where(allowed.to(logits.device, non_blocking=True), logits.float(), _NEG_INF)

    def advance(self, rows: list[int], tokens: list[int]) -> None:
        """Feed each constrained row its sampled token; a row whose grammar is complete takes no more."""
        for row, token in zip(rows, tokens):
            if self._live(row) and not self.matchers[row].consume_token(token):
                error = self.matchers[row].get_error()
                raise RuntimeError(f"structured output: row {row} left its grammar: {error}")

    def complete(self, row: int) -> bool:
        """True once `row`'s grammar has matched a whole document and allows nothing more."""
        matcher = self.matchers[row]
        if matcher is None:
            return False
        # a forced closing ends the answer, even where its grammar would go on (another tool call)
        return matcher.is_stopped() or (self.forced[row] and not self.forcing[row] and matcher.is_accepting())

    def _live(self, row: int) -> bool:
        matcher = self.matchers[row]
        return matcher is not None and not matcher.is_stopped()


def closer_of(fmt: ResponseFormat) -> JsonCloser | ChoiceCloser | None:
    """The closer of an empty answer under `fmt`; None for a format with no closer (a regex, a Lark grammar)."""
    return None if fmt.closer is None else fmt.closer()


def _closes(matcher, ids: list[int]) -> bool:
    """Whether the matcher, from where it is, takes `ids` and is then complete (tried on a copy)."""
    trial = matcher.deep_copy()
    return trial.try_consume_tokens(ids) == len(ids) and (trial.is_accepting() or trial.is_stopped())


def _checked(matcher, ids: list[int] | None) -> list[int] | None:
    return ids if ids is not None and _closes(matcher, ids) else None


def shortest_answer(tokenizer, vocab: int, eos_ids, fmt: ResponseFormat) -> list[int] | None:
    """The tokens of the shortest answer `fmt` allows, as `GrammarMask` would force it (None: no closer)."""
    closer = closer_of(fmt)
    if closer is None:
        return None
    lltokenizer = grammar_tokenizer(tokenizer, vocab, tuple(eos_ids))
    matcher = llguidance_module().LLMatcher(lltokenizer, fmt.grammar)
    return None if matcher.is_error() else _checked(matcher, closing_tokens(lltokenizer, closer))


def closing_tokens(lltokenizer, closer) -> list[int] | None:
    """The tokens of `closer`'s closing (None: no closer, or its closing is unknown)."""
    closing = None if closer is None else closer.closing()
    return None if closing is None else lltokenizer.tokenize_bytes(closing)


def too_short(field: str, budget: int, tokenizer, shortest: list[int]) -> str:
    text = tokenizer.decode(shortest)
    return (
        f"{field} {budget} is below the {len(shortest)} tokens of the shortest answer response_format "
        f"allows ({text!r})"
    )
