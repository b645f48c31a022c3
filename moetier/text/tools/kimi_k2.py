"""Kimi K2: `<|tool_calls_section_begin|>` then calls
`<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>ARGS<|tool_call_end|>`, then
`<|tool_calls_section_end|>`. The call id is `functions.NAME:INDEX` (the template echoes it)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from moetier.text.conversation import ToolDef
from moetier.text.grammar import lark_json, lark_literal
from moetier.text.tools.base import (
    Marker,
    ParsedCall,
    ToolFormat,
    arguments_text,
    decode_json_prefix,
    schema_of,
)

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGS_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_CALL = re.compile(re.escape(CALL_BEGIN) + r"\s*([^\s<]+?)\s*" + re.escape(ARGS_BEGIN) + r"(.*?)"
                   + re.escape(CALL_END), re.S)


class KimiK2Format(ToolFormat):
    name = "kimi_k2"
    start = SECTION_BEGIN
    markers = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGS_BEGIN, CALL_END)

    def calls(self, region: str, final: bool, tools: Sequence[ToolDef]) -> list[ParsedCall]:
        out = []
        for m in _CALL.finditer(region):
            ident = m.group(1)
            name = ident.rsplit(":", 1)[0]
            name = name.split(".", 1)[1] if name.startswith("functions.") else name
            decoded = decode_json_prefix(m.group(2))
            if name and decoded is not None and isinstance(decoded[0], dict):
                out.append(ParsedCall(name, arguments_text(decoded[0]), id=ident))
        return out

    def call_lark(self, tool: ToolDef, marker: Marker) -> str:
        return (f'{marker(CALL_BEGIN)} {lark_literal(f"functions.{tool.name}:0")} {marker(ARGS_BEGIN)} '
                f'{lark_json(schema_of(tool))} {marker(CALL_END)}')

    def forced_lark(self, tools: Sequence[ToolDef], marker: Marker) -> str:
        one = super().forced_lark(tools, marker).splitlines()
        return "\n".join([f"start: {marker(SECTION_BEGIN)} call {marker(SECTION_END)}",
                          "call: " + one[0].removeprefix("start: "), *one[1:]]) + "\n"
