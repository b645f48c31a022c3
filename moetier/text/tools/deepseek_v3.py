"""DeepSeek-V3 and V3.1/V3.2: a section `<｜tool▁calls▁begin｜>` ... `<｜tool▁calls▁end｜>` of calls
`<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>` (V3) or
`<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>` (V3.1 on)."""

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

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_CALL = re.compile(re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(SEP) + r"(.*?)" + re.escape(CALL_END), re.S)
_V3_ARGS = re.compile(r"^([^\n]*)\n```(?:json)?\n(.*?)\n?```\s*$", re.S)


class DeepSeekV3Format(ToolFormat):
    name = "deepseek_v3"
    start = CALLS_BEGIN
    markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

    def calls(self, region: str, final: bool, tools: Sequence[ToolDef]) -> list[ParsedCall]:
        out = []
        for m in _CALL.finditer(region):
            head, body = m.group(1).strip(), m.group(2)
            v3 = _V3_ARGS.match(body)
            name, args = (v3.group(1).strip(), v3.group(2)) if v3 and head == "function" else (head, body)
            decoded = decode_json_prefix(args)
            if name and decoded is not None and isinstance(decoded[0], dict):
                out.append(ParsedCall(name, arguments_text(decoded[0])))
        return out

    def call_lark(self, tool: ToolDef, marker: Marker) -> str:
        # The V3 form: it is what DeepSeek-V3's own template writes for earlier calls.
        return (f'{marker(CALL_BEGIN)} "function" {marker(SEP)} {lark_literal(tool.name)} "\\n```json\\n" '
                f'{lark_json(schema_of(tool))} "\\n```" {marker(CALL_END)}')

    def forced_lark(self, tools: Sequence[ToolDef], marker: Marker) -> str:
        one = super().forced_lark(tools, marker).splitlines()
        return "\n".join([f"start: {marker(CALLS_BEGIN)} call {marker(CALLS_END)}",
                          "call: " + one[0].removeprefix("start: "), *one[1:]]) + "\n"
