"""A chat's memory: the turns so far, made into the model's next prompt.

A tokenizer with a chat template (instruction-tuned models: Llama-class chat models, Qwen, Phi...) gets the turns as
messages through its own `apply_chat_template`, with the system text first and the generation prompt last, as
transformers' chat pipelines build them. A model without one (a base model such as GPT-2, or T5) gets plain text:
the turns one after another, separated by `TURN_SEPARATOR` (a blank line: where a base model most often sees one
text end and another begin), the system text as the first paragraph. A decoder-only model's reply continues the
user's line, so a turn is the line and the reply as one text; an encoder-decoder model's reply answers it, so the
reply is a paragraph of its own.

When the prompt grows past what the model can take, the chat drops the oldest turns (`forget_oldest`), once it
has found (`prompt_ids(..., dropped=N)`) that the rest fits: a line too long to fit even alone is refused without
costing the conversation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nndf.errors import UsageError

TURN_SEPARATOR = "\n\n"


@dataclass
class Conversation:
    tokenizer: object
    system: str | None = None
    continues: bool = True  # the reply continues the user's text (decoder-only) rather than answering it
    turns: list[tuple[str, str]] = field(default_factory=list)  # (user line, the model's reply)

    @property
    def templated(self) -> bool:
        """Whether the tokenizer has a chat template (else the turns are plain text)."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    def prompt_ids(self, user: str, dropped: int = 0) -> list[int]:
        """The token ids of the conversation with `user`'s new line, ready for the reply; its `dropped` oldest turns
        left out (to see whether the rest fits before forgetting them)."""
        turns = self.turns[dropped:]
        if self.templated:
            messages = [{"role": "system", "content": self.system}] if self.system else []
            for asked, answered in turns:
                messages += [{"role": "user", "content": asked}, {"role": "assistant", "content": answered.strip()}]
            messages.append({"role": "user", "content": user})
            return self._templated_ids(messages)
        paragraphs = [self.system] if self.system else []
        for asked, answered in turns:
            paragraphs += [asked + answered] if self.continues else [asked, answered.strip()]
        return list(self.tokenizer(TURN_SEPARATOR.join([*paragraphs, user]))["input_ids"])

    def check_system(self) -> None:
        """A UsageError naming --system when the chat template refuses a system message (Gemma's instruction-tuned
        templates raise 'System role not supported'): told before the chat's exports, not as a traceback later."""
        if self.system and self.templated:
            try:
                self._templated_ids([{"role": "system", "content": self.system}, {"role": "user", "content": "hi"}])
            except UsageError as exc:
                raise UsageError(f"--system: {exc}; leave --system out (or say it in your first line)") from None

    def _templated_ids(self, messages: list[dict]) -> list[int]:
        """The template's token ids for `messages`; a template that refuses them (its `raise_exception`) is a
        UsageError with the template's own words."""
        from jinja2 import TemplateError

        try:
            encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                         return_dict=True)
        except TemplateError as exc:
            raise UsageError(f"this model's chat template refuses the conversation ({exc})") from None
        return list(encoded["input_ids"])

    def remember(self, user: str, reply: str) -> None:
        """Keep a finished (or stopped) turn; the reply's text as generated (a base model's continuation keeps its
        leading space)."""
        self.turns.append((user, reply))

    def forget_oldest(self, count: int = 1) -> None:
        """Drop the `count` oldest turns."""
        del self.turns[:count]

    def reset(self) -> None:
        self.turns.clear()
