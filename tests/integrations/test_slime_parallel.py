"""The slime custom loss under tensor and context parallelism, against the TP = CP = 1 result.

Neither slime nor Megatron is installed: the modules the plug-in imports lazily are stood in
(``megatron.core.mpu``, ``slime.backends.megatron_utils.loss`` / ``.cp_utils``) with this file's
own model of slime's CP layout (THUDM/slime 624b824, ``backends/megatron_utils``):

* zigzag CP (``--context-parallel-size c``): ``data.get_batch`` pads every sample to 2c equal
  chunks and rank r holds chunks r and 2c-1-r, one sample after the other; ``get_responses``
  yields, per sample, the rank's rows that predict a response token (row p predicts token
  p + 1) in that order; ``rollout_log_probs`` / ``advantages`` / ``log_probs`` /
  ``teacher_log_probs`` are the same part of each response (``slice_log_prob_with_cp``), while
  ``loss_masks`` and the denominators stay whole and the reducer slices the masks itself.
* ``--allgather-cp``: the packed stream is cut into c contiguous pieces; ``get_responses``
  yields each sample's rows inside the rank's piece and ``_allgather_cp_redistribute`` moves
  them to the zigzag layout with a differentiable all-reduce over the CP group.

Tensor parallelism and ``--allgather-cp`` run in 4 gloo processes (one spawn for every case);
zigzag CP needs no communication and runs every simulated rank in this process.
"""
import sys
import traceback
import types

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  (dist.nn below; not imported with torch.distributed before torch 2.5)

import glm_kernels
from glm_kernels.integrations.slime import icepop as plug
from tests._compare import assert_close, assert_sum_close
from tests.integrations.test_slime import make_sum_of_sample_mean, slime_args, slime_batch
from tests._gloo import run_ranks
from tests.conftest import skip_without_kernels

BACKENDS = ("torch",) if torch.cuda.is_available() else ("torch", "interpret")
TOL = 1e-5
VOCAB = 52                                  # divisible by TP 2 and 4
# The third sample is prompt-heavy: at CP = 2 one rank holds none of its response.
PROMPTS, RESPONSES = (5, 3, 11, 2), (4, 6, 1, 9)
PER_TOKEN_KEYS = ("rollout_log_probs", "advantages", "log_probs", "teacher_log_probs")


# ---- this file's model of slime's CP layout -------------------------------------------------

