"""The model's chat template, rendered with Hugging Face semantics.

Same environment as transformers' `apply_chat_template`: a sandboxed, immutable jinja2
environment with trim_blocks and lstrip_blocks, the loopcontrols extension, a `tojson`
filter that keeps non-ASCII characters, and the globals `raise_exception` and
`strftime_now`. The template sees `messages` (a list of {"role", "content"} dicts),
`add_generation_prompt`, `bos_token`, `eos_token` (and the other special tokens of
tokenizer_config.json), `tools` (transformers' list of {"type": "function", "function": ...},
or None), `documents` (None), and extra variables such as `enable_thinking`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from moetier.errors import FormatError, InvalidArgument


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: Mapping[str, str | None] | None = None) -> None:
        """`special_tokens`: bos_token, eos_token, ... as the template should see them."""
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise FormatError(f"chat template: syntax error on line {e.lineno}: {e.message}") from None
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    @property
    def renders_tools(self) -> bool:
        """Whether the template uses the `tools` variable at all."""
        return "tools" in self.source

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, **extra: Any) -> str:
        """The prompt text for a conversation. A template that rejects the conversation
        (`raise_exception`, e.g. roles that do not alternate) raises InvalidArgument."""
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                tools=[dict(t) for t in tools] if tools else None,
                documents=None,
                **{**self.special_tokens, **extra},
            )
        except (jinja2.TemplateError, OverflowError) as e:  # OverflowError: the sandbox's range cap
            raise InvalidArgument(f"the model's chat template rejected the messages: {e}") from None
