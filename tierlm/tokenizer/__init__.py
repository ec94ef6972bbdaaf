"""Text <-> token ids: the Tokenizer wrapper and streaming decode, chat templates, GGUF vocabularies."""

from tierlm.tokenizer.chat import compile_chat_template
from tierlm.tokenizer.special import SpecialTokens
from tierlm.tokenizer.stream import StreamDecoder
from tierlm.tokenizer.wrapper import Tokenizer

__all__ = ["SpecialTokens", "StreamDecoder", "Tokenizer", "compile_chat_template"]
