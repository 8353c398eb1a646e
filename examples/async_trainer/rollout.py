"""Rollout process: generates with the latest weights it has, records fp32 log-probs."""
import queue
import torch
from . import task
from .model import TinyLM


@torch.no_grad()
def generate(model, prompt, n, max_new):
    toks = torch.tensor([prompt] * n)
    lps = []
    for _ in range(max_new):
        logp = torch.log_softmax(model(toks)[:, -1].float(), -1)
        nxt = torch.multinomial(logp.exp(), 1)
        lps.append(logp.gather(-1, nxt))
        toks = torch.cat([toks, nxt], 1)
    return toks, torch.cat(lps, 1)


def rollout_worker(cfg, weights_q, sample_q, stop_ev):
    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed + 1)
    gen = torch.Generator().manual_seed(cfg.seed + 2)
    model = TinyLM(cfg, task.vocab_size(cfg)).eval()
    version, pid = -1, 0
    while not stop_ev.is_set():
        try:                                   # take the newest weights available, never wait
            while True:
                version, state = weights_q.get(timeout=0.01 if version >= 0 else 1.0)
                model.load_state_dict(state)
        except queue.Empty:
            pass
        if version < 0:
            continue
        prompt = task.make_prompt(cfg, gen)
        toks, lps = generate(model, prompt, cfg.group_size, cfg.num_digits + 1)
        for i in range(cfg.group_size):
            resp = toks[i, len(prompt):].tolist()
            sample_q.put({"prompt_id": pid, "sample_id": pid * cfg.group_size + i,
                          "tokens": toks[i].tolist(), "prompt_len": len(prompt),
                          "rollout_logprobs": lps[i].tolist(), "version": version,
                          "reward": task.reward(prompt, resp)})
        pid += 1
