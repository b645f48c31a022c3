"""`moetier generate`: the demo model by default (built once), text streaming, chat template,
eos stops, and sampling determinism."""

from __future__ import annotations

from pathlib import Path

import pytest

from moetier.cli import main
from moetier.convert.synth import write_container
from moetier.engine import Engine
from moetier.model.sampling import SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_container("tiny-qwen2_moe", tmp_path_factory.mktemp("gen") / "tiny", 0)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[str, str]:
    capsys.readouterr()
    assert main(["generate", *argv]) == 0
    out = capsys.readouterr()
    return out.out, out.err


def test_default_model_is_the_demo_built_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "moetier.yaml"
    config.write_text(f"data_dir: {tmp_path / 'data'}\n")
    argv = ("--config", str(config), "--prompt", "The disk", "--max-tokens", "12", "--temperature", "0",
            "--ignore-eos")
    out1, err1 = run(capsys, *argv)
    assert "building the demo model" in err1
    assert (tmp_path / "data" / "models" / "demo" / "moetier.json").is_file()
    assert not [p for p in (tmp_path / "data" / "models").iterdir() if p.name != "demo"]  # no leftovers
    out2, err2 = run(capsys, *argv)
    assert "building" not in err2
    assert out1 == out2 and out1.strip()  # greedy: the same text twice
    assert "generated 12 tokens" in err2 and "tok/s" in err2 and "expert hit rate" in err2


def test_text_is_the_decoded_tokens(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = ("--model", str(tiny), "--max-tokens", "16", "--temperature", "0.9", "--seed", "5", "--ignore-eos")
    text, _ = run(capsys, *common, "--prompt", "hello there")
    ids, _ = run(capsys, *common, "--prompt", "hello there", "--show-ids")
    with Engine.open(tiny) as engine:
        tokens = [int(t) for t in ids.strip().split(",")]
        assert text == engine.tokenizer.decode(tokens) + "\n"
        prompt = engine.tokenizer.encode("hello there")
        same = [g.token for g in engine.generate(prompt, SamplingParams(temperature=0.9, seed=5, max_tokens=16,
                                                                        ignore_eos=True))]
    assert same == tokens


def test_chat_prompt_uses_the_template(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, err_plain = run(capsys, "--model", str(tiny), "--prompt", "hi", "--max-tokens", "1")
    _, err_chat = run(capsys, "--model", str(tiny), "--prompt", "hi", "--max-tokens", "1", "--chat")
    with Engine.open(tiny) as engine:
        tok = engine.tokenizer
        assert tok.chat_template is not None
        rendered = tok.chat_template.render([{"role": "user", "content": "hi"}])
        n_chat = len(tok.encode(rendered, add_special_tokens=False))
    assert f"prompt {len(tok.encode('hi'))} tokens" in err_plain
    assert f"prompt {n_chat} tokens" in err_chat


def test_stops_at_the_models_eos_ids(tiny: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    with Engine.open(tiny) as engine:
        assert engine.eos_token_ids() == (1, 6)  # generation_config.json of the synth tokenizer
    free, _ = run(capsys, "--model", str(tiny), "--prompt-ids", "3,4,5", "--temperature", "0",
                  "--max-tokens", "8", "--ignore-eos", "--show-ids")
    tokens = [int(t) for t in free.strip().split(",")]
    # pretend the model's eos is the 3rd greedy token: generation must end right after it
    monkeypatch.setattr(Engine, "eos_token_ids", lambda self: (tokens[2],))
    stopped, err = run(capsys, "--model", str(tiny), "--prompt-ids", "3,4,5", "--temperature", "0",
                       "--max-tokens", "8", "--show-ids")
    first = tokens.index(tokens[2])
    assert [int(t) for t in stopped.strip().split(",")] == tokens[: first + 1]
    assert f"generated {first + 1} tokens" in err


def test_too_long_is_refused(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(tiny), "--prompt-ids", "3,4", "--max-tokens", "5000"]) == 1
    assert "exceed the model's 2048 positions" in capsys.readouterr().err
