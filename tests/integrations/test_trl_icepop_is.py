"""IcePopGRPOTrainer, every IcePop mode x TRL vLLM importance-sampling mode, against stock TRL
1.16's ``GRPOTrainer._compute_loss`` (TRL's own code, imported) on batches TRL builds:
loss, the gradient of every model parameter and, off the single fused pass, TRL's metrics.

What a combination means (docs/trl.md, "IcePop and TRL's IS correction"): TRL's IS ratio,
computed exactly as TRL computes it, on (ratio base, rollout) -- decoupled: base = TRL's
pi_old; coupled: base = the rollout log-probs, so the ratio is the mode applied to 1 -- times
the IcePop gate g_t = 1[lo <= q_t <= hi] (decoupled q = exp(old - rollout), coupled
q = exp(logp - rollout), no gradient; a NaN rollout log-prob pops its token), a 0/1 factor.

Why the reference is TRL's loss with ``importance_sampling_ratio := TRL's ratio x g``: for
every loss_type but VESPO, TRL multiplies each token's term by that detached ratio
(``per_token_loss * inputs["importance_sampling_ratio"]``) and nothing else reads it, so
multiplying it by a detached 0/1 factor is the same as multiplying the terms: a popped token
contributes 0 and stays in every denominator, as TRL's own token_mask treats the tokens it
masks. For VESPO, TRL's ratio enters phi (the sequence log-weight adds its clamped log), and
TRL's token_mask sets a masked token's ratio to 0: the same substitution is how TRL masks a
token for VESPO. Removing the popped tokens from ``completion_mask`` instead is NOT the same
loss: it changes grpo / bnpo / sapo denominators, the sequence-level ratio's mean, the
sequence IS modes' sums, the entropy quantile and the KL, so it is not used.

With the gate open (bounds [0, inf]) nothing is popped and the loss is stock TRL's in each
mode: decoupled on TRL's own batch (TRL's pi_old and IS ratio), coupled on a batch whose
rollout log-probs equal TRL's pi_old (so TRL's pi_old is the rollout policy, as coupled
mode defines it). A rollout log-prob that is NaN pops its token by design (docs/design.md 3.1; TRL
gives it ratio 1), so the open-gate batch carries no NaN; the gated ones do.
"""
import math

import pytest
import torch

import glm_kernels
from glm_kernels.integrations.trl import trainer as gt

pytest.importorskip("trl", reason=f"TRL missing: {gt.INSTALL_HINT}")
from tests.integrations.test_trl import (CraftedRollout, logprobs_of,  # noqa: E402
                                         make_model, make_tokenizer)
from tests.conftest import KERNEL_BACKEND, skip_without_kernels  # noqa: E402
from tests.integrations.test_trl_losses import (IS_MODES, OPTION_SETS, Setup,  # noqa: E402
                                                _build, check_against_trl, configure)

OPEN = (0.0, math.inf)
GATED = (0.3, 1.6)            # lower than TRL's C_min = 0.5 here, upper below its C_max = 2
# (loss_type, level, option set): cases the single fused pass takes where the gate allows it
# (dapo / bnpo at token level, no option), and cases of the general path
SINGLE = (("dapo", "token", "plain"), ("bnpo", "token", "plain"))
GENERAL = (("grpo", "sequence", "all"), ("cispo", "token", "kl"),
           ("sapo", "sequence", "entropy"), ("luspo", "sequence", "opsm"),
           ("dr_grpo", "token", "delta_below"), ("grpo", "token", "all"))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return Setup(tmp_path_factory.mktemp("trl_icepop_is"))


@pytest.fixture(scope="module")
def icepop(setup, tmp_path_factory):
    trainers = {}
    for mode in ("coupled", "decoupled"):
        trainer = _build(gt.IcePopGRPOTrainer, tmp_path_factory.mktemp(mode), make_tokenizer(),
                         CraftedRollout(make_tokenizer()), make_model(), icepop_mode=mode)
        trainer.model.load_state_dict(setup.ours.model.state_dict())
        trainers[mode] = trainer
    return trainers


def cases_for(is_mode, test):
    """A single-pass case, two general ones and VESPO wherever TRL allows it (token modes and
    none), rotating with the IS mode and the test, so each test covers every case."""
    index = IS_MODES.index(is_mode) + test
    cases = [SINGLE[index % 2], GENERAL[index % 6], GENERAL[(index + 3) % 6]]
    if is_mode is None or is_mode.startswith("token"):
        cases.append(("vespo", "token", "all" if index % 2 else "plain"))
    return cases


