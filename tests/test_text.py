"""The text layer: chat template (HF semantics), incremental detokenization, stop strings."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from helpers_gateway import make_model_dir

from moetier.convert.tokenizer import BOS, END, EOS
from moetier.errors import FormatError, InvalidArgument
from moetier.text import ChatTemplate, IncrementalDetokenizer, StopMatcher, TextTokenizer

pytestmark = pytest.mark.timeout(60)

SAMPLES = [
    "Hello, world!",
    "héllo wörld, ünïcödé façade",
    "日本語のテキスト、中文文本",
    "emoji 😀🎉👍🏽 and flags 🇫🇷 and a family 👨‍👩‍👧",
    "mixed: naïve café — “quotes” … ∑ x² ≤ ∞",
    "\ufffd a real replacement char, then text",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> TextTokenizer:
    return TextTokenizer.from_dir(make_model_dir(tmp_path_factory.mktemp("model")))


# ---- tokenizer files ---------------------------------------------------------------------


def test_reads_special_tokens_and_eos_ids(tok: TextTokenizer) -> None:
    assert tok.special_tokens["bos_token"] == BOS
    assert tok.special_tokens["eos_token"] == EOS
    eos = {tok.tokenizer.token_to_id(EOS), tok.tokenizer.token_to_id(END)}
    assert set(tok.eos_token_ids) == eos  # generation_config's list, and tokenizer_config's eos_token
    assert tok.chat_template is not None


def test_added_token_dicts_named_templates_and_config_fallback(tmp_path: Path, tok: TextTokenizer) -> None:
    d = make_model_dir(tmp_path)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["eos_token"] = {"content": END, "special": True}
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ eos_token }}"}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "generation_config.json").unlink()
    (d / "config.json").write_text(json.dumps({"eos_token_id": 1}))
    t = TextTokenizer.from_dir(d)
    assert t.eos_token_ids == tuple(sorted({1, t.tokenizer.token_to_id(END)}))
    assert t.chat_template is not None and t.chat_template.render([]) == "D" + END


def test_missing_tokenizer_is_a_format_error(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match=r"tokenizer\.json"):
        TextTokenizer.from_dir(tmp_path)


def test_token_bytes_are_exact_for_split_characters(tok: TextTokenizer) -> None:
    text = "日本語 😀"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # characters are split across tokens
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()


# ---- chat template -------------------------------------------------------------------------


def test_project_template_renders_hand_computed_string(tok: TextTokenizer) -> None:
    assert tok.chat_template is not None
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.chat_template.render(msgs) == f"{BOS}<|system|>\nBe brief.{END}\n<|user|>\nHi{END}\n<|assistant|>\n"
    assert tok.chat_template.render(msgs, add_generation_prompt=False).endswith(f"Hi{END}\n")


MULTILINE = """\
{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'assistant' and loop.first %}
        {{ raise_exception('Conversations must start with a user or system message') }}
    {% endif %}
    {% if message['role'] == 'system' %}
[SYS] {{ message['content'] | trim }}
    {% else %}
[{{ message['role'] | upper }}] {{ message['content'] }}{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}

    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
