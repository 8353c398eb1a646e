"""Scripted policies for the trainer tests: generation walks a known path."""
import torch

from examples.async_trainer.env import task


class ScriptedPolicy(torch.nn.Module):
    """All probability on ``script(prompt)``'s next token at each length, EOS past its end;
    ``prompt`` is the first ``prompt_len`` tokens of the row (environment positions included:
    it never looks at what the environment actually wrote)."""

    def __init__(self, cfg, prompt_len: int, script):
        super().__init__()
        self.cfg, self.prompt_len, self.script = cfg, prompt_len, script
        self.dummy = torch.nn.Parameter(torch.zeros(()))

    def forward(self, toks):
        b, t = toks.shape
        logits = torch.full((b, t, task.vocab_size(self.cfg)), -30.0)
        for i, row in enumerate(toks.tolist()):
            prompt = row[:self.prompt_len]
            want = prompt + self.script(prompt)
            logits[i, -1, want[t] if t < len(want) else task.EOS] = 30.0
        return logits
