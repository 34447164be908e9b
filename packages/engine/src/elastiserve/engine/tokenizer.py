"""Tokenizer over HF ``tokenizers`` (tokenizer.json): encode/decode, streaming detokenizer, chat template."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from elastiserve.platforms import ConfigError, ElastiserveError


class ChatTemplateError(ElastiserveError, ValueError):
    """The model's chat template rejected the messages (it called raise_exception) or has none."""


class Tokenizer:
    def __init__(self, backend: HFTokenizer, tokenizer_config: dict, eos_token_ids: Sequence[int] = ()) -> None:
        self.backend = backend
        self.config = tokenizer_config
        self.chat_template: str | None = tokenizer_config.get("chat_template")
        self.bos_token = _token_text(tokenizer_config.get("bos_token"))
        self.eos_token = _token_text(tokenizer_config.get("eos_token"))
        self.bos_token_id = self._id_of(self.bos_token)
        eos = [*eos_token_ids, *([self._id_of(self.eos_token)] if self.eos_token else [])]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in eos if i is not None))
        self.pad_token_id = self._id_of(_token_text(tokenizer_config.get("pad_token")))
        self.add_bos_token = bool(tokenizer_config.get("add_bos_token", False))
        self._template: jinja2.Template | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        if not (model_dir / "tokenizer.json").is_file():
            raise ConfigError(f"{model_dir} has no tokenizer.json")
        backend = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
        config = _read_json(model_dir / "tokenizer_config.json")
        model_eos = _read_json(model_dir / "config.json").get("eos_token_id")
        model_eos = [model_eos] if isinstance(model_eos, int) else list(model_eos or [])
        return cls(backend, config, model_eos)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; special-token text such as ``<|im_start|>`` maps to its id. BOS only if the model adds one."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs: object
    ) -> str:
        """Render the model's chat template (jinja2, sandboxed, the environment options transformers uses)."""
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **template_kwargs,
            )
        except jinja2.TemplateError as exc:  # an undefined attribute, a bad call: what these messages made it do
            raise ChatTemplateError(f"{type(exc).__name__}: {exc}") from exc

    def set_chat_template(self, source: str) -> None:
        """Use ``source`` instead of the model's template (``--chat-template``); compiled now, so that a syntax
        error stops the server at start-up with a ``ConfigError``."""
        try:
            self._template = _compile_template(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError(f"the chat template does not compile: line {exc.lineno}: {exc.message}") from exc
        self.chat_template = source

    def detokenizer(self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)


class IncrementalDetokenizer:
    """Text deltas for streamed tokens; the concatenated deltas equal ``decode(all output ids)``.

    Byte-level BPE can split one UTF-8 character over several tokens, so text that ends in U+FFFD is held back
    until the character completes. Only a short window of earlier tokens is decoded each step (O(1) per token),
    which is enough because a byte-level decode of a suffix equals the suffix of the decode.
    """

    WINDOW = 6  # tokens of context kept before the unread ones; a UTF-8 character spans at most 4 byte tokens

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_ids)[-self.WINDOW :]
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""

    def add(self, new_token_ids: Sequence[int]) -> str:
        self.token_ids.extend(new_token_ids)
        decode = self.tokenizer.decode
        prefix_text = decode(self.token_ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full_text = decode(self.token_ids[self.prefix_offset :], self.skip_special_tokens)
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            return ""  # an incomplete character, or tokens that render to nothing (yet)
        delta = full_text[len(prefix_text) :]
        self.read_offset = len(self.token_ids)
        self.prefix_offset = max(0, self.read_offset - self.WINDOW)
        # Drop ids that fell out of the window so memory stays bounded on long generations.
        if self.prefix_offset > 0:
            self.token_ids = self.token_ids[self.prefix_offset :]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a stream: whatever is held back (an incomplete character decodes as U+FFFD)."""
        decode = self.tokenizer.decode
        prefix_text = decode(self.token_ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full_text = decode(self.token_ids[self.prefix_offset :], self.skip_special_tokens)
        delta = full_text[len(prefix_text) :]
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta


class StopChecker:
    """Cuts the text at the first stop string (after it, with ``include``); holds back a possible stop-string prefix
    until it is decided."""

    def __init__(self, stops: tuple[str, ...], include: bool = False) -> None:
        self.stops = stops
        self.include = include
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""

    def feed(self, delta: str, final: bool) -> tuple[str, bool]:
        self.pending += delta
        hits = [(i, -len(s)) for i, s in ((self.pending.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            start, minus_length = min(hits)  # the first stop string to start (the longest of those starting there)
            text, self.pending = self.pending[:start - minus_length if self.include else start], ""
            return text, True
        cut = len(self.pending) if final else max(0, len(self.pending) - self.hold)
        text, self.pending = self.pending[:cut], self.pending[cut:]
        return text, False


class StopStringMatcher:
    """The engine's stop strings, token by token: incremental-detokenizer deltas through a ``StopChecker``, so each
    token costs O(1) (decoding the whole output each step cost O(n) per token). ``text`` is the output text released
    so far; after ``add`` returns True it is the text up to the first stop string."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str]) -> None:
        self.detokenizer = tokenizer.detokenizer()
        self.checker = StopChecker(tuple(s for s in stops if s))
        self.consumed = 0  # output tokens fed so far
        self.text = ""

    def release(self, output_token_ids: Sequence[int]) -> None:
        """Take the output so far as text that no stop string may end in (a request below its ``min_tokens``): a
        later ``add`` searches only what follows it, as vLLM's stop check does."""
        if self.checker.pending:
            raise RuntimeError("release after add: the held-back text would be searched again")
        self.text += self.detokenizer.add(output_token_ids[self.consumed :])
        self.consumed = len(output_token_ids)

    def add(self, output_token_ids: Sequence[int]) -> bool:
        """Feed the output so far (only the unseen tail is decoded); whether a stop string has appeared."""
        delta = self.detokenizer.add(output_token_ids[self.consumed :])
        self.consumed = len(output_token_ids)
        released, stopped = self.checker.feed(delta, final=False)
        self.text += released
        return stopped


def _compile_template(source: str) -> jinja2.Template:
    def raise_exception(message: str) -> None:
        raise ChatTemplateError(message)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _token_text(token: str | dict | None) -> str | None:
    # tokenizer_config.json spells special tokens either as strings or as AddedToken dicts.
    return token.get("content") if isinstance(token, dict) else token


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


class TextStream:
    """Incremental detokenization with only ``tokenizer.decode``: text is cut where a multi-byte character is whole.

    Each call decodes a short window (the previous token run plus the new tokens) so the cost stays linear and
    tokenizers that treat the first token of a string specially (leading spaces) still give the right delta.
    """

    def __init__(self, tokenizer: Any, eos_ids: frozenset[int] = frozenset(), skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.eos_ids = tokenizer, eos_ids
        # passed only when False: the default is every tokenizer's, and some stand-ins take no such argument
        self.decode_options = {} if skip_special_tokens else {"skip_special_tokens": False}
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, new_ids: list[int], final: bool = False) -> str:
        self.ids.extend(t for t in new_ids if t not in self.eos_ids)
        if len(self.ids) == self.read_offset:
            return ""
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], **self.decode_options)
        new_text = self.tokenizer.decode(self.ids[self.prefix_offset:], **self.decode_options)
        if new_text.endswith("\ufffd") and not final:
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text):]
