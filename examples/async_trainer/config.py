"""Configuration of the example trainer, validated (with errors naming the field) before
anything starts."""
import importlib.util
from dataclasses import dataclass, fields
from typing import Dict, List

import torch

from .env import task


def _ray_installed() -> bool:
    return importlib.util.find_spec("ray") is not None


@dataclass
class TrainerConfig:
    # task: reverse a digit string, plainly ("reverse") or through a tool call ("tool"), or
    # a product through a sandboxed python block ("tora"; the CLI's default adds it)
    tasks: str = "reverse,tool"      # RL tasks, one teacher each; OPD mixes them
    num_digits: int = 3
    vocab_digits: int = 5
    # model: GLM-5's architecture (transformers' GlmMoeDsaForCausalLM, model/policy.py):
    # MLA attention with the DSA indexer, dense first layers, then sigmoid-routed MoE layers
    d_model: int = 48
    n_layers: int = 2
    dense_layers: int = 1            # the first layers' dense MLP (GLM-5: 3 of 78)
    n_heads: int = 4
    n_experts: int = 4
    top_k: int = 2
    n_expert_groups: int = 2         # noaux_tc group-limited routing
    topk_groups: int = 2
    balance_bias_rate: float = 1e-3  # aux-loss-free load-balancing bias step
    # stage 1: SFT warm-up on the mixture of tasks
    sft_steps: int = 120             # GLM-5 policy, held-out after SFT: 100 steps ~0.4-0.6
                                     # on reverse (RL then ended a few prompts short), 120
                                     # ~0.8 (RL learns the rest), 150 ~1.0 (nothing left)
    sft_batch: int = 32
    sft_lr: float = 3e-3
    sft_weights: str = "reverse=3,tool=2,tora=4"  # SFT examples per task relative to 1
                                         # (tasks not listed: 1); the longer copies take
                                         # longer to learn, reverse's repeated digits too
    # stage 2: asynchronous GRPO + IcePop, one run per task (the teachers)
    rl_steps: int = 100
    rl_lr: float = 2.5e-4            # the AdamW parts (embeddings, lm_head, routers, norms):
                                     # at 2e-3 the GLM-5 policy's RL learned slowly, and
                                     # plain AdamW collapsed it to early EOS (docs/trainer.md)
    prompts_per_step: int = 8
    group_size: int = 8
    # stage 3: on-policy distillation of both teachers into the SFT student (group size 1)
    opd_steps: int = 200
    opd_lr: float = 2.5e-4
    opd_prompts_per_step: int = 32
    opd_ratio: float = 0.4           # fraction of OPD prompts drawn from the first task (the
                                     # others share the rest equally)
    # optimizer of RL and OPD: MuonSplit (Muon lr for matrices; rl_lr / opd_lr for AdamW parts)
    muon_lr: float = 0.002           # GLM-5 policy: 0.004 / 0.006 / 0.01 made the pass rate fall
    weight_decay: float = 0.0
    lr_schedule: str = "linear"      # RL and OPD: "constant", "linear" or "cosine" decay of
                                     # every group's rate to lr_min_ratio times it at the end
    lr_min_ratio: float = 0.1
    lr_warmup_steps: int = 0         # linear warm-up steps of each RL/OPD stage
    # trainer mechanics
    dp_ranks: int = 2                # simulated data-parallel ranks
    packing: str = "kk"              # "first_fit" or "kk" (Karmarkar-Karp balanced)
    max_tokens_per_microbatch: int = 256
    rollout_batch_samples: int = 64  # trajectories generated per batch (process) / per session
                                     # round over the engines (ray), at most
    max_ahead_steps: int = 1         # staleness bound: a group is trained at most this many
                                     # weight versions after the one it was generated with
    rollout_dtype: str = "auto"      # weights the rollout engine runs in: "bfloat16",
                                     # "float32"; "auto": bfloat16, float32 if batch_invariant
    batch_invariant: bool = False    # rollout and trainer log-probs bitwise equal (docs/
                                     # trainer.md, "Batch-invariant mode"); fp32 rollout, CPU
    routing_replay: bool = True      # R3: train with the experts the rollout routed to
    beta: float = 2.0                # IcePop gate [1/beta, beta]
    eps_low: float = 0.2
    eps_high: float = 0.28
    eval_prompts: int = 64
    device: str = "auto"             # "auto" (cuda if available), "cpu" or "cuda"
    seed: int = 0
    out_dir: str = "runs/async_trainer"
    resume: str = ""                 # path of a checkpoint.pt to continue from
    checkpoint_every: int = 10       # optimizer steps between checkpoints (0: only at stage
                                     # ends and on exit); always also on Ctrl-C/SIGTERM/failure
    rollout_restarts: int = 3        # rollout process deaths in a row (no step between) that
                                     # are restarted; one more stops the run (exit 1)
    progress: bool = True            # tqdm progress bars
    # rollout engines (docs/trainer.md, "Rollout engines on Ray")
    rollout_backend: str = "auto"    # "ray": engine actors behind a session router; "process":
                                     # one spawned rollout process; "auto": ray when installed
    engines: int = 2                 # rollout engine actors (ray)
    ray_address: str = ""            # "": start a local Ray instance; else join that cluster
    health_interval: float = 1.0     # seconds between engine health checks (ray)
    kill_engine_at: int = 0          # kill one engine actor after this global step (0: never)
    # engine placement (docs/trainer.md, "Placement groups and running on a cluster")
    engine_cpus: float = 1.0         # CPUs of each engine's placement-group bundle (ray)
    placement_strategy: str = "PACK"  # PACK, SPREAD (over nodes), STRICT_PACK, STRICT_SPREAD
    placement_timeout: float = 60.0  # seconds to wait for the bundles before failing (ray)

    def task_list(self) -> List[str]:
        return [t.strip() for t in self.tasks.split(",") if t.strip()]

    def sft_order(self) -> List[str]:
        """One cycle of SFT prompt tasks: each listed task ``weight`` times (``sft_weights``)."""
        weights = dict((k.strip(), int(v)) for k, v in
                       (item.split("=") for item in self.sft_weights.split(",") if item.strip()))
        return [n for n in self.task_list() for _ in range(weights.get(n, 1))]

    def opd_mix(self) -> Dict[str, float]:
        """OPD prompt mix: ``opd_ratio`` for the first task, the rest shared equally."""
        names = self.task_list()
        if len(names) == 1:
            return {names[0]: 1.0}
        rest = (1.0 - self.opd_ratio) / (len(names) - 1)
        return {names[0]: self.opd_ratio, **{n: rest for n in names[1:]}}

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def rollout_torch_dtype(self) -> torch.dtype:
        if self.rollout_dtype == "auto":
            return torch.float32 if self.batch_invariant else torch.bfloat16
        return {"bfloat16": torch.bfloat16, "float32": torch.float32}[self.rollout_dtype]

    def use_ray(self) -> bool:
        """Whether rollout runs on Ray engine actors (``rollout_backend``, resolved)."""
        if self.rollout_backend == "auto":
            return _ray_installed()
        return self.rollout_backend == "ray"

    def validate(self) -> "TrainerConfig":
        for f in fields(self):
            v = getattr(self, f.name)
            expected = type(f.default)
            if expected is float and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
                setattr(self, f.name, v)
            if not isinstance(v, expected) or (expected is int and isinstance(v, bool)):
                raise TypeError(f"config.{f.name} must be {expected.__name__}, got {v!r}")
        positive = ("num_digits", "d_model", "n_layers", "n_heads", "n_experts", "top_k",
                    "n_expert_groups", "topk_groups", "sft_batch", "sft_lr", "rl_lr", "muon_lr",
                    "prompts_per_step", "opd_lr", "opd_prompts_per_step", "dp_ranks",
                    "max_tokens_per_microbatch", "rollout_batch_samples", "max_ahead_steps", "eps_low",
                    "eps_high", "eval_prompts", "engines", "health_interval", "engine_cpus",
                    "placement_timeout")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"config.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("sft_steps", "rl_steps", "opd_steps", "weight_decay", "balance_bias_rate",
                     "checkpoint_every", "rollout_restarts", "kill_engine_at",
                     "lr_warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"config.{name} must be >= 0, got {getattr(self, name)!r}")
        names = self.task_list()
        if not names or len(set(names)) != len(names) or any(n not in task.TASKS for n in names):
            raise ValueError(f"config.tasks must list distinct tasks of "
                             f"{list(task.TASKS)} separated by a comma, got {self.tasks!r}")
        try:
            weights = [w.split("=") for w in self.sft_weights.split(",") if w.strip()]
            bad = [w for w in weights if len(w) != 2 or w[0].strip() not in task.TASKS
                   or not w[1].strip().isdigit() or int(w[1]) < 1]
        except ValueError:
            bad = [self.sft_weights]
        if bad:
            raise ValueError(f"config.sft_weights must be 'task=N,...' with tasks of "
                             f"{list(task.TASKS)} and N >= 1, got {self.sft_weights!r}")
        if self.vocab_digits < 2:
            raise ValueError(f"config.vocab_digits must be >= 2, got {self.vocab_digits}")
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2 \
                or self.d_model // self.n_heads < 4:
            raise ValueError(f"config.d_model ({self.d_model}) must be n_heads ({self.n_heads}) "
                             f"times an even head size of at least 4 (its rotary part is even)")
        if not 0 <= self.dense_layers < self.n_layers:
            raise ValueError(f"config.dense_layers ({self.dense_layers}) must be >= 0 and "
                             f"< n_layers ({self.n_layers}): routing replay needs a MoE layer")
        if self.top_k > self.n_experts:
            raise ValueError(f"config.top_k ({self.top_k}) must be <= n_experts ({self.n_experts})")
        if self.n_experts % self.n_expert_groups or self.topk_groups > self.n_expert_groups:
            raise ValueError(f"config.n_experts ({self.n_experts}) must split into "
                             f"n_expert_groups ({self.n_expert_groups}) equal groups and "
                             f"topk_groups ({self.topk_groups}) <= n_expert_groups")
        if self.top_k > (self.n_experts // self.n_expert_groups) * self.topk_groups:
            raise ValueError(f"config.top_k ({self.top_k}) exceeds the experts of the "
                             f"topk_groups ({self.topk_groups}) groups it may route to")
        if self.group_size < 2:
            raise ValueError(f"config.group_size must be >= 2 for GRPO, got {self.group_size}")
        if not 0.0 <= self.opd_ratio <= 1.0:
            raise ValueError(f"config.opd_ratio must lie in [0, 1], got {self.opd_ratio}")
        if self.lr_schedule not in ("constant", "linear", "cosine"):
            raise ValueError(f"config.lr_schedule must be 'constant', 'linear' or 'cosine', "
                             f"got {self.lr_schedule!r}")
        if not 0.0 <= self.lr_min_ratio <= 1.0:
            raise ValueError(f"config.lr_min_ratio must lie in [0, 1], got {self.lr_min_ratio}")
        if self.packing not in ("first_fit", "kk"):
            raise ValueError(f"config.packing must be 'first_fit' or 'kk', got {self.packing!r}")
        if self.max_tokens_per_microbatch < task.max_len(self):
            raise ValueError(f"config.max_tokens_per_microbatch ({self.max_tokens_per_microbatch})"
                             f" must hold one trajectory ({task.max_len(self)} tokens)")
        if self.beta <= 1.0:
            raise ValueError(f"config.beta must be > 1 (gate [1/beta, beta]), got {self.beta}")
        if self.rollout_dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"config.rollout_dtype must be 'auto', 'bfloat16' or 'float32', "
                             f"got {self.rollout_dtype!r}")
        if self.batch_invariant and self.rollout_dtype == "bfloat16":
            raise ValueError("config.rollout_dtype='bfloat16' with config.batch_invariant: the "
                             "rollout must run the trainer's fp32 weights to match its "
                             "log-probs bitwise (use 'float32' or 'auto')")
        if self.rollout_backend not in ("auto", "ray", "process"):
            raise ValueError(f"config.rollout_backend must be 'auto', 'ray' or 'process', got "
                             f"{self.rollout_backend!r}")
        if self.rollout_backend == "ray" and not _ray_installed():
            raise ValueError("config.rollout_backend='ray' but ray is not installed "
                             "(pip install ray)")
        if self.placement_strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ValueError(f"config.placement_strategy must be 'PACK', 'SPREAD', 'STRICT_PACK' "
                             f"or 'STRICT_SPREAD', got {self.placement_strategy!r}")
        if self.kill_engine_at and not self.use_ray():
            raise ValueError(f"config.kill_engine_at ({self.kill_engine_at}) kills a Ray engine "
                             f"actor: it needs rollout_backend 'ray' (or 'auto' with ray "
                             f"installed)")
        if self.kill_engine_at:
            # Global steps of the engine stages (RL per task, then OPD) but the run's last:
            # the replacement must have a step left to happen in.
            first = self.sft_steps + 1
            last = self.sft_steps + len(names) * self.rl_steps + self.opd_steps - 1
            if not first <= self.kill_engine_at <= last:
                raise ValueError(
                    f"config.kill_engine_at ({self.kill_engine_at}) is a global step no engine "
                    f"stage reaches before the run ends: it must lie in {first}..{last} (after "
                    f"the {self.sft_steps} SFT steps, before the last of the "
                    f"{len(names) * self.rl_steps + self.opd_steps} RL/OPD steps)")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"config.device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("config.device='cuda' but torch.cuda.is_available() is False")
        if self.batch_invariant and self.resolved_device() != "cpu":
            raise ValueError(f"config.batch_invariant is built and tested on CPU only "
                             f"(device {self.resolved_device()!r}); use device 'cpu'")
        return self


