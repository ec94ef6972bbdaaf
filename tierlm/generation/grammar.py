"""Structured output: OpenAI's `response_format` enforced token by token with llguidance.

A `ResponseFormat` (`tierlm.generation.response_format`) carries the llguidance grammar of a JSON
schema or of any JSON object. `GrammarMask` holds one matcher per row: before each sample it
writes the rows' allowed tokens as a bitmask and turns it into a [batch, vocab] boolean mask with tensor
ops (no Python loop over the vocabulary), and after it advances each matcher with the row's token. A row
whose grammar is complete ends (finish reason "stop"). Rows without a format are left unconstrained.

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

    def set_row(self, row: int, fmt: ResponseFormat | None) -> None:
        """Give `row` a fresh matcher for `fmt` (None: unconstrained), e.g. when a new sequence takes it."""
        self.matchers[row] = None
        if fmt is None:
            return
        if self.tokenizer is None:
            self._build()
        matcher = llguidance_module().LLMatcher(self.tokenizer, fmt.grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(f"response_format cannot be enforced: {matcher.get_error()}")
        self.matchers[row] = matcher

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
        return matcher is not None and matcher.is_stopped()

    def _live(self, row: int) -> bool:
        matcher = self.matchers[row]
        return matcher is not None and not matcher.is_stopped()