def zigzag_positions(total, cp_rank, cp_size):
    """Sample positions (padded to 2 * cp_size equal chunks) held by a zigzag CP rank, in the
    rank's local order: chunk cp_rank, then chunk 2 * cp_size - 1 - cp_rank."""
    chunk = -(-total // (2 * cp_size))
    return [k * chunk + i for k in (cp_rank, 2 * cp_size - 1 - cp_rank) for i in range(chunk)]


def zigzag_response_part(total, resp, cp_rank, cp_size):
    """(local rows within the sample's block, response indices) a zigzag rank scores."""
    first = total - resp - 1                      # the row that predicts response token 0
    positions = zigzag_positions(total, cp_rank, cp_size)
    rows = [k for k, p in enumerate(positions) if first <= p < total - 1]
    return rows, [positions[k] - first for k in rows]


def contiguous_response_part(seq_start, total, resp, cp_rank, local_len):
    """(local rows, response indices) of one sample inside an allgather-CP rank's piece."""
    first = seq_start + total - resp - 1
    lo, hi = cp_rank * local_len, (cp_rank + 1) * local_len
    owned = [g for g in range(first, first + resp) if lo <= g < hi]
    return [g - lo for g in owned], [g - first for g in owned]


class ParallelState:
    """What the stand-in ``mpu`` answers; one per (simulated) rank."""
    def __init__(self, tp_group=None, cp_rank=0, cp_size=1, cp_group=None):
        self.tp_group, self.cp_rank, self.cp_size, self.cp_group = tp_group, cp_rank, cp_size, \
            cp_group
        self.get_responses_calls = []


def _index(x, idx):
    return x[torch.tensor(idx, dtype=torch.long, device=x.device)]


def stand_in_modules(state):
    """{module name: module} for ``megatron.core.mpu`` and slime's two CP modules."""
    def get_responses(logits, *, args, unconcat_tokens, total_lengths, response_lengths,
                      apply_temperature=True):
        state.get_responses_calls.append({"apply_temperature": apply_temperature})
        assert logits.dtype == torch.float32 and logits.dim() == 3 and logits.shape[0] == 1
        flat = logits[0]
        if apply_temperature and args.rollout_temperature != 1.0:
            flat = flat / args.rollout_temperature
        base = seq_start = 0
        for tokens, total, resp in zip(unconcat_tokens, total_lengths, response_lengths):
            if state.cp_size == 1:
                rows, idx = list(range(seq_start + total - resp - 1, seq_start + total - 1)), \
                    list(range(resp))
            elif args.allgather_cp:
                rows, idx = contiguous_response_part(seq_start, total, resp, state.cp_rank,
                                                     flat.shape[0])
            else:
                rows, idx = zigzag_response_part(total, resp, state.cp_rank, state.cp_size)
                rows = [base + k for k in rows]
                base += len(zigzag_positions(total, state.cp_rank, state.cp_size))
            yield _index(flat, rows), _index(tokens, [total - resp + i for i in idx])
            seq_start += total

    def slice_log_prob_with_cp(values, total, resp):
        assert len(values) == resp
        if state.cp_size == 1:
            return values
        return _index(values, zigzag_response_part(total, resp, state.cp_rank, state.cp_size)[1])

    def allgather_cp_redistribute(res, *, logits_local_len, total_lengths, response_lengths):
        for key, values in res.items():
            full, seq_start = [], 0
            for value, total, resp in zip(values, total_lengths, response_lengths):
                idx = contiguous_response_part(seq_start, total, resp, state.cp_rank,
                                               logits_local_len)[1]
                full.append(value.new_zeros(resp).index_add(
                    0, torch.tensor(idx, dtype=torch.long, device=value.device), value))
                seq_start += total
            summed = dist.nn.all_reduce(torch.cat(full), group=state.cp_group)
            res[key] = [slice_log_prob_with_cp(v, t, r) for v, t, r in zip(
                summed.split(list(response_lengths)), total_lengths, response_lengths)]

    def package(name, **attrs):
        mod = types.ModuleType(name)
        mod.__path__ = []
        mod.__dict__.update(attrs)
        return mod

    mpu = package("megatron.core.mpu",
                  get_tensor_model_parallel_group=lambda: state.tp_group,
                  get_context_parallel_rank=lambda: state.cp_rank,
                  get_context_parallel_world_size=lambda: state.cp_size,
                  get_context_parallel_group=lambda: state.cp_group)
    utils = "slime.backends.megatron_utils"
    return {"megatron": package("megatron"), "megatron.core": package("megatron.core", mpu=mpu),
            "megatron.core.mpu": mpu, "slime": package("slime"),
            "slime.backends": package("slime.backends"), utils: package(utils),
            f"{utils}.loss": package(f"{utils}.loss", get_responses=get_responses,
                                     _allgather_cp_redistribute=allgather_cp_redistribute),
            f"{utils}.cp_utils": package(f"{utils}.cp_utils",
                                         slice_log_prob_with_cp=slice_log_prob_with_cp)}


def cp_sum_of_sample_mean(batch, state, per_token):
    """slime's CP reducer (cp_utils.get_sum_of_sample_mean): each sample's rank part of x times
    the same part of its whole loss mask, over the whole sample's denominator (1 per token with
    --calculate-per-token-loss)."""
    parts = [zigzag_response_part(t, r, state.cp_rank, state.cp_size)[1]
             for t, r in zip(batch["total_lengths"], batch["response_lengths"])]
    masks = [_index(m, idx) for m, idx in zip(batch["loss_masks"], parts)]
    denominators = [torch.ones(()) for _ in parts] if per_token else batch["rollout_mask_sums"]
    return make_sum_of_sample_mean([len(idx) for idx in parts], masks, denominators)


def rank_batch(batch, state):
    """The micro-batch slime hands CP rank ``state.cp_rank``: per-token inputs sliced to its
    response part, token lists, lengths, loss masks and denominators whole."""
    out = dict(batch)
    for key in PER_TOKEN_KEYS:
        if batch.get(key):
            out[key] = [_index(x, zigzag_response_part(t, r, state.cp_rank, state.cp_size)[1])
                        for x, t, r in zip(batch[key], batch["total_lengths"],
                                           batch["response_lengths"])]
    return out


def zigzag_rows(batch, state, stream_multiple=8):
    """Global row of the packed CP = 1 stream behind each local row of a zigzag rank (-1: the
    rank's padding)."""
    rows, start = [], 0
    for total in batch["total_lengths"]:
        rows += [start + p if p < total else -1
                 for p in zigzag_positions(total, state.cp_rank, state.cp_size)]
        start += total
    return rows + [-1] * ((-len(rows)) % stream_multiple)


def local_logits(full, rows, seed):
    """[1, len(rows), V] leaf: the full logits' rows, random values where a row is padding."""
    rows = torch.tensor(rows, dtype=torch.long)
    noise = torch.randn(len(rows), full.shape[-1], generator=torch.Generator().manual_seed(seed))
    picked = torch.where((rows >= 0)[:, None], full[0, rows.clamp(min=0)], noise * 5.0)
    return picked.unsqueeze(0).contiguous().requires_grad_(True)


def single_rank_reference(batch, logits, args, per_token):
    """icepop_loss_function at TP = CP = 1 on the full logits: (loss, metrics, grad, lp)."""
    leaf = logits.detach().clone().requires_grad_(True)
    state = ParallelState()
    reduce = cp_sum_of_sample_mean(batch, state, per_token)
    loss, metrics = plug.icepop_loss_function(args, batch, leaf, reduce)
    loss.backward()
    lp, _ = plug._response_logprobs(args, batch, logits.detach())
    return loss.detach(), metrics, leaf.grad, lp


def make_case(seed, *, with_old, temperature, per_token=False, entropy_coef=0.0,
              prompts=PROMPTS, responses=RESPONSES):
    batch, logits, true_lp = slime_batch(seed, vocab=VOCAB, prompts=prompts,
                                         responses=responses, with_old=with_old,
                                         temperature=temperature, drift=0.6)
    g = torch.Generator().manual_seed(seed + 1)
    batch["teacher_log_probs"] = [lp - 0.3 + 0.1 * torch.randn(lp.shape, generator=g)
                                  for lp in true_lp]
    if with_old:   # an old policy far enough from the current one that the PPO clip bites
        batch["log_probs"] = [lp + 0.3 * torch.randn(lp.shape, generator=g) for lp in true_lp]
    # At least one counted token is popped in either mode: rho = k = e^1.5 > 2.
    batch["rollout_log_probs"][-1][0] = true_lp[-1][0] - 1.5
    if with_old:
        batch["log_probs"][-1][0] = true_lp[-1][0]
    batch["loss_masks"][-1][0] = 1
    batch["rollout_mask_sums"][-1] = batch["loss_masks"][-1].sum().float()
    args = slime_args(rollout_temperature=temperature, calculate_per_token_loss=per_token,
                      entropy_coef=entropy_coef)
    return batch, logits.detach(), args


# Means of signed log-prob differences cancel far below their terms: their rounding (the CP
# ranks' log-probs differ from one rank's in the last bits) is judged against the same mean of
# |train - rollout|, slime's train_rollout_logprob_abs_diff.
SIGNED_GAPS = ("log_ppl_diff", "kl")


def assert_metrics_match(got, want, name):
    assert sorted(got) == sorted(want), f"{name}: metric keys {sorted(got)} vs {sorted(want)}"
    for key in want:
        if key in SIGNED_GAPS:
            magnitude = want["train_rollout_logprob_abs_diff"].reshape(1).double()
            assert_sum_close(got[key].reshape(1).double(), want[key].reshape(1).double(),
                             magnitude, tol=TOL, name=f"{name} {key}")
            continue
        assert_close(got[key].reshape(1).double(), want[key].reshape(1).double(), tol=TOL,
                     name=f"{name} {key}")


# ---- zigzag CP, every rank simulated in this process -----------------------------------------

ZIGZAG_CASES = {
    "coupled_t1_cp2": dict(with_old=False, temperature=1.0, cp=2),
    "decoupled_t07_cp2": dict(with_old=True, temperature=0.7, cp=2, entropy_coef=0.01),
    "coupled_t07_cp3_per_token": dict(with_old=False, temperature=0.7, cp=3, per_token=True),
    "decoupled_t1_cp3_per_token": dict(with_old=True, temperature=1.0, cp=3, per_token=True,
                                       entropy_coef=0.01),
}


@pytest.mark.parametrize("name", sorted(ZIGZAG_CASES))
def test_zigzag_cp_ranks_sum_to_the_single_rank_loss(name, any_backend, monkeypatch):
    case = dict(ZIGZAG_CASES[name])
    cp = case.pop("cp")
    per_token = case.get("per_token", False)
    batch, logits, args = make_case(11, **case)
    want_loss, want_metrics, want_grad, want_lp = single_rank_reference(batch, logits, args,
                                                                        per_token)
    assert want_grad.abs().sum() > 0 and float(want_metrics["pop_frac"]) > 0
    assert float(want_metrics["clip_frac"]) > 0      # both the gate and the clip are exercised

    cp_args = slime_args(**{**vars(args), "context_parallel_size": cp})
    total_loss, total_metrics = 0.0, {}
    assembled = torch.zeros_like(want_grad[0])
    owned = torch.zeros(want_grad.shape[1], dtype=torch.int)
    for rank in range(cp):
        state = ParallelState(cp_rank=rank, cp_size=cp)
        for module_name, module in stand_in_modules(state).items():
            monkeypatch.setitem(sys.modules, module_name, module)
        local = rank_batch(batch, state)
        rows = zigzag_rows(batch, state)
        leaf = local_logits(logits, rows, seed=100 + rank)
        loss, metrics = plug.icepop_loss_function(cp_args, local, leaf,
                                                  cp_sum_of_sample_mean(batch, state, per_token))
        assert all(call["apply_temperature"] is False for call in state.get_responses_calls)
        loss.backward()
        # This rank's log-probs are its zigzag part of the CP = 1 ones, sample by sample.
        lp, _ = plug._response_logprobs(cp_args, local, leaf.detach())
        for i, (t, r) in enumerate(zip(batch["total_lengths"], batch["response_lengths"])):
            idx = zigzag_response_part(t, r, rank, cp)[1]
            assert_close(lp[i], _index(want_lp[i], idx), tol=TOL, name=f"rank {rank} sample {i}")
        real = torch.tensor(rows) >= 0
        assert float(leaf.grad[0, ~real].abs().sum()) == 0.0, "padding rows got a gradient"
        global_rows = torch.tensor(rows)[real]
        assembled.index_add_(0, global_rows, leaf.grad[0, real])
        owned.index_add_(0, global_rows, torch.ones_like(global_rows, dtype=torch.int))
        total_loss = total_loss + loss.detach()
        for key, value in metrics.items():
            total_metrics[key] = total_metrics.get(key, 0.0) + value
    assert_close(total_loss.reshape(1).double(), want_loss.reshape(1).double(), tol=TOL,
                 name="loss summed over CP ranks")
    assert_metrics_match(total_metrics, want_metrics, "metrics summed over CP ranks")
    assert bool((owned[:sum(batch["total_lengths"])] == 1).all()), "a row is not on one rank"
    assert_close(assembled, want_grad[0], tol=TOL, name="logits gradient from the CP ranks")


def test_zigzag_cp_rank_without_response_tokens(monkeypatch):
    """A rank whose chunks are all prompt: zero loss, still connected to its logits."""
    batch, logits, args = make_case(5, with_old=True, temperature=1.0, prompts=(11,),
                                    responses=(1,))
    state = ParallelState(cp_rank=1, cp_size=2)
    for module_name, module in stand_in_modules(state).items():
        monkeypatch.setitem(sys.modules, module_name, module)
    local = rank_batch(batch, state)
    assert local["rollout_log_probs"][0].numel() == 0
    leaf = local_logits(logits, zigzag_rows(batch, state), seed=1)
    loss, metrics = plug.icepop_loss_function(slime_args(context_parallel_size=2), local, leaf,
                                              cp_sum_of_sample_mean(batch, state, False))
    loss.backward()
    assert float(loss.detach()) == 0.0 and float(leaf.grad.abs().sum()) == 0.0
    assert all(float(v) == 0.0 for v in metrics.values())


def test_tis_hook_under_cp_takes_whole_loss_masks():
    """slime passes the whole [R_i] loss_masks with this rank's pg_loss / log-probs."""
    old = [torch.zeros(2), torch.zeros(3)]
    rollout = [torch.zeros(2), torch.full((3,), 1.0)]
    masks = [torch.ones(4, dtype=torch.int), torch.ones(6, dtype=torch.int)]
    out, out_masks, _ = plug.icepop_tis_function(
        slime_args(context_parallel_size=2), pg_loss=torch.ones(5), train_log_probs=old,
        rollout_log_probs=rollout, loss_masks=masks, total_lengths=[9, 9], response_lengths=[4, 6])
    assert out.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0] and out_masks is masks
    with pytest.raises(ValueError, match="lengths disagree"):
        plug.icepop_tis_function(slime_args(), pg_loss=torch.ones(5), train_log_probs=old,
                                 rollout_log_probs=rollout, loss_masks=masks)


