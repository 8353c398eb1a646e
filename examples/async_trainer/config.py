"""Configuration of the example trainer, validated before anything starts."""
from dataclasses import dataclass, fields


@dataclass
class TrainerConfig:
    num_digits: int = 3          # task: reverse a string of this many digits
    vocab_digits: int = 5        # digits 0..vocab_digits-1
    d_model: int = 48
    n_layers: int = 2
    n_heads: int = 4
    n_experts: int = 4
    top_k: int = 2
    sft_steps: int = 25
    sft_lr: float = 3e-3
    rl_steps: int = 60
    rl_lr: float = 1e-3
    prompts_per_step: int = 8
    group_size: int = 8
    dp_ranks: int = 2
    packing: str = "kk"          # "first_fit" or "kk" (Karmarkar-Karp)
    max_tokens_per_microbatch: int = 256
    beta: float = 2.0
    seed: int = 0
    out_dir: str = "runs/async_trainer"

    def validate(self) -> "TrainerConfig":
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and f.name != "seed" and v <= 0 \
                    and f.name not in ("sft_steps",):
                raise ValueError(f"config.{f.name} must be > 0, got {v!r}")
        if self.sft_steps < 0:
            raise ValueError(f"config.sft_steps must be >= 0, got {self.sft_steps}")
        if self.d_model % self.n_heads:
            raise ValueError(f"config.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.top_k > self.n_experts:
            raise ValueError(f"config.top_k ({self.top_k}) must be <= n_experts ({self.n_experts})")
        if self.group_size < 2:
            raise ValueError(f"config.group_size must be >= 2 for GRPO, got {self.group_size}")
        if self.packing not in ("first_fit", "kk"):
            raise ValueError(f"config.packing must be 'first_fit' or 'kk', got {self.packing!r}")
        if self.vocab_digits < 2:
            raise ValueError(f"config.vocab_digits must be >= 2, got {self.vocab_digits}")
        return self
