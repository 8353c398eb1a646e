"""Example asynchronous GRPO + IcePop trainer (CPU by default): ``python -m examples.async_trainer``."""
