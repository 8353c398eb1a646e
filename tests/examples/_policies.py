"""Scripted policies for the trainer tests: generation walks a known path."""
import torch

from examples.async_trainer.env import task
from examples.async_trainer.model import policy


def ScriptedPolicy(cfg, prompt_len: int, script):
    """The example's policy (GLM-5, patched: it routes and records routing as in a run) whose
    logits put all probability on ``script(prompt)``'s next token at each length, EOS past its
    end; ``prompt`` is the first ``prompt_len`` tokens of the row (environment positions
    included: it never looks at what the environment actually wrote). A KV-cache decode feeds
    only the new tokens: the rows so far are kept on the cache object."""
    model = policy.new_policy(cfg).eval()

    def scripted(module, args, kwargs, output):
        ids, cache = kwargs["input_ids"], kwargs.get("past_key_values")
        if cache is not None:
            ids = torch.cat([getattr(cache, "scripted_rows", ids[:, :0]), ids], 1)
            cache.scripted_rows = ids
        b, t = ids.shape
        logits = torch.full((b, output.logits.shape[1], task.vocab_size(cfg)), -30.0)
        for i, row in enumerate(ids.tolist()):
            prompt = row[:prompt_len]
            want = prompt + script(prompt)
            logits[i, -1, want[t] if t < len(want) else task.EOS] = 30.0
        output.logits = logits.to(output.logits)
        return output

    model.register_forward_hook(scripted, with_kwargs=True)
    return model
