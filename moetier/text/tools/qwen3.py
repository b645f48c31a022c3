"""Qwen3 (and Qwen2.5, Hermes): each call is `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from moetier.text.conversation import ToolDef
from moetier.text.tools.base import Marker, ParsedCall, ToolFormat, arguments_text, name_and_args_lark

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


class Qwen3Format(ToolFormat):
    name = "qwen3"
    start = "<tool_call>"
    markers = ("<tool_call>", "</tool_call>")

    def calls(self, region: str, final: bool, tools: Sequence[ToolDef]) -> list[ParsedCall]:
        out = []
        for m in _CALL.finditer(region):
            try:
                obj = json.loads(m.group(1))
            except ValueError:
                continue
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                out.append(ParsedCall(obj["name"], arguments_text(obj.get("arguments", obj.get("parameters", {})))))
        return out

    def call_lark(self, tool: ToolDef, marker: Marker) -> str:
        return f'{marker("<tool_call>")} "\\n" {name_and_args_lark(tool)} "\\n" {marker("</tool_call>")}'
