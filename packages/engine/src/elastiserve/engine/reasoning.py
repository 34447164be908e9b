"""A chat answer's reasoning split from its content, as ``--reasoning-parser`` does in vLLM and SGLang: the text a
thinking model writes between ``<think>`` and ``</think>`` goes to ``reasoning_content``, the rest to ``content``
(and from there to the tool-call parser), whole or as stream deltas.

Two formats, by their vLLM names:

- ``qwen3``: reasoning only where the answer opens with ``<think>`` (leading whitespace allowed). Qwen3's template
  with ``enable_thinking: false`` (a ``chat_template_kwargs`` entry) writes an empty think block into the prompt,
  so the answer is all content.
- ``deepseek_r1``: everything before ``</think>`` is reasoning, with or without an opening ``<think>``: DeepSeek-R1's
  template opens the block in the prompt.

An answer cut inside its reasoning (``max_tokens``) is all reasoning and has no content. The tags are plain text
in both vocabularies (added tokens that are not special), so they survive detokenization. Structured output
(``response_format``, guided decoding) constrains the whole answer from its first token, reasoning included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastiserve.engine.tool_calls import partial_tag
from elastiserve.platforms import ConfigError

START, END = "<think>", "</think>"


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    name: str
    opens_in_prompt: bool  # text before END is reasoning even when the answer never wrote START


FORMATS = {"qwen3": ReasoningFormat("qwen3", False), "deepseek_r1": ReasoningFormat("deepseek_r1", True)}


def reasoning_format(name: str | None) -> ReasoningFormat | None:
    """The named format (None for None); an unknown name raises ``ConfigError``."""
    if name is None:
        return None
    if name not in FORMATS:
        raise ConfigError(f"unknown reasoning parser {name!r}; expected one of {sorted(FORMATS)}")
    return FORMATS[name]


class ReasoningStream:
    """One choice's output as it arrives: ``feed`` and ``finish`` return deltas ``{"reasoning_content": ...}`` and
    ``{"content": ...}`` in output order. Text is held back only while it may still be part of a tag."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self.state = "opening"  # then "reasoning" and "content"
        self.held = ""
        self.reasoned = False  # whether the answer had a reasoning part (it may be empty: "<think></think>")

    def feed(self, delta: str) -> list[dict[str, str]]:
        self.held += delta
        out: list[dict[str, str]] = []
        if self.state == "opening":
            self._open(final=False)
        if self.state == "reasoning":
            end = self.held.find(END)
            if end >= 0:
                out.append({"reasoning_content": self.held[:end]})
                self.held, self.state = self.held[end + len(END):], "content"
            else:
                keep = partial_tag(self.held, 0, END)
                cut = len(self.held) - keep
                out.append({"reasoning_content": self.held[:cut]})
                self.held = self.held[cut:]
        if self.state == "content":
            out.append({"content": self.held})
            self.held = ""
        return [d for d in out if next(iter(d.values()))]

    def finish(self) -> list[dict[str, str]]:
        """The held text once the output has ended: a cut tag is text of the part it was cut in."""
        if self.state == "opening":
            self._open(final=True)
        held, self.held = self.held, ""
        if not held:
            return []
        return [{"reasoning_content" if self.state == "reasoning" else "content": held}]

    def _open(self, final: bool) -> None:
        """Decide whether the answer opens with reasoning, once its start is known."""
        start = self.held.lstrip()
        if start.startswith(START):
            self.held, self.state = start[len(START):], "reasoning"
        elif START.startswith(start) and not final:
            return  # nothing, whitespace, or a prefix of START so far
        else:
            self.state = "reasoning" if self.fmt.opens_in_prompt else "content"
        self.reasoned = self.state == "reasoning"


def split_reasoning(text: str, fmt: ReasoningFormat) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a finished answer, read exactly as a stream of it would be. Without
    reasoning the content is the text as it was; after reasoning, None where nothing follows it."""
    stream = ReasoningStream(fmt)
    deltas = stream.feed(text) + stream.finish()
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    if not stream.reasoned:
        return None, text
    return reasoning, content or None


def attach_reasoning(body: dict[str, Any], fmt: ReasoningFormat) -> None:
    """A whole chat response's choices with their reasoning split out of their content."""
    for choice in body["choices"]:
        message = choice["message"]
        reasoning, content = split_reasoning(message["content"], fmt)
        if reasoning is not None:
            message.update(content=content, reasoning_content=reasoning)
