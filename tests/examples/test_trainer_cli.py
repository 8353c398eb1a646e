"""The example trainer's command line as a new user meets it: ``--help`` describes every flag
with its default."""
import argparse
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import examples.async_trainer.__main__ as cli
from examples.async_trainer.config import HELP, TrainerConfig

REPO = Path(__file__).resolve().parents[2]


def _parser_actions(monkeypatch):
    """The parser ``cli.parse`` builds (captured before it parses)."""
    built = []
    real = argparse.ArgumentParser.parse_args

    def capture(self, *a, **kw):
        built.append(self)
        return real(self, *a, **kw)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    cli.parse([])
    (parser,) = built
    return [a for a in parser._actions if a.dest != "help"]


def test_every_field_has_a_description():
    assert set(HELP) == {f.name for f in fields(TrainerConfig)}
    assert all(text.strip() and "\n" not in text for text in HELP.values())


def test_every_flag_has_a_description_and_shows_its_default(monkeypatch):
    actions = _parser_actions(monkeypatch)
    assert len(actions) == len(fields(TrainerConfig))
    for action in actions:
        text = action.help or ""
        description, _, shown = text.rpartition(" (default: ")
        assert description.strip(), action.dest
        default = action.default
        expected = repr(default) if isinstance(default, str) else \
            str(default).lower() if isinstance(default, bool) else str(default)
        assert shown == expected + ")", (action.dest, text)


def test_help_prints_every_flag():
    out = subprocess.run([sys.executable, "-m", "examples.async_trainer", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())                 # argparse wraps lines
    for f in fields(TrainerConfig):
        assert f"--{f.name.replace('_', '-')} " in text
    assert "(default: 'reverse,tool,tora')" in text     # the CLI's own default for --tasks
    assert "--batch-invariant [BOOL] rollout and trainer log-probs bitwise equal" in text
    assert text.count("(default: ") == len(fields(TrainerConfig))