# ---- TP and allgather-CP over gloo -------------------------------------------------------------

PROCESS_SPECS = [(layout, mode, backend)
                 for layout in ("tp4", "tp2", "allgather_cp4", "allgather_cp2", "tp2_allgather_cp2")
                 for mode in ("coupled_t1", "decoupled_t07")
                 for backend in BACKENDS]
PROCESS_CASES = [f"{layout}-{mode}[{backend}]" for layout, mode, backend in PROCESS_SPECS]


def _gather_cat(x, group, dim):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _process_case(layout, mode, groups, rank):
    with_old = mode.startswith("decoupled")
    temperature = 0.7 if mode.endswith("t07") else 1.0
    batch, logits, args = make_case(23, with_old=with_old, temperature=temperature,
                                    entropy_coef=0.01 if with_old else 0.0)
    want_loss, want_metrics, want_grad, _ = single_rank_reference(batch, logits, args, False)

    tp_group, tp_rank, tp, cp_group, cp_rank, cp = groups[layout]
    state = ParallelState(tp_group=tp_group, cp_rank=cp_rank, cp_size=cp, cp_group=cp_group)
    for module_name, module in stand_in_modules(state).items():
        sys.modules[module_name] = module          # this process only runs these cases
    overrides = {"tensor_model_parallel_size": tp}
    local, full_rows = batch, slice(None)
    if cp > 1:
        overrides.update(context_parallel_size=cp, allgather_cp=True)
        local = rank_batch(batch, state)           # slime's inputs are zigzag under both CPs
        piece = logits.shape[1] // cp
        assert piece * cp == logits.shape[1]
        full_rows = slice(cp_rank * piece, (cp_rank + 1) * piece)
    vocab = logits.shape[-1] // tp
    leaf = logits[:, full_rows, tp_rank * vocab:(tp_rank + 1) * vocab].contiguous() \
        .requires_grad_(True)
    loss, metrics = plug.icepop_loss_function(slime_args(**{**vars(args), **overrides}), local,
                                              leaf, cp_sum_of_sample_mean(batch, state, False))
    loss.backward()
    values = torch.stack([loss.detach()] + [metrics[k] for k in sorted(metrics)])
    if cp > 1:
        dist.all_reduce(values, group=cp_group)      # slime sums the CP ranks' contributions
    got_metrics = dict(zip(sorted(metrics), values[1:]))
    assert_close(values[:1].double(), want_loss.reshape(1).double(), tol=TOL, name="loss")
    assert_metrics_match(got_metrics, want_metrics, "metrics")
    grad = leaf.grad[0] if tp == 1 else _gather_cat(leaf.grad[0], tp_group, dim=-1)
    assert_close(grad, want_grad[0, full_rows], tol=TOL, name="logits gradient")