def set_gate(trainer, mode, is_mode, gate, loss_type, level, options):
    configure(trainer, loss_type, level, is_mode, options)
    trainer.icepop_config.icepop_gate_low, trainer.icepop_config.icepop_gate_high = gate
    trainer.icepop_is_correction = is_mode is not None      # the config's switch
    trainer.vllm_importance_sampling_correction = False     # as its __init__ sets it


def gate_of(numerator, rollout, mask, gate):
    """The IcePop gate, in float64: lo <= exp(numerator - rollout) <= hi on the mask (NaN
    fails), open off it; and the distance of the masked ratios to the bounds."""
    q = torch.exp(numerator.double() - rollout.double())
    keep = ((q >= gate[0]) & (q <= gate[1])) | ~mask
    finite = q[mask & torch.isfinite(q)]
    margin = min((finite - b).abs().min().item() for b in gate if math.isfinite(b))
    return keep, margin


def compare(setup, trainer, stock_inputs, our_inputs, name, loss_type, level, options,
            is_mode, backend):
    configure(setup.stock, loss_type, level, "token_mask" if is_mode is None else is_mode,
              options)
    if "importance_sampling_ratio" not in stock_inputs:      # no IS, gate open: TRL's plain
        setup.stock.vllm_importance_sampling_correction = False
    single = trainer._single_pass()
    with glm_kernels.force_backend(backend):
        pop_frac = check_against_trl(setup.stock, trainer, stock_inputs, our_inputs, name,
                                     metrics=not single)
    return single, pop_frac


def check_gate_open(setup, icepop, mode, is_mode, cases, backend):
    """Gate [0, inf]: stock TRL's _compute_loss in this IS mode (None: the correction off).
    Returns the set of paths taken (True: the single fused pass)."""
    trainer = icepop[mode]
    if mode == "decoupled":
        inputs = dict(setup.inputs[is_mode])
        sampled = inputs["sampling_per_token_logps"].clone()
        nan = torch.isnan(sampled)
        assert nan.any()       # TRL's ratio there is exp(0) = 1: rollout := pi_old is the same
        sampled[nan] = inputs["old_per_token_logps"][nan]
        inputs["sampling_per_token_logps"] = sampled
    else:
        inputs = setup.on_policy[is_mode]
        mask = inputs["completion_mask"].bool()
        assert torch.equal(inputs["sampling_per_token_logps"][mask],
                           inputs["old_per_token_logps"][mask])
    paths = set()
    for loss_type, level, option_set in cases:
        set_gate(trainer, mode, is_mode, OPEN, loss_type, level, OPTION_SETS[option_set])
        single, pop_frac = compare(setup, trainer, inputs, inputs,
                                   f"{mode}/{is_mode}/{loss_type}/{level}/{option_set}",
                                   loss_type, level, OPTION_SETS[option_set], is_mode, backend)
        paths.add(single)
        assert single or pop_frac == [0.0]
    return paths


@pytest.mark.parametrize("is_mode", IS_MODES)
@pytest.mark.parametrize("mode", ["decoupled", "coupled"])
def test_gate_open_is_stock_trl(setup, icepop, mode, is_mode):
    paths = check_gate_open(setup, icepop, mode, is_mode,
                            cases_for(is_mode, 0 if mode == "decoupled" else 1), "torch")
    # the fused pass takes the open gate where TRL's mode is a gate: decoupled token_mask
    assert paths == ({False, True} if (mode, is_mode) == ("decoupled", "token_mask")
                     else {False})


def check_decoupled_gate(setup, icepop, is_mode, cases, backend):
    """Gate [0.3, 1.6] on k = exp(old - rollout): stock TRL with its IS ratio x the gate."""
    trainer = icepop["decoupled"]
    inputs = setup.inputs[is_mode]
    mask = inputs["completion_mask"].bool()
    keep, margin = gate_of(inputs["old_per_token_logps"], inputs["sampling_per_token_logps"],
                           mask, GATED)
    assert margin > 1e-6                      # no ratio on a bound: float32 and 64 agree
    ratio = inputs.get("importance_sampling_ratio", torch.ones(mask.shape))
    trl_inputs = dict(inputs, importance_sampling_ratio=torch.where(
        keep, ratio, torch.zeros(())).float())
    # the gate pops tokens TRL's own ratio keeps (the check can fail), NaN among them
    assert (~keep & mask & (ratio != 0)).any() and (keep & mask).any()
    assert not keep[torch.isnan(inputs["sampling_per_token_logps"])].any()
    paths = set()
    for loss_type, level, option_set in cases:
        set_gate(trainer, "decoupled", is_mode, GATED, loss_type, level,
                 OPTION_SETS[option_set])
        single, pop_frac = compare(setup, trainer, trl_inputs, inputs,
                                   f"decoupled/{is_mode}/{loss_type}/{level}/{option_set}",
                                   loss_type, level, OPTION_SETS[option_set], is_mode, backend)
        paths.add(single)
        if not single:
            popped = (~keep & mask).sum() / mask.sum()
            assert pop_frac == [pytest.approx(popped.item(), rel=1e-6)]
    return paths