# One line per field: the CLI's ``--help`` (each flag with its default) and the reference of
# what every field does (tests/examples/test_trainer_cli.py checks that none is missing).
HELP: Dict[str, str] = {
    "tasks": "RL tasks, comma-separated, of reverse, tool, tora (one RL stage and teacher each; "
             "OPD mixes them)",
    "num_digits": "digits of a task's number",
    "vocab_digits": "distinct digit tokens (>= 2)",
    "d_model": "model width (n_heads times an even head size >= 4)",
    "n_layers": "decoder layers of the GLM-5-shaped policy",
    "dense_layers": "first layers with a dense MLP (the rest are MoE; < n_layers)",
    "n_heads": "attention heads of the MLA layers",
    "n_experts": "MoE experts per layer",
    "top_k": "experts each token is routed to",
    "n_expert_groups": "expert groups of the group-limited (noaux_tc) routing",
    "topk_groups": "expert groups a token may route into",
    "balance_bias_rate": "step of the aux-loss-free load-balancing bias",
    "sft_steps": "SFT warm-up steps on the mixture of tasks",
    "sft_batch": "SFT examples per step",
    "sft_lr": "SFT learning rate",
    "sft_weights": "SFT examples per task relative to 1, as 'task=N,...' (tasks not listed: 1)",
    "rl_steps": "asynchronous GRPO + IcePop steps per task",
    "rl_lr": "RL learning rate (AdamW parts of MuonSplit)",
    "prompts_per_step": "RL prompts (groups) per step",
    "group_size": "RL samples per prompt (>= 2 for GRPO)",
    "opd_steps": "on-policy distillation steps (both teachers into the SFT student)",
    "opd_lr": "OPD learning rate (AdamW parts of MuonSplit)",
    "opd_prompts_per_step": "OPD prompts per step (group size 1)",
    "opd_ratio": "fraction of OPD prompts drawn from the first task (the others share the rest)",
    "muon_lr": "Muon learning rate of the matrices (RL and OPD)",
    "weight_decay": "weight decay of RL and OPD",
    "lr_schedule": "learning-rate schedule of each RL/OPD stage: constant, linear or cosine "
                   "(decay to lr_min_ratio times the rate at the stage end)",
    "lr_min_ratio": "final rate of a decaying lr_schedule, relative to the stage's rates",
    "lr_warmup_steps": "linear warm-up steps at the start of each RL/OPD stage",
    "dp_ranks": "simulated data-parallel ranks",
    "packing": "micro-batch packing: first_fit or kk (Karmarkar-Karp balanced)",
    "max_tokens_per_microbatch": "tokens per micro-batch (at least one trajectory)",
    "rollout_batch_samples": "trajectories generated per batch (process) or per session "
                             "round over the engines (ray), at most",
    "max_ahead_steps": "staleness bound: a group is trained at most this many weight versions "
                       "after the one it was generated with",
    "rollout_dtype": "weights the rollout runs in: bfloat16, float32, or auto (bfloat16; "
                     "float32 with --batch-invariant)",
    "batch_invariant": "rollout and trainer log-probs bitwise equal (fp32 rollout, CPU only; "
                       "docs/trainer.md)",
    "routing_replay": "train with the experts the rollout routed to (R3)",
    "beta": "IcePop gate [1/beta, beta] (> 1)",
    "eps_low": "PPO clip below 1",
    "eps_high": "PPO clip above 1",
    "eval_prompts": "held-out prompts per task of each evaluation",
    "device": "auto (cuda if available), cpu or cuda",
    "seed": "random seed",
    "out_dir": "where metrics.jsonl, checkpoint.pt and the plots go",
    "resume": "path of a checkpoint.pt to continue from",
    "checkpoint_every": "optimizer steps between checkpoints (0: only at stage ends and on "
                        "exit; always also on Ctrl-C, SIGTERM, a failure)",
    "rollout_restarts": "rollout deaths in a row (no step between) that are restarted; one "
                        "more stops the run (exit 1)",
    "progress": "tqdm progress bars",
    "rollout_backend": "ray (engine actors behind a session router), process (one spawned "
                       "rollout process), or auto (ray when installed)",
    "engines": "rollout engine actors (ray)",
    "ray_address": "Ray cluster to join ('': start a local Ray instance)",
    "health_interval": "seconds between engine health checks (ray)",
    "kill_engine_at": "kill one engine actor after this global step (0: never; ray)",
    "engine_cpus": "CPUs of each engine's placement-group bundle (ray)",
    "placement_strategy": "engine placement: PACK, SPREAD (over nodes), STRICT_PACK, "
                          "STRICT_SPREAD (ray)",
    "placement_timeout": "seconds to wait for the engines' bundles before failing (ray)",
}