[ASSISTANT]
{% endif %}
{{ {"k": "é"} | tojson }}"""


def test_trim_and_lstrip_blocks_raise_exception_and_tojson() -> None:
    t = ChatTemplate(MULTILINE, {"bos_token": "<s>", "eos_token": "</s>"})
    msgs = [{"role": "system", "content": "  sys  "}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]
    # trim_blocks drops the newline after each block tag (the inline endif too, so the blank
    # line supplies the only newline after a user turn); lstrip_blocks the indentation before it.
    assert t.render(msgs) == '<s>\n[SYS] sys\n[USER] q\n[ASSISTANT] a</s>\n[USER] q2\n[ASSISTANT]\n{"k": "é"}'
    with pytest.raises(InvalidArgument, match="must start with a user"):
        t.render([{"role": "assistant", "content": "x"}])


def test_template_is_sandboxed() -> None:
    t = ChatTemplate("{{ messages.append(1) }}")
    with pytest.raises(InvalidArgument):
        t.render([{"role": "user", "content": "x"}])
    with pytest.raises(FormatError, match="syntax error"):
        ChatTemplate("{% for %}")


# ---- incremental detokenization ------------------------------------------------------------


def _stream(tok: TextTokenizer, ids: list[int], chunks: list[int]) -> list[str]:
    d = IncrementalDetokenizer(tok.decode)
    out: list[str] = []
    i = 0
    for n in chunks:
        out.append(d.add(ids[i:i + n]))
        i += n
    out.append(d.flush())
    return out


@pytest.mark.parametrize("text", SAMPLES)
def test_incremental_decode_never_breaks_utf8_and_concatenates_to_full_decode(tok: TextTokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids)
    assert full == text
    pieces = _stream(tok, ids, [1] * len(ids))
    assert "".join(pieces) == full
    if "\ufffd" not in text:
        assert all("\ufffd" not in p for p in pieces), pieces
    rng = random.Random(0)
    for _ in range(20):  # several tokens per step, at random
        chunks: list[int] = []
        while sum(chunks) < len(ids):
            chunks.append(min(rng.randint(1, 4), len(ids) - sum(chunks)))
        pieces = _stream(tok, ids, chunks)
        assert "".join(pieces) == full
        if "\ufffd" not in text:
            assert all("\ufffd" not in p for p in pieces)


def test_incomplete_character_is_held_then_released(tok: TextTokenizer) -> None:
    ids = tok.encode("a😀", add_special_tokens=False)  # 'a' + 4 byte tokens
    d = IncrementalDetokenizer(tok.decode)
    assert d.add(ids[:1]) == "a"
    assert [d.add([i]) for i in ids[1:-1]] == ["", "", ""]
    assert d.add(ids[-1:]) == "😀"
    assert d.flush() == ""


def test_truncated_character_at_end_of_stream_is_flushed_as_the_full_decode(tok: TextTokenizer) -> None:
    ids = tok.encode("ok😀", add_special_tokens=False)[:-2]  # the stream ends mid-character
    d = IncrementalDetokenizer(tok.decode)
    emitted = "".join(d.add([i]) for i in ids)
    assert "\ufffd" not in emitted
    assert emitted + d.flush() == tok.decode(ids)


def test_special_tokens_are_skipped(tok: TextTokenizer) -> None:
    end = tok.tokenizer.token_to_id(END)
    ids = [*tok.encode("hi", add_special_tokens=False), end]
    assert "".join(_stream(tok, ids, [1] * len(ids))) == "hi"


# ---- stop strings --------------------------------------------------------------------------


def _run_stops(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        out.append(m.feed(p))
        if m.stopped:
            break
    out.append(m.flush())
    return "".join(out), m.stopped


@pytest.mark.parametrize("stops,pieces,expected,stopped", [
    (["END"], ["abc", "E", "N", "D", "tail"], "abc", True),  # across three pieces
    (["END"], ["abcEN", "Dx"], "abc", True),
    (["END"], ["abcEN", "x"], "abcENx", False),  # a partial match that fails is released
    (["END"], ["abcE"], "abcE", False),  # a partial match at the end of the stream is text
    (["\n\n", "###"], ["a\n", "#", "##b"], "a\n", True),  # the first stop to occur wins
    (["y", "xyz"], ["axyz"], "a", True),  # the earliest occurrence, whichever stop it is
    (["aab"], ["a", "a", "a", "b"], "a", True),  # overlapping prefixes
    (["stop"], ["stop"], "", True),
    ([], ["free", "text"], "freetext", False),
])
def test_stop_strings(stops: list[str], pieces: list[str], expected: str, stopped: bool) -> None:
    assert _run_stops(stops, pieces) == (expected, stopped)


def test_stop_string_across_token_boundaries(tok: TextTokenizer) -> None:
    text = "Hello, world! The end."
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok.decode)
    m = StopMatcher(["world!"])
    out = []
    for i in ids:
        out.append(m.feed(d.add([i])))
        if m.stopped:
            break
    assert m.stopped and "".join(out) == "Hello, "
    assert len(tok.encode("world!", add_special_tokens=False)) > 1  # the stop really spans tokens
