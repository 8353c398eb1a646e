"""``python -m examples.async_trainer [--rl-steps 60 ...]``: every TrainerConfig field is a flag."""
import argparse
import sys
from dataclasses import fields

from .config import TrainerConfig
from .log import logger, setup_logging
from .trainer import train


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def parse(argv=None) -> TrainerConfig:
    ap = argparse.ArgumentParser(prog="python -m examples.async_trainer",
                                 description="SFT -> async GRPO + IcePop per task -> OPD, on CPU "
                                             "by default (see docs/trainer.md)")
    for f in fields(TrainerConfig):
        kind = _bool if isinstance(f.default, bool) else type(f.default)
        ap.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default,
                        metavar=type(f.default).__name__.upper())
    return TrainerConfig(**vars(ap.parse_args(argv)))


def main(argv=None) -> int:
    setup_logging()
    cfg = parse(argv)
    try:
        cfg.validate()
    except (TypeError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = train(cfg)
    ev = out["evals"]
    logger.info("held-out greedy pass rate: " + "; ".join(
        f"{stage}: " + ", ".join(f"{t}={v:.3f}" for t, v in r.items()) for stage, r in ev.items()))
    logger.info(f"outputs in {cfg.out_dir}: metrics.jsonl, metrics.png, checkpoint.pt")
    return 130 if out["interrupted"] else 0


if __name__ == "__main__":
    sys.exit(main())
