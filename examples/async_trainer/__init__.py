"""Example GLM-5-style post-training on CPU by default: SFT, asynchronous GRPO + IcePop per
task, then two-teacher on-policy distillation (``python -m examples.async_trainer``;
docs/trainer.md)."""
