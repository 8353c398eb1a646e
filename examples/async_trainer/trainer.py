"""SFT warm-up, then asynchronous GRPO + IcePop with a separate rollout process."""
import json
import os
import queue
import time
import torch
import torch.multiprocessing as mp
from glm_kernels._dispatch import warn_once
from glm_kernels.loss import group_advantages, icepop_loss
from . import task
from .buffer import DataBuffer
from .model import TinyLM, token_logprobs
from .packing import assign_to_ranks
from .rollout import generate, rollout_worker


def make_optimizer(model, lr):
    warn_once("example.optim", "examples.async_trainer: glm_kernels.optim.MuonSplit not available; "
              "using torch.optim.AdamW")
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)


@torch.no_grad()
def evaluate(cfg, model, n=64, seed=123):
    gen = torch.Generator().manual_seed(seed)
    hits = 0.0
    for _ in range(n):
        p = task.make_prompt(cfg, gen)
        toks, _ = generate(model, p, 1, cfg.num_digits + 1)
        hits += task.reward(p, toks[0, len(p):].tolist())
    return hits / n


def sft(cfg, model, log):
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr)
    gen = torch.Generator().manual_seed(cfg.seed)
    for step in range(cfg.sft_steps):
        prompts = [task.make_prompt(cfg, gen) for _ in range(32)]
        toks = torch.tensor([p + task.target(p) for p in prompts])
        mask = torch.tensor([task.loss_mask(t, len(p)) for t, p in zip(toks.tolist(), prompts)])[:, 1:]
        loss = -(token_logprobs(model, toks) * mask).sum() / mask.sum()
        opt.zero_grad(); loss.backward(); opt.step()
    log({"stage": "sft", "step": cfg.sft_steps, "eval_reward": evaluate(cfg, model)})


def save(cfg, model, step):
    torch.save({"model": model.state_dict(), "step": step}, os.path.join(cfg.out_dir, "checkpoint.pt"))


def train(cfg):
    cfg.validate()
    os.makedirs(cfg.out_dir, exist_ok=True)
    torch.manual_seed(cfg.seed)
    metrics_path = os.path.join(cfg.out_dir, "metrics.jsonl")
    records = []
    mf = open(metrics_path, "w")

    def log(rec):
        records.append(rec); mf.write(json.dumps(rec) + "\n"); mf.flush()
        print(rec, flush=True)

    model = TinyLM(cfg, task.vocab_size(cfg))
    sft(cfg, model, log)
    opt = make_optimizer(model, cfg.rl_lr)
    ctx = mp.get_context("spawn")
    weights_q, sample_q, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=rollout_worker, args=(cfg, weights_q, sample_q, stop), daemon=True)
    proc.start()
    version = 0
    weights_q.put((version, {k: v.clone() for k, v in model.state_dict().items()}))
    buf, trained_ids, step = DataBuffer(cfg.group_size), [], 0
    try:
        while step < cfg.rl_steps:
            groups = []
            while len(groups) < cfg.prompts_per_step:
                buf.add(sample_q.get(timeout=120))
                groups += buf.pop_ready(cfg.prompts_per_step - len(groups))
            samples = [s for g in groups for s in g]
            rewards = torch.tensor([s["reward"] for s in samples])
            adv = group_advantages(rewards, cfg.group_size)
            lengths = [len(s["tokens"]) for s in samples]
            ranks = assign_to_ranks(lengths, cfg.dp_ranks, cfg.max_tokens_per_microbatch, cfg.packing)
            opt.zero_grad()
            n_tok = sum(sum(task.loss_mask(s["tokens"], s["prompt_len"])) for s in samples)
            pops, clips = [], []
            for mbs in ranks:                      # simulated DP: gradients summed over ranks
                for mb in mbs:
                    toks = torch.tensor([samples[i]["tokens"] for i in mb])
                    P = samples[mb[0]]["prompt_len"]
                    lp = token_logprobs(model, toks)[:, P - 1:]
                    rl = torch.tensor([samples[i]["rollout_logprobs"] for i in mb])
                    loss, m = icepop_loss(lp, rl, adv[mb], beta=cfg.beta, reduction="sum",
                                          return_metrics=True)
                    (loss / n_tok).backward()
                    pops.append(float(m["pop_frac"])); clips.append(float(m["clip_frac"]))
            opt.step()
            trained_ids += [s["sample_id"] for s in samples]
            version += 1; step += 1
            state = {k: v.clone() for k, v in model.state_dict().items()}
            weights_q.put((version, state))
            warn_once("example.sync", "examples.async_trainer: glm_kernels.sync (delta=True) not "
                      "available; sending full state dicts over a multiprocessing queue")
            log({"stage": "rl", "step": step, "reward": float(rewards.mean()),
                 "pop_frac": sum(pops) / len(pops), "clip_frac": sum(clips) / len(clips),
                 "staleness": version - 1 - sum(s["version"] for s in samples) / len(samples),
                 "bytes_synced": sum(v.numel() * v.element_size() for v in state.values())})
    except KeyboardInterrupt:
        print("interrupted: saving checkpoint", flush=True)
    finally:
        save(cfg, model, step)
        stop.set(); proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()
    final = evaluate(cfg, model)
    log({"stage": "final", "step": step, "eval_reward": final})
    mf.close()
    plot(cfg, records)
    return {"records": records, "trained_ids": trained_ids, "final_eval": final}


def plot(cfg, records):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warn_once("example.plot", "matplotlib not installed: skipping metrics.png")
        return
    rl = [r for r in records if r["stage"] == "rl"]
    fig, ax = plt.subplots(3, 1, figsize=(6, 7), sharex=True)
    for a, key in zip(ax, ("reward", "pop_frac", "staleness")):
        a.plot([r["step"] for r in rl], [r[key] for r in rl]); a.set_ylabel(key)
    ax[-1].set_xlabel("RL step"); fig.savefig(os.path.join(cfg.out_dir, "metrics.png"))
