"""The engine's side of generation, token in -> token out: one assistant turn for a batch of
token contexts (:func:`sample_turn`), and :class:`EngineCore`, which serves turn requests and
keeps every live session's prefix between its turns.

An engine knows nothing of tasks: a request is a session id, token contexts, a number of
steps and stop tokens. The environment (tool, sandbox, trajectory manager) runs between
turns on the caller's side (``rollout/sessions.py``), as in slime's rollout, where every turn is one
request through the router.

Generation runs the policy with its KV cache (transformers' ``DynamicCache``): a turn prefills
the cache with its context and decodes one position per step. What the engine keeps between a
session's turns is what routing replay needs: the ids the engine has fed through the model and
the experts every MoE layer routed each of those positions to (``record_routing``). A new turn
whose context starts with a cached prefix takes the routing of that prefix from the cache (an
engine with a prefix cache never recomputes it) and records only the rest. The KV tensors of
a finished turn are not kept (the next turn prefills again: compute, not bits, at these
sizes); the routing cache makes the routing what a real engine's would be and measures session
affinity honestly (a turn finds its session's prefix only on the engine that served it).

With ``batch_invariant`` (``--batch-invariant``) a turn runs inside
``glm_kernels.batch_invariant()``: the KV-cache decode's log-probs are bitwise what the
trainer's full forward gives the same tokens with the same weights, whatever rows share the
turn.
"""
from collections import OrderedDict
from typing import Dict, List, Optional

import torch

from glm_kernels import selective_logprobs
from glm_kernels.integrations.transformers import record_routing

from .. import kernels
from ..env import vocab
from ..model import policy


def sample_turn(model, toks, live, steps: int, stops, *, gen=None, greedy: bool = False):
    """One assistant turn for a batch of rows: ``steps`` tokens sampled with one forward each
    (no early exit: rows stay aligned), rows in ``live`` until they sample a token in
    ``stops``; the others get ``PAD``. Returns the grown ``toks`` [n, T + steps], the turn's
    ids, fp32 log-probs (0 where not sampled) and mask (1 where sampled), each [n, steps].
    The first step prefills a KV cache with ``toks``, each next one decodes the token just
    sampled; log-probs are ``selective_logprobs`` of the fp32 logits."""
    stops = torch.tensor(sorted(stops), dtype=toks.dtype, device=toks.device)
    ids, lps, masks = [], [], []
    live = live.clone()
    cache, fed = policy.new_cache(model), 0
    for _ in range(steps):
        logits = policy.decode(model, toks[:, fed:], cache)[:, -1].float()
        fed = toks.shape[1]
        logp = torch.log_softmax(logits, -1)
        if greedy:
            nxt = kernels.topk(logp, 1).indices                      # ties -> smaller id
        else:
            # Sampled on the CPU with the caller's generator: one seeded stream per process,
            # whatever device the model is on (a [rows, vocab] copy; the vocab is tiny).
            nxt = torch.multinomial(logp.exp().cpu(), 1, generator=gen).to(logp.device)
        lp = selective_logprobs(logits, nxt.squeeze(-1))
        nxt = torch.where(live, nxt.squeeze(-1), torch.full_like(nxt.squeeze(-1), vocab.PAD))
        ids.append(nxt)
        lps.append(torch.where(live, lp, torch.zeros_like(lp)))
        masks.append(live.float())
        toks = torch.cat([toks, nxt[:, None]], 1)
        live = live & ~torch.isin(nxt, stops)
    return toks, torch.stack(ids, 1), torch.stack(lps, 1), torch.stack(masks, 1)


def _common_prefix(a: List[int], b: List[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class EngineCore:
    """Serves turn requests on ``model`` (in-process; the Ray engine actor wraps one).

    ``turn(req, gen)``: ``req`` has ``session``, ``rows`` (``[[row id, context ids], ...]``),
    ``steps``, ``stops``, optional ``greedy`` and ``end`` (the session's last turn: its
    cache entry is dropped). Returns ``rows`` (``{row id: {"ids", "logprobs", "mask",
    "routing"}}``; ``routing``: int64 [layers, fed, k] for the positions 0 .. fed-1 the
    turn fed through the model, cached prefix included),
    ``session_found`` (this engine held the session's prefix) and ``reused_tokens``.
    At most ``max_sessions`` sessions are kept (least recently used goes first: a session
    that ends without a last turn, e.g. every row failed, does not stay forever).
    ``batch_invariant``: every turn inside ``glm_kernels.batch_invariant()`` (see the module).
    """

    def __init__(self, model, *, max_sessions: int = 512, batch_invariant: bool = False):
        self.model = model
        self.batch_invariant = batch_invariant
        self.max_sessions = max_sessions
        self.sessions: "OrderedDict[str, Dict[int, tuple]]" = OrderedDict()
        self.turns = self.session_hits = self.reused_tokens = 0

    def turn(self, req: dict, gen: Optional[torch.Generator] = None, model=None) -> dict:
        """One turn; ``model`` (default: the engine's) is the weights to run it on (an
        engine that keeps an older version for the sessions that started on it)."""
        model = self.model if model is None else model
        sid = req["session"]
        found = sid in self.sessions
        cache = self.sessions.pop(sid, {})
        device = next(model.parameters()).device
        by_len: Dict[int, list] = {}
        for row, ctx in req["rows"]:
            by_len.setdefault(len(ctx), []).append((row, list(ctx)))
        out, reused = {}, 0
        for length, members in sorted(by_len.items()):
            toks = torch.tensor([ctx for _, ctx in members], device=device)
            live = torch.ones(len(members), dtype=torch.bool, device=device)
            with policy.batch_invariant(self.batch_invariant), record_routing(model) as rec:
                toks, ids, lps, mask = sample_turn(model, toks, live, req["steps"],
                                                   req["stops"], gen=gen,
                                                   greedy=req.get("greedy", False))
            fresh = rec.ids().cpu()                        # [layers, rows, fed, k]
            fed = toks[:, :-1].cpu().tolist()            # the ids each position was fed
            ids, lps, mask = ids.tolist(), lps.float().cpu().tolist(), mask.tolist()
            for j, (row, ctx) in enumerate(members):
                routing = fresh[:, j].clone()
                held = cache.get(row)
                if held is not None:                      # the prefix the engine kept
                    h = min(_common_prefix(held[0], fed[j]), held[1].shape[1])
                    routing[:, :h] = held[1][:, :h]
                    reused += h
                out[row] = {"ids": ids[j], "logprobs": lps[j], "mask": mask[j],
                            "routing": routing}
                cache[row] = (fed[j], routing)
        self.turns += 1
        self.session_hits += found
        self.reused_tokens += reused
        if not req.get("end", False):
            self.sessions[sid] = cache
            while len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
        return {"rows": out, "session_found": found, "reused_tokens": reused}

    def forget(self, session: str) -> None:
        """Drop a session's cached prefix (it starts over)."""
        self.sessions.pop(session, None)
