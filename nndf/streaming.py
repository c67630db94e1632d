"""Text as it is generated: a streamer (Hugging Face's `put`/`end` protocol) that prints each token's text at once.

transformers' `TextStreamer` prints a reply word by word: it holds back everything after the last space, because
decoding more tokens can change the end of the text (a multi-byte character split over tokens decodes to U+FFFD
until its last byte comes; a tokenizer that cleans up spaces turns " ." into "." and " do not" into " don't").
For GPT-2's tokens, which begin with their space, that holds back every word until the next one arrives: the first
word of a reply shows one decode step late. `ReplyStreamer` holds back only what can still change, so each token
shows as soon as it is generated:

- trailing U+FFFD (an unfinished character) and trailing whitespace (which the next token may merge with);
- for a tokenizer whose decoding cleans up spaces (BERT's WordPiece decoder, T5's with
  `clean_up_tokenization_spaces`; asked by decoding "a ." and looking for its space), the last
  `CLEAN_UP_WINDOW` characters: the clean-up rules (tokenizers' and transformers' `clean_up_tokenization`) rewrite
  at most 7 characters from a space and run one after another, so a later character changes only text that near
  the end. BPE tokenizers (GPT-2, Llama-class, BART) do not clean up in transformers 5, and stream token by token.

Like `TextStreamer` it decodes the whole reply at each token (never parts of it, which for SentencePiece tokenizers
would lose the spaces between them), so the text printed, once `end()` has flushed the rest, is exactly
`tokenizer.decode(reply tokens, **decode_kwargs)`.
"""

from __future__ import annotations

import sys
import time
from typing import Callable

from transformers import TextStreamer

UNFINISHED = "\ufffd"  # what a tokenizer decodes the first bytes of a character to
CLEAN_UP_WINDOW = 16  # trailing characters that later tokens can still change where decoding cleans up spaces


class ReplyStreamer(TextStreamer):
    """Prints generated text to `write` token by token (the prompt skipped), and keeps what a reply needs after:
    its tokens (`tokens`, also of a reply stopped early) and when its first text showed (`first_text_at`, a
    `time.perf_counter()` value; whitespace alone shows nothing, so it does not count).

    One sequence, as `TextStreamer`: `put` takes the loop's (1, n) or (n,) tokens of a batch of one.
    """

    def __init__(self, tokenizer, write: Callable[[str], object] | None = None, skip_special_tokens: bool = True,
                 cleans_up: bool | None = None):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=skip_special_tokens)
        self.write = write or _stdout_write
        self.tokens: list[int] = []
        self.first_text_at: float | None = None
        self.cleans_up = cleans_up_spaces(tokenizer) if cleans_up is None else cleans_up  # (given: asked once)

    def put(self, value) -> None:
        if value.dim() > 1 and value.shape[0] > 1:
            raise ValueError("ReplyStreamer streams one sequence; got a batch of " + str(value.shape[0]))
        if self.skip_prompt and self.next_tokens_are_prompt:
            self.next_tokens_are_prompt = False
            return
        new = value.reshape(-1).tolist()
        self.tokens.extend(new)
        self.token_cache.extend(new)
        text = self.tokenizer.decode(self.token_cache, **self.decode_kwargs)
        settled = self._settled_length(text)
        if settled > self.print_len:
            self.on_finalized_text(text[self.print_len:settled])
            self.print_len = settled

    def _settled_length(self, text: str) -> int:
        """How much of `text` no later token can change."""
        end = len(text.rstrip(UNFINISHED).rstrip())
        if self.cleans_up:
            end = min(end, len(text) - CLEAN_UP_WINDOW)
        return end

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if text:
            if self.first_text_at is None and text.strip():
                self.first_text_at = time.perf_counter()
            self.write(text)

    @property
    def text(self) -> str:
        """The reply's text so far, decoded whole."""
        return self.tokenizer.decode(self.tokens, **self.decode_kwargs)


def cleans_up_spaces(tokenizer) -> bool:
    """Whether the tokenizer's decoding rewrites spaces (" ." -> "."), asked by decoding the tokens of "a .": a
    tokenizer's `clean_up_tokenization_spaces` is not the whole story (transformers 5 skips that clean-up for BPE
    tokenizers such as GPT-2's, whose saved config still says true; BERT's WordPiece decoder cleans up itself)."""
    probe = tokenizer("a .", add_special_tokens=False)["input_ids"]
    return tokenizer.decode(probe).strip() != "a ."


def _stdout_write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