def _process_body(rank, world, out_dir):
    # Every rank creates every group in the same order (new_group is collective).
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    strided = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    world_group = dist.group.WORLD
    groups = {   # layout: (tp group, tp rank, tp size, cp group, cp rank, cp size)
        "tp4": (world_group, rank, 4, None, 0, 1),
        "tp2": (pairs[rank // 2], rank % 2, 2, None, 0, 1),
        "allgather_cp4": (None, 0, 1, world_group, rank, 4),
        "allgather_cp2": (None, 0, 1, pairs[rank // 2], rank % 2, 2),
        "tp2_allgather_cp2": (pairs[rank // 2], rank % 2, 2, strided[rank % 2], rank // 2, 2),
    }
    verdicts = {}
    for name, (layout, mode, backend) in zip(PROCESS_CASES, PROCESS_SPECS):
        try:
            with glm_kernels.force_backend(backend):
                _process_case(layout, mode, groups, rank)
            verdicts[name] = "ok"
        except Exception:   # recorded per case; a hung collective is caught by the timeout
            verdicts[name] = traceback.format_exc(limit=6)
    return verdicts


@pytest.fixture(scope="module")
def process_verdicts(tmp_path_factory):
    world = 4
    out_dir = tmp_path_factory.mktemp("slime_parallel")
    return run_ranks(_process_body, world, out_dir, "slime TP / allgather-CP")


@pytest.mark.parametrize("case", PROCESS_CASES)
def test_tp_and_allgather_cp_match_single_rank(process_verdicts, case):
    if case.endswith("[interpret]"):
        skip_without_kernels()      # the ranks recorded why they could not run it
    failures = {rank: v[case] for rank, v in enumerate(process_verdicts) if v[case] != "ok"}
    assert not failures, "\n".join(f"rank {r}:\n{msg}" for r, msg in failures.items())
