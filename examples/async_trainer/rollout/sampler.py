"""The engine's side of generation, token in -> token out: one assistant turn for a batch of
token contexts (:func:`sample_turn`), and :class:`EngineCore`, which serves turn requests and
keeps every live session's prefix between its turns.

An engine knows nothing of tasks: a request is a session id, token contexts, a number of
steps and stop tokens. The environment (tool, sandbox, trajectory manager) runs between
turns on the caller's side (``rollout/sessions.py``), as in slime's rollout, where every turn is one
request through the router.

What the prefix cache keeps is what an inference engine's KV cache holds for a session and
what routing replay needs from it: the ids the engine has fed through the model and the
experts every MoE layer routed each of those positions to. A new turn whose context starts
with a cached prefix takes the routing of that prefix from the cache (an engine with a KV
cache never recomputes it) and records only the rest. TinyLM has no KV tensors, so the
forward itself still runs over the whole context: the cache here saves no compute, it makes
the routing what a real engine's would be and measures session affinity honestly (a turn
finds its session's prefix only on the engine that served the session before).

With ``batch_invariant`` (``--batch-invariant``) a turn runs the model's batch-invariant path
(``model/invariant.py``): it prefills a KV cache with the context and decodes one position per
step, and the recorded log-probs are bitwise what the trainer's full forward gives the same
tokens with the same weights, whatever rows share the turn.
"""
from collections import OrderedDict
from typing import Dict, List, Optional

import torch

from glm_kernels import batch_invariant_enabled

from .. import kernels
from ..env import vocab
from ..model import invariant
from ..model.tinylm import RoutingRecorder


def sample_turn(model, toks, live, steps: int, stops, recorder, *, gen=None,
                greedy: bool = False):
    """One assistant turn for a batch of rows: ``steps`` tokens sampled with one forward each
    (no early exit: rows stay aligned), rows in ``live`` until they sample a token in
    ``stops``; the others get ``PAD``. Returns the grown ``toks`` [n, T + steps], the turn's
    ids, fp32 log-probs (0 where not sampled) and mask (1 where sampled), each [n, steps].

    Under ``glm_kernels.batch_invariant()`` the turn prefills a KV cache and decodes one
    position per step, and the log-probs are ``invariant.token_logprobs``."""
    stops = torch.tensor(sorted(stops), dtype=toks.dtype, device=toks.device)
    ids, lps, masks = [], [], []
    live = live.clone()
    cache = invariant.KVCache() if batch_invariant_enabled() else None
    for _ in range(steps):
        if cache is None:
            logits = model(toks)[:, -1].float()
            recorder.step()
        else:
            start = cache.length
            logits = model(toks[:, start:], cache=cache)[:, -1]
            recorder.step(start)
        logp = torch.log_softmax(logits, -1)
        if greedy:
            nxt = kernels.topk(logp, 1).indices                      # ties -> smaller id
        else:
            # Sampled on the CPU with the caller's generator: one seeded stream per process,
            # whatever device the model is on (a [rows, vocab] copy; the vocab is tiny).
            nxt = torch.multinomial(logp.exp().cpu(), 1, generator=gen).to(logp.device)
        lp = logp.gather(-1, nxt).squeeze(-1) if cache is None else \
            invariant.token_logprobs(logits, nxt.squeeze(-1))
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
    turn fed through the model, cached prefix included, or None without MoE layers),
    ``session_found`` (this engine held the session's prefix) and ``reused_tokens``.
    At most ``max_sessions`` sessions are kept (least recently used goes first: a session
    that ends without a last turn, e.g. every row failed, does not stay forever).
    ``batch_invariant``: every turn on the model's batch-invariant path (see the module).
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
            recorder = RoutingRecorder(model)
            toks = torch.tensor([ctx for _, ctx in members], device=device)
            live = torch.ones(len(members), dtype=torch.bool, device=device)
            with invariant.mode(self.batch_invariant):
                toks, ids, lps, mask = sample_turn(model, toks, live, req["steps"],
                                                   req["stops"], recorder, gen=gen,
                                                   greedy=req.get("greedy", False))
            fresh = recorder.recorded()                   # [layers, rows, fed, k] or None
            fed = toks[:, :-1].cpu().tolist()            # the ids each position was fed
            ids, lps, mask = ids.tolist(), lps.float().cpu().tolist(), mask.tolist()
            for j, (row, ctx) in enumerate(members):
                routing = None
                if fresh is not None:
                    routing = fresh[:, j].clone()
                    held = cache.get(row)
                    if held is not None:                  # the prefix the engine kept
                        h = min(_common_prefix(held[0], fed[j]), held[1].shape[1])
                        routing[:, :h] = held[1][:, :h]
                        reused += h
                out[row] = {"ids": ids[j], "logprobs": lps[j], "mask": mask[j],
                            "routing": routing}
                cache[row] = (fed[j], routing if routing is not None else torch.empty(0, 0))
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
