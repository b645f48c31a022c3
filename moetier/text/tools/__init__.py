"""Tool-call formats, one file per model family, behind one interface (`ToolFormat`) and a
registry keyed by name; `ToolStream` parses one response's output with one of them.

The format of a model is chosen from its chat template (the markers it writes), else from
its architecture; the `gateway.tool_parser` setting overrides both (`choose_format`).
"""

from __future__ import annotations

from moetier.errors import InvalidArgument
from moetier.text.tools.base import Marker, ParsedCall, ToolFormat, ToolStream, literal_marker
from moetier.text.tools.deepseek_v3 import DeepSeekV3Format
from moetier.text.tools.glm45 import Glm45Format
from moetier.text.tools.kimi_k2 import KimiK2Format
from moetier.text.tools.mistral import MistralFormat
from moetier.text.tools.qwen3 import Qwen3Format

FORMATS: dict[str, ToolFormat] = {f.name: f for f in (Qwen3Format(), Glm45Format(), DeepSeekV3Format(),
                                                       KimiK2Format(), MistralFormat())}

# Checked in this order: GLM's template also writes <tool_call>.
_TEMPLATE_MARKERS = (("<arg_key>", "glm45"), ("<|tool_calls_section_begin|>", "kimi_k2"),
                     ("tool▁calls▁begin", "deepseek_v3"), ("[TOOL_CALLS]", "mistral"), ("<tool_call>", "qwen3"))
_ARCHITECTURES = {"glm4_moe": "glm45", "glm_moe_dsa": "glm45", "qwen3_moe": "qwen3", "qwen2_moe": "qwen3",
                  "deepseek_v3": "deepseek_v3", "deepseek_v2": "deepseek_v3", "kimi_k2": "kimi_k2",
                  "mixtral": "mistral"}


def tool_format(name: str) -> ToolFormat:
    if name not in FORMATS:
        raise InvalidArgument(f"unknown tool-call format {name!r}; choose one of {', '.join(FORMATS)}")
    return FORMATS[name]


def choose_format(template: str | None, architecture: str | None, override: str | None = None) -> ToolFormat | None:
    """The model's tool-call format; None when its template does not render tools."""
    if override:
        return tool_format(override)
    if template is None or "tools" not in template:
        return None
    for marker, name in _TEMPLATE_MARKERS:
        if marker in template:
            return FORMATS[name]
    return FORMATS.get(_ARCHITECTURES.get(architecture or "", ""))


__all__ = ["FORMATS", "Marker", "ParsedCall", "ToolFormat", "ToolStream", "choose_format", "literal_marker",
           "tool_format"]
