"""What the example trainer's ``--batch-invariant`` costs, phase by phase, on CPU.

One process, the same model, prompts and samples for both modes, each phase timed as the
minimum over ``--repeats`` runs (the machine may be shared: the minimum is the least
disturbed run):
  generate  one rollout batch (``rollout_batch_samples`` = 64 trajectories: 8 prompts x 8)
            of the reverse and of the tool task on one thread, as an engine runs it, with a
            KV cache; default: bf16 weights; invariant: fp32, inside
            ``glm_kernels.batch_invariant()``
  train     one RL optimizer step over those 128 samples (``policy_step``: forward, IcePop,
            backward, MuonSplit) with the trainer's thread count; invariant: plus the
            behaviour recompute (``BehaviourPolicy.annotate``)
The model is the example's policy (``model/policy.py``: transformers' GlmMoeDsaForCausalLM).
``--root DIR`` imports ``examples.async_trainer`` from another checkout (default mode only
when it has no ``batch_invariant``; an older checkout's own model, ``TinyLM``): how "default
mode as fast as before" was checked.

    python benchmarks/trainer_invariant.py [--repeats 5] [--root DIR] [--default-only]
"""
import argparse
import copy
import importlib
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _example(path: str):
    """The example's module ``path`` (this layout), or its flat name in an older ``--root``."""
    try:
        return importlib.import_module("examples.async_trainer." + path)
    except ModuleNotFoundError:
        flat = {"rollout.local": "rollout", "model.tinylm": "model"}.get(path, path.split(".")[-1])
        return importlib.import_module("examples.async_trainer." + flat)


def _model_api():
    """(new_model(cfg), make_optimizer(model, cfg, lr)) of the checkout: the GLM-5 policy
    (``model/policy.py``), or an older checkout's ``TinyLM``."""
    try:
        policy = importlib.import_module("examples.async_trainer.model.policy")
    except ModuleNotFoundError:
        task = _example("env.task")
        tinylm = _example("model.tinylm")
        return (lambda cfg: tinylm.TinyLM(cfg, task.vocab_size(cfg))), tinylm.make_optimizer
    return policy.new_policy, policy.make_optimizer


def measure(invariant: bool, repeats: int) -> dict:
    from examples.async_trainer.config import TrainerConfig
    task = _example("env.task")
    fused_linear_grpo_loss = _example("train.batch").fused_linear_grpo_loss
    policy_step = _example("train.batch").policy_step
    new_model, make_optimizer = _model_api()
    generate = _example("rollout.local").generate
    from glm_kernels import group_advantages

    extra = {"batch_invariant": True} if invariant else {}
    cfg = TrainerConfig(progress=False, **extra).validate()
    torch.manual_seed(0)
    trainer_model = new_model(cfg)
    engine_model = copy.deepcopy(trainer_model).to(cfg.rollout_torch_dtype()).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = {name: [task.make_prompt(cfg, name, gen) for _ in range(8)]
               for name in ("reverse", "tool")}
    threads = torch.get_num_threads()

    samples = []

    def rollout():
        samples.clear()
        torch.set_num_threads(1)
        try:
            for name, ps in prompts.items():
                samples.extend(generate(cfg, engine_model, ps, 8,
                                        gen=torch.Generator().manual_seed(1)))
        finally:
            torch.set_num_threads(threads)

    out = {"generate": _best(rollout, repeats)}
    for s in samples:
        s["version"] = 1
    state = copy.deepcopy(trainer_model.state_dict())

    def train():
        model = new_model(cfg)
        model.load_state_dict(state)
        opt = make_optimizer(model, cfg, cfg.rl_lr)
        if invariant:
            BehaviourPolicy = _example("train.behaviour").BehaviourPolicy
            behaviour = BehaviourPolicy(cfg)
            behaviour.remember(1, model)
            behaviour.annotate(samples)
        rewards = torch.tensor([s["reward"] for s in samples], dtype=torch.float32)
        adv = group_advantages(rewards, 8)
        row_of = {id(s): i for i, s in enumerate(samples)}
        policy_step(cfg, model, opt, samples, fused_linear_grpo_loss(cfg, adv, row_of))

    out["train"] = _best(train, repeats)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--root", default=ROOT, help="checkout to import examples.async_trainer from")
    ap.add_argument("--default-only", action="store_true", help="time the default mode only")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.abspath(args.root))
    from examples.async_trainer.config import TrainerConfig
    has_mode = hasattr(TrainerConfig(), "batch_invariant") and not args.default_only
    rows = {"default": measure(False, args.repeats)}
    if has_mode:
        rows["batch-invariant"] = measure(True, args.repeats)
    print(f"examples.async_trainer from {os.path.abspath(args.root)}; torch "
          f"{torch.__version__}, {torch.get_num_threads()} trainer threads, min of "
          f"{args.repeats}")
    print(f"{'mode':<16} {'generate (s)':>13} {'train step (s)':>15}")
    for mode, r in rows.items():
        print(f"{mode:<16} {r['generate']:>13.3f} {r['train']:>15.3f}")
    if has_mode:
        d, i = rows["default"], rows["batch-invariant"]
        print(f"{'ratio':<16} {i['generate'] / d['generate']:>12.2f}x "
              f"{i['train'] / d['train']:>14.2f}x")


if __name__ == "__main__":
    main()