@pytest.mark.parametrize("is_mode", IS_MODES)
def test_decoupled_gate_is_a_factor_on_trls_ratio(setup, icepop, is_mode):
    paths = check_decoupled_gate(setup, icepop, is_mode, cases_for(is_mode, 2), "torch")
    assert paths == ({False, True} if is_mode == "token_mask" else {False})


def check_coupled_gate(setup, icepop, is_mode, cases, backend):
    """Coupled, gate [0.3, 1.6] on rho = exp(logp - rollout) (logp: TRL's own scoring of the
    current policy): stock TRL with pi_old := the rollout log-probs and its IS ratio := TRL's
    ratio on that batch (the mode applied to 1, from ``on_policy``) x the gate."""
    trainer = icepop["coupled"]
    inputs = dict(setup.inputs[is_mode])
    mask = inputs["completion_mask"].bool()
    current = logprobs_of(setup.stock, inputs)
    rollout = inputs["sampling_per_token_logps"].clone()
    for _ in range(3):     # keep every ratio away from the bounds (the two compute logp apart)
        rho = torch.exp(current - rollout)
        near = torch.zeros_like(mask)
        for bound in GATED[:2]:
            near |= (rho - bound).abs() < 1e-3 * bound
        rollout = torch.where(near, rollout + 0.01, rollout)
    inputs["sampling_per_token_logps"] = rollout
    keep, margin = gate_of(current, rollout, mask, GATED)
    assert margin > 1e-4
    assert (~keep & mask).any() and (keep & mask).any()
    one = setup.on_policy[is_mode].get("importance_sampling_ratio", torch.ones(mask.shape[0], 1))
    # a rollout log-prob the engine could not give (NaN, -inf) is popped, and its log-ratio
    # is 0 where the row enters (sequence mean, KL bias correction): pi_old := logp there
    finite = torch.isfinite(rollout)
    assert not finite[mask].all()
    trl_inputs = dict(inputs, old_per_token_logps=torch.where(finite, rollout, current),
                      importance_sampling_ratio=torch.where(keep, one, torch.zeros(())).float())
    paths = set()
    for loss_type, level, option_set in cases:
        set_gate(trainer, "coupled", is_mode, GATED, loss_type, level, OPTION_SETS[option_set])
        single, pop_frac = compare(setup, trainer, trl_inputs, inputs,
                                   f"coupled/{is_mode}/{loss_type}/{level}/{option_set}",
                                   loss_type, level, OPTION_SETS[option_set], is_mode, backend)
        paths.add(single)
        if not single:
            assert pop_frac[0] > 0
    return paths


@pytest.mark.parametrize("is_mode", IS_MODES)
def test_coupled_gate_is_a_factor_on_trls_ratio_of_one(setup, icepop, is_mode):
    paths = check_coupled_gate(setup, icepop, is_mode, cases_for(is_mode, 3), "torch")
    assert paths == {False, True}


def test_on_the_kernels(setup, icepop):
    """The same checks with the Triton kernels (interpreter on CPU): fused_linear_icepop_loss
    (the single pass) and fused_linear_logprobs + policy_loss (the general path), a cell of
    each test: both modes, a token and a sequence IS mode each, VESPO gated."""
    skip_without_kernels()
    single, general = SINGLE[0], GENERAL[0]
    paths = check_decoupled_gate(setup, icepop, "token_mask",
                                 [single, ("vespo", "token", "all")], KERNEL_BACKEND)
    paths |= check_decoupled_gate(setup, icepop, "sequence_truncate", [general],
                                  KERNEL_BACKEND)
    paths |= check_coupled_gate(setup, icepop, "token_truncate",
                                [SINGLE[1], GENERAL[2]], KERNEL_BACKEND)
    paths |= check_gate_open(setup, icepop, "coupled", "sequence_mask", [GENERAL[3]],
                             KERNEL_BACKEND)
    assert paths == {False, True}
