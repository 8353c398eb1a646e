"""The example trainer's command line as a new user meets it: ``--help`` describes every flag
with its default; ``--resume`` of a finished run starts nothing and says the run is complete."""
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


def test_flags_a_resume_ignores_are_named():
    assert cli.ignored_on_resume(["--rl-steps", "9", "--out-dir", "x"]) == []
    assert cli.ignored_on_resume(["--resume", "c.pt", "--out-dir", "x", "--device", "cpu",
                                  "--progress", "--rl-steps", "9", "--batch-invariant"]) == \
        ["--rl-steps", "--batch-invariant"]


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


def test_resume_of_a_finished_run_starts_nothing_and_says_so(tmp_path, monkeypatch, capsys):
    from examples.async_trainer import trainer
    from examples.async_trainer.train import recipe
    from examples.async_trainer.log import setup_logging
    setup_logging()
    cfg = TrainerConfig(tasks="reverse", sft_steps=2, rl_steps=2, opd_steps=0,
                        prompts_per_step=2, group_size=2, eval_prompts=4, progress=False,
                        rollout_backend="process", out_dir=str(tmp_path))
    done = trainer.train(cfg)
    assert done["exit_code"] == 0
    metrics = (tmp_path / "metrics.jsonl").read_bytes()

    def refuse(*a, **kw):
        raise AssertionError("a finished run's resume started a stage or an engine")

    monkeypatch.setattr(trainer, "start_engines", refuse)
    monkeypatch.setattr(trainer, "Run", refuse)
    capsys.readouterr()
    code = cli.main(["--resume", str(tmp_path / "checkpoint.pt"), "--out-dir", str(tmp_path),
                     "--rl-steps", "5", "--progress", "false"])
    assert code == 0
    err = capsys.readouterr().err
    assert "is already complete" in err and "nothing to do" in err
    # More steps cannot be asked of a resume: the flag is named as ignored, not dropped silently.
    assert "checkpoint's configuration: --rl-steps ignored" in err
    assert (tmp_path / "metrics.jsonl").read_bytes() == metrics      # nothing rewritten
    again = trainer.train(TrainerConfig(resume=str(tmp_path / "checkpoint.pt"),
                                        out_dir=str(tmp_path), progress=False))
    assert again["exit_code"] == 0 and again["evals"] == done["evals"]
    assert again["trained_ids"] == done["trained_ids"]
    # A stage evaluated but not finished (or the reverse) is not complete.
    assert recipe.pending_stages(cfg, {"sft": {}}, [{"kind": "eval", "stage": "sft"}]) == \
        ["rl:reverse"]
