"""The tokens a multi-turn rollout appends between two assistant turns, rendered once.

The conversation's ids are never re-tokenized: the prompt's ids, then exactly the ids the
engine returned, then the ids of the tool (or user) turn, rendered by the tokenizer's chat
template and tokenized **alone**, then the next turn's generated ids, and so on. The
appended ids come from a fixed base conversation (verl's and SkyRL's "fixed base", TRL's
dummy-conversation diff): render ``base`` and ``base + messages`` (with the generation
prompt of the next assistant turn), and keep the second's text from the point where the
base's assistant turn ended — its end token, the one the engine stopped at. What the
template writes after that token (ChatML's ``"\\n"``: verl #3720's lost newline) is part of
the appended text, so train and inference see the same ids.

A template that re-renders earlier turns when later ones are added (Qwen3 drops past
``<think>`` blocks) is not prefix-preserving: :class:`TurnRenderer` refuses it at start-up
with the reason, rather than training on ids the engine never saw.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# A base conversation whose assistant turn is complete; its contents do not matter.
BASE = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "ok"},
]


class TurnRenderer:
    """Renders the turns appended after an assistant turn into token ids.

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        end_of_turn_id: the token the engine stops an assistant turn at (default: the
            tokenizer's EOS). Its text must end the base's assistant turn in the template.
        chat_template_kwargs: passed to every ``apply_chat_template`` call.
    """

    def __init__(
        self,
        tokenizer,
        end_of_turn_id: int | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})
        eot = tokenizer.eos_token_id if end_of_turn_id is None else end_of_turn_id
        self.end_of_turn = tokenizer.decode([eot])
        base = self._text(BASE, add_generation_prompt=False)
        cut = base.rfind(self.end_of_turn)
        if cut < 0:
            raise ValueError(
                f"the chat template does not end an assistant turn with {self.end_of_turn!r} "
                "(end_of_turn_id): the tokens between turns cannot be rendered exactly"
            )
        self._base_text = base
        self._cut = cut + len(self.end_of_turn)
        self.ids([{"role": "user", "content": "check"}])  # a template that cannot: now

    def _text(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages),
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.kwargs,
        )

    def text(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The text appended after an assistant turn's end token: ``messages`` (tool or
        user turns) and the next assistant turn's generation prompt."""
        full = self._text([*BASE, *messages], add_generation_prompt=True)
        if not full.startswith(self._base_text[: self._cut]):
            raise ValueError(
                "the chat template is not prefix-preserving (adding a turn changed how the "
                "earlier ones render): multi-turn ids would differ from what the engine saw"
            )
        return full[self._cut :]

    def ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """:meth:`text` tokenized alone (no special tokens added)."""
        return self.tokenizer.encode(self.text(messages), add_special_tokens=False)
