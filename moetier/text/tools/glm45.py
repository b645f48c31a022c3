"""GLM-4.5 / GLM-4.6 / GLM-4.7 / GLM-5: `<tool_call>NAME` then `<arg_key>K</arg_key>` /
`<arg_value>V</arg_value>` pairs, then `</tool_call>` (GLM-4.5 puts newlines between the parts,
GLM-4.7 and GLM-5 none). A string argument is written raw, any other value as JSON: a value is
read as JSON unless the tool's schema says the parameter is a string (then it is kept raw,
unless it is itself a JSON string literal)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from moetier.text.conversation import ToolDef
from moetier.text.grammar import lark_json, lark_literal
from moetier.text.tools.base import Marker, ParsedCall, ToolFormat, schema_of

_CALL = re.compile(r"<tool_call>\s*([^<\n]*?)\s*((?:<arg_key>.*?</arg_key>\s*<arg_value>.*?</arg_value>\s*)*)</tool_call>",
                   re.S)
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _is_string(prop: Any) -> bool:
    return isinstance(prop, dict) and prop.get("type") == "string"


def _value(raw: str, prop: Any) -> Any:
    try:
        v = json.loads(raw)
    except ValueError:
        return raw
    if _is_string(prop) and not isinstance(v, str):
        return raw
    return v


class Glm45Format(ToolFormat):
    name = "glm45"
    start = "<tool_call>"
    markers = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")

    def calls(self, region: str, final: bool, tools: Sequence[ToolDef]) -> list[ParsedCall]:
        out = []
        for m in _CALL.finditer(region):
            name = m.group(1).strip()
            if not name:
                continue
            tool = next((t for t in tools if t.name == name), None)
            props = schema_of(tool).get("properties", {}) if tool else {}
            args = {k.strip(): _value(v, props.get(k.strip())) for k, v in _PAIR.findall(m.group(2))}
            out.append(ParsedCall(name, json.dumps(args, ensure_ascii=False)))
        return out

    def call_lark(self, tool: ToolDef, marker: Marker) -> str:
        """Every property in schema order, each value as JSON of its own schema. Only schemas
        whose constraints are per property fit this format (flat objects)."""
        schema = schema_of(tool)
        props: dict[str, Any] = schema.get("properties", {})
        parts = [marker("<tool_call>"), lark_literal(tool.name + "\n")]
        for key, prop in props.items():
            pair = (f'{marker("<arg_key>")} {lark_literal(key)} {marker("</arg_key>")} "\\n" '
                    f'{marker("<arg_value>")} {lark_json(prop if isinstance(prop, dict) else {})} '
                    f'{marker("</arg_value>")} "\\n"')
            parts.append(pair if key in schema.get("required", []) else f"({pair})?")
        parts.append(marker("</tool_call>"))
        return " ".join(parts)
