"""Verifiable task: reverse a digit string. Binary reward (exact match = 1, else 0).

Trajectories use the 4-role template: ``<system> <user> d1..dn <assistant> answer <eos>``.
Role tokens: SYSTEM, USER, ASSISTANT, OBSERVATION (observation tokens, when a tool answers,
are masked out of the loss by :func:`loss_mask`).
"""
import torch

SYSTEM, USER, ASSISTANT, OBSERVATION, EOS = 0, 1, 2, 3, 4
N_SPECIAL = 5


def vocab_size(cfg) -> int:
    return N_SPECIAL + cfg.vocab_digits


def make_prompt(cfg, gen: torch.Generator):
    digits = torch.randint(0, cfg.vocab_digits, (cfg.num_digits,), generator=gen) + N_SPECIAL
    return [SYSTEM, USER, *digits.tolist(), ASSISTANT]


def target(prompt):
    return list(reversed(prompt[2:-1])) + [EOS]


def reward(prompt, response) -> float:
    return 1.0 if list(response) == target(prompt) else 0.0


def loss_mask(tokens, prompt_len):
    """1 on assistant-generated tokens, 0 on the prompt and on observation-role spans."""
    mask, in_obs = [], False
    for i, t in enumerate(tokens):
        if t == OBSERVATION:
            in_obs = True
        elif t == ASSISTANT:
            in_obs = False
        mask.append(0.0 if i < prompt_len or in_obs or t in (OBSERVATION, ASSISTANT) else 1.0)
    return mask
