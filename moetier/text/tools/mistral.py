"""Mistral / Mixtral: `[TOOL_CALLS]` then a JSON list of {"name", "arguments"} (v3 tokenizers,
Mixtral-8x22B, Mistral-Small 3.1), or `NAME[ARGS]{...}` per call, each after its own
`[TOOL_CALLS]` (v11+ tokenizers; `[CALL_ID]ID` may sit before `[ARGS]`). The calls run to
the end of the output."""

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
    name_and_args_lark,
    schema_of,
)

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAMED = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*(?:" + re.escape(CALL_ID) + r"\s*([A-Za-z0-9]+)\s*)?"
                    + re.escape(ARGS), re.S)


class MistralFormat(ToolFormat):
    name = "mistral"
    start = TOOL_CALLS
    markers = (TOOL_CALLS, ARGS, CALL_ID)

    def calls(self, region: str, final: bool, tools: Sequence[ToolDef]) -> list[ParsedCall]:
        out: list[ParsedCall] = []
        for chunk in region.split(TOOL_CALLS)[1:]:
            decoded = decode_json_prefix(chunk)
            if decoded is not None and isinstance(decoded[0], list):  # the JSON-list form
                for c in decoded[0]:
                    if isinstance(c, dict) and isinstance(c.get("name"), str):
                        out.append(ParsedCall(c["name"], arguments_text(c.get("arguments", {})), c.get("id")))
                continue
            m = _NAMED.match(chunk)
            if m is None:
                continue
            args = decode_json_prefix(chunk[m.end() :])
            if args is not None and isinstance(args[0], dict):
                out.append(ParsedCall(m.group(1), arguments_text(args[0]), m.group(2)))
        return out

    def call_lark(self, tool: ToolDef, marker: Marker) -> str:
        # The v11 form when [ARGS] is a token of the tokenizer, else the JSON-list form.
        if marker(ARGS) != lark_literal(ARGS):
            return f"{marker(TOOL_CALLS)} {lark_literal(tool.name)} {marker(ARGS)} {lark_json(schema_of(tool))}"
        return f'{marker(TOOL_CALLS)} "[" {name_and_args_lark(tool)} "]"'
