"""A chat request's prompt: the model's chat template (or ``--chat-template``'s) rendered with the request's
template options (``protocol.TemplateOptions``: vLLM's ``chat_template_kwargs``, ``add_generation_prompt`` and
``continue_final_message``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elastiserve.engine.protocol import TemplateOptions
from elastiserve.engine.request_fields import BadRequest
from elastiserve.platforms import ConfigError


def render_chat(tokenizer: Any, messages: list[dict], options: TemplateOptions,
                extra: dict[str, Any] | None = None) -> Any:
    """The rendered conversation (text, or token ids where a tokenizer renders to ids). ``extra``: the variables
    the server adds itself (the offered tools). A template that rejects the conversation is a ``BadRequest``."""
    variables = {**options.kwargs, **(extra or {})}
    try:  # templates reject some conversations (roles out of order, ...) with a ValueError
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=options.add_generation_prompt,
                                                 **variables)
    except ValueError as exc:
        raise BadRequest(f"cannot apply the chat template: {exc}", param="messages") from exc
    except TypeError as exc:  # a template variable the renderer takes as a keyword of its own
        raise BadRequest(f"cannot apply the chat template: {exc}", param="chat_template_kwargs") from exc
    except RecursionError as exc:  # a value nested past the interpreter's limit (json.loads takes ~1,000 levels)
        raise BadRequest("cannot apply the chat template: a value in the request is nested too deep to render",
                         param=None) from exc
    if options.continue_final_message:
        return open_final_message(rendered, messages[-1]["content"])
    return rendered


def open_final_message(rendered: str, final: str) -> str:
    """The conversation cut right after the final message's text, so that the model continues that message: what
    the template wrote after it (the end of the turn) goes. Templates that strip a message's text are matched on
    the stripped text."""
    if not isinstance(rendered, str):
        raise BadRequest("'continue_final_message' needs a chat template that renders text",
                         param="continue_final_message")
    for text in (final, final.strip()):
        at = rendered.rfind(text)
        if text and at >= 0:
            return rendered[:at + len(text)]
    raise BadRequest("'continue_final_message': the chat template does not render the final message's text",
                     param="continue_final_message")


def load_chat_template(value: str) -> str:
    """``--chat-template``: a file's path, or the template itself (as vLLM takes it) when it holds Jinja syntax."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ConfigError(f"--chat-template {value!r} is neither a file nor a Jinja template")
