import argparse
from dataclasses import fields
from .config import TrainerConfig
from .trainer import train

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Asynchronous GRPO + IcePop example trainer")
    for f in fields(TrainerConfig):
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    train(TrainerConfig(**vars(ap.parse_args())))
