"""``python -m examples.async_trainer [--rl-steps 60 ...]``: every TrainerConfig field is a flag
(defaults: TrainerConfig's, except ``CLI_DEFAULTS``)."""
import argparse
import re
import sys
from dataclasses import fields

from .train.checkpoint import CheckpointError
from .config import HELP, TrainerConfig
from .log import logger, setup_logging
from .rollout.supervisor import RolloutError
from .train.run import RESUME_OVERRIDES
from .trainer import train


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


# The command line runs the whole demo (``make demo``): the ToRA task joins the two others.
# ``TrainerConfig()`` keeps the two-task default for programs and tests that build their own.
CLI_DEFAULTS = {"tasks": "reverse,tool,tora"}


def _parser(with_defaults: bool = True) -> argparse.ArgumentParser:
    """The CLI; ``with_defaults=False``: flags not given are left out of the result."""
    ap = argparse.ArgumentParser(prog="python -m examples.async_trainer",
                                 description="SFT -> async GRPO + IcePop per task -> OPD, on CPU "
                                             "by default (see docs/trainer.md)")
    for f in fields(TrainerConfig):
        flag = isinstance(f.default, bool)       # ``--batch-invariant`` alone means true
        default = CLI_DEFAULTS.get(f.name, f.default)
        shown = repr(default) if isinstance(default, str) else str(default).lower() if flag \
            else str(default)
        # argparse formats the help with %: a literal % in a description is doubled
        ap.add_argument("--" + f.name.replace("_", "-"), type=_bool if flag else type(f.default),
                        default=default if with_defaults else argparse.SUPPRESS,
                        metavar=type(f.default).__name__.upper(),
                        help=f"{HELP[f.name]} (default: {shown})".replace("%", "%%"),
                        **({"nargs": "?", "const": True} if flag else {}))
    return ap


def parse(argv=None) -> TrainerConfig:
    return TrainerConfig(**vars(_parser().parse_args(argv)))


def ignored_on_resume(argv=None) -> list:
    """The flags given with ``--resume`` that it ignores (it keeps the checkpoint's
    configuration but for ``train.run.RESUME_OVERRIDES``)."""
    given = vars(_parser(with_defaults=False).parse_args(argv))
    if not given.get("resume"):
        return []
    return ["--" + name.replace("_", "-") for name in given if name not in RESUME_OVERRIDES]


def _error(err: Exception) -> str:
    """``error: config.<field> ...`` plus the flag that sets the field."""
    text = str(err)
    named = re.search(r"config\.(\w+)", text)
    if named and named.group(1) in {f.name for f in fields(TrainerConfig)}:
        text += f" (flag --{named.group(1).replace('_', '-')})"
    return f"error: {text}"


def main(argv=None) -> int:
    """Exit status: 0 done; 2 bad configuration or resume file; 1 the rollout process (or the
    Ray engines) kept dying (after a checkpoint); 130 / 143 stopped by SIGINT / SIGTERM (after
    a checkpoint)."""
    setup_logging()
    cfg = parse(argv)
    try:
        cfg.validate()
    except (TypeError, ValueError) as err:
        print(_error(err), file=sys.stderr)
        return 2
    ignored = ignored_on_resume(argv)
    if ignored:
        logger.warning(f"--resume continues with the checkpoint's configuration: "
                       f"{' '.join(ignored)} ignored (only --out-dir, --device and --progress "
                       f"apply; more steps need a new run)")
    try:
        out = train(cfg)
    except CheckpointError as err:
        print(_error(err), file=sys.stderr)
        return 2
    except RolloutError as err:
        logger.error(str(err))
        return 1
    ev = out["evals"]
    if ev:
        logger.info("held-out greedy pass rate: " + "; ".join(
            f"{stage}: " + ", ".join(f"{t}={v:.3f}" for t, v in r.items())
            for stage, r in ev.items()))
    if out["exit_code"]:
        logger.warning(f"exit status {out['exit_code']} (interrupted)")
    return out["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
