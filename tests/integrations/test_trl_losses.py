"""Every loss option of TRL 1.16's GRPOConfig: ``FusedGRPOTrainer._compute_loss`` (and the
IcePop trainer's general path) against stock ``GRPOTrainer._compute_loss`` -- TRL's own code,
imported -- on the same batch: loss, gradients of every model parameter, logged metrics.

The batch is TRL's own: ``_generate_and_score_completions`` on crafted completions (ragged,
a truncated row whose mask is empty with ``mask_truncated_completions``, both advantage
signs) and crafted rollout log-probs (one NaN, one -inf), once per vLLM IS mode, so pi_old,
the advantages and the IS ratios are TRL's computation. Then both policies take the same
step (log-ratios up to ~1: PPO clips, CISPO clips, sequence ratios move) and the options are
set on both trainers the way their ``__init__`` sets them from ``GRPOConfig``. The reference
log-probs are pi_old (the reference model before the step), so the KL is non-zero.

Options covered, torch backend: every loss_type x importance_sampling_level, each with every
option set (none; beta > 0 with and without use_bias_correction_kl; delta below and above
1 + epsilon_high; top_entropy_quantile < 1 with an entropy bonus; off_policy_mask_threshold;
all of them) and every vLLM IS mode (none, token_mask, token_truncate, sequence_mask,
sequence_truncate; vespo with the token modes only, as TRL) -- see ``combinations``. On the
kernels (interpreter on CPU): a covering set, every loss_type x level x beta pairwise with
the IS modes and option sets cycling -- see ``kernel_rows``. Also: bf16
autocast, TRL's adaptive entropy controller, a MoE model's load-balancing loss, TRL's
refusals (IcePop x every IS mode against TRL: test_trl_icepop_is.py), the docs page's example
(a real run with beta > 0) and a real IcePop run on the general path.
"""
import copy
import math
import os
import re

import pytest
import torch

import glm_kernels
from glm_kernels.integrations.trl import trainer as gt
from glm_kernels.integrations.trl.loss import LOSS_TYPES
from tests._compare import assert_close, assert_sum_close
from tests.conftest import KERNEL_BACKEND, skip_without_kernels

trl = pytest.importorskip("trl", reason=f"TRL missing: {gt.INSTALL_HINT}")
datasets = pytest.importorskip("datasets", reason=f"TRL missing: {gt.INSTALL_HINT}")
from tests.integrations.test_trl import (COMPLETIONS, PROMPTS, CraftedRollout,  # noqa: E402
                                         config, digit_reward, length_reward, logprobs_of,
                                         make_model, make_tokenizer, perturb)

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
TOL = 1e-5
IS_MODES = (None, "token_mask", "token_truncate", "sequence_mask", "sequence_truncate")
OPTION_SETS = {
    "plain": {},
    "kl": dict(beta=0.04),
    "kl_no_bias_correction": dict(beta=0.04, use_bias_correction_kl=False),
    "delta_below": dict(delta=1.1),
    "delta_above": dict(delta=1.5),
    "entropy": dict(top_entropy_quantile=0.6, entropy_coef=0.05),
    "opsm": dict(off_policy_mask_threshold=0.01),
    "all": dict(beta=0.04, delta=1.1, top_entropy_quantile=0.6, entropy_coef=0.05,
                off_policy_mask_threshold=0.01),
}
DEFAULTS = dict(beta=0.0, use_bias_correction_kl=True, delta=None, top_entropy_quantile=1.0,
                entropy_coef=0.0, off_policy_mask_threshold=None)


def test_loss_types_are_trls():
    """The loss types covered are the ones GRPOConfig documents, all of them."""
    help_text = trl.GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    listed = re.search(r"Supported values are (.*?)\. ", help_text).group(1)
    assert sorted(re.findall(r"'(\w+)'", listed)) == sorted(LOSS_TYPES)


def _build(cls, tmp_path, tokenizer, rollout, model, **overrides):
    ds = datasets.Dataset.from_dict({"prompt": PROMPTS})
    kwargs = dict(mask_truncated_completions=True, vllm_importance_sampling_clip_min=0.5,
                  vllm_importance_sampling_clip_max=2.0, **overrides)
    config_class = gt.IcePopGRPOConfig if cls is gt.IcePopGRPOTrainer else trl.GRPOConfig
    trainer = cls(model=copy.deepcopy(model), reward_funcs=length_reward,
                  args=config(config_class, tmp_path, **kwargs),
                  train_dataset=ds, processing_class=tokenizer, rollout_func=rollout)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    return trainer


class Setup:
    """Stock GRPOTrainer and FusedGRPOTrainer on copies of one model, and TRL's batch for
    every IS mode (generated before the policy step)."""

    def __init__(self, tmp_path, bf16=False, model=None):
        tokenizer = make_tokenizer()
        model = make_model() if model is None else model
        rollout = CraftedRollout(tokenizer)
        self.stock = _build(trl.GRPOTrainer, tmp_path / "trl", tokenizer, rollout, model,
                            bf16=bf16)
        self.ours = _build(gt.FusedGRPOTrainer, tmp_path / "ours", tokenizer, rollout, model,
                           bf16=bf16)
        stock = self.stock
        stock.use_vllm, stock._last_loaded_step = True, 0     # TRL's IS path, our rollout
        rollout.logprobs = [[0.0] * len(c) for c in COMPLETIONS]
        first = stock._generate_and_score_completions([{"prompt": p} for p in PROMPTS])
        old = logprobs_of(stock, first)
        g = torch.Generator().manual_seed(5)
        sampled = old + 0.4 * torch.randn(old.shape, generator=g)
        sampled[0, 1] = float("nan")        # vLLM could not score it: TRL's ratio 1, KL 0
        sampled[2, 1] = float("-inf")
        rollout.logprobs = [sampled[i, :len(c)].tolist() for i, c in enumerate(COMPLETIONS)]
        self.inputs = {}
        for mode in IS_MODES[1:]:
            stock.vllm_importance_sampling_mode = mode
            inputs = stock._generate_and_score_completions([{"prompt": p} for p in PROMPTS])
            # the reference model = the policy before the step
            inputs["ref_per_token_logps"] = inputs["old_per_token_logps"].clone()
            self.inputs[mode] = inputs
        none = dict(self.inputs["token_mask"])
        del none["importance_sampling_ratio"]
        self.inputs[None] = none
        # Rollout log-probs = TRL's pi_old exactly: TRL's IS ratio on a zero log-difference,
        # what IcePop's coupled mode (pi_old := the rollout policy) composes with.
        rollout.logprobs = [old[i, :len(c)].tolist() for i, c in enumerate(COMPLETIONS)]
        self.on_policy = {}
        for mode in IS_MODES[1:]:
            stock.vllm_importance_sampling_mode = mode
            inputs = stock._generate_and_score_completions([{"prompt": p} for p in PROMPTS])
            inputs["ref_per_token_logps"] = inputs["old_per_token_logps"].clone()
            self.on_policy[mode] = inputs
        on_policy_none = dict(self.on_policy["token_mask"])
        del on_policy_none["importance_sampling_ratio"]
        self.on_policy[None] = on_policy_none
        perturb(stock.model, self.ours.model, scale=0.1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return Setup(tmp_path_factory.mktemp("trl_losses"))


def configure(trainer, loss_type, level, is_mode, options):
    """Set the loss options the way GRPOTrainer.__init__ reads them from GRPOConfig."""
    o = dict(DEFAULTS, **options)
    trainer.loss_type = loss_type
    trainer.importance_sampling_level = level
    trainer.use_vllm = True
    trainer.vllm_importance_sampling_correction = is_mode is not None
    trainer.vllm_importance_sampling_mode = is_mode or "sequence_mask"
    trainer.beta = o["beta"]
    trainer.args.use_bias_correction_kl = o["use_bias_correction_kl"]
    trainer.args.delta = o["delta"]
    # CISPO's epsilon_high is an absolute bound on the ratio (TRL recommends 5.0); 1.1 here
    # so that some ratios are clipped and some are not.
    trainer.epsilon_high = 1.1 if loss_type == "cispo" else 0.28
    trainer.top_entropy_quantile = o["top_entropy_quantile"]
    trainer.entropy_coef = o["entropy_coef"]
    trainer._entropy_bonus_enabled = o["entropy_coef"] != 0.0
    trainer.off_policy_mask_threshold = o["off_policy_mask_threshold"]


def run(trainer, inputs):
    """(loss, flat parameter gradient, logged metrics) of one _compute_loss call."""
    trainer.model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in trainer.model.parameters()])
    metrics = {k: list(v) for k, v in trainer._metrics["train"].items()}
    trainer._metrics["train"].clear()
    return loss.detach(), grads, metrics


def assert_same_metrics(got, ref, tol=TOL):
    assert sorted(got) == sorted(ref), (sorted(got), sorted(ref))
    for key in ref:
        assert len(got[key]) == len(ref[key]), key
        for a, b in zip(got[key], ref[key]):
            if math.isnan(b):
                assert math.isnan(a), (key, a, b)
            else:
                assert abs(a - b) <= tol * max(1.0, abs(b)), (key, a, b)


def check_against_trl(stock, ours, stock_inputs, our_inputs, name, *, tol=TOL,
                      metrics=True):
    """One _compute_loss call of each on its inputs: loss, gradients, metrics (IcePop's
    ``icepop/pop_frac`` aside, returned; ``metrics=False``: IcePop's single pass, which logs
    its own ``icepop/*`` keys instead of TRL's) equal."""
    ref = run(stock, stock_inputs)
    got = run(ours, our_inputs)
    # A mean over random-sign advantages cancels far below its terms: judge the loss
    # against the same loss over |A| (its fp32 summation order differs from TRL's).
    with torch.no_grad():
        magnitude = stock._compute_loss(
            stock.model, dict(stock_inputs, advantages=stock_inputs["advantages"].abs()))
    stock._metrics["train"].clear()
    assert torch.isfinite(ref[0]) and ref[1].abs().sum() > 0, name
    assert_sum_close(got[0], ref[0], magnitude.abs() + ref[0].abs(), tol=tol,
                     name=f"loss {name}")
    assert_close(got[1], ref[1], tol=tol, name=f"grad {name}")
    pop_frac = got[2].pop("icepop/pop_frac", None)
    if metrics:
        assert_same_metrics(got[2], ref[2], tol=10 * tol)
    return pop_frac


def compare(setup, loss_type, level, is_mode, options, *, tol=TOL):
    for tr in (setup.stock, setup.ours):
        configure(tr, loss_type, level, is_mode, options)
    inputs = setup.inputs[is_mode]
    check_against_trl(setup.stock, setup.ours, inputs, inputs,
                      f"{loss_type}/{level}/{is_mode}/{options}", tol=tol)


def combinations(loss_type):
    """(IS mode, option set) pairs: every option set once, cycling through the IS modes, and
    every IS mode with all options on (the options interact through the per-token weights
    and the reduction, the IS mode only through the weights)."""
    modes = [m for m in IS_MODES
             if not (loss_type == "vespo" and m in ("sequence_mask", "sequence_truncate"))]
    pairs = [(modes[i % len(modes)], name) for i, name in enumerate(OPTION_SETS)]
    pairs += [(mode, "all") for mode in modes if (mode, "all") not in pairs]
    return pairs


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_matches_trl(setup, loss_type, level):
    with glm_kernels.force_backend("torch"):
        for is_mode, option_set in combinations(loss_type):
            compare(setup, loss_type, level, is_mode, OPTION_SETS[option_set])


def test_the_batch_exercises_the_options(setup):
    """The checks above can fail: the batch clips, masks, weights and moves the KL."""
    configure(setup.stock, "dapo", "token", "token_mask", OPTION_SETS["kl"])
    _, _, metrics = run(setup.stock, setup.inputs["token_mask"])
    assert metrics["clip_ratio/low_mean"][0] > 0 and metrics["clip_ratio/high_mean"][0] > 0
    assert metrics["kl"][0] > 1e-3
    inputs = setup.inputs["token_mask"]
    mask = inputs["completion_mask"].bool()
    assert not mask[5].any() and mask.sum() > 12              # an empty row, ragged rows
    assert (inputs["advantages"] > 0).any() and (inputs["advantages"] < 0).any()
    ratio = inputs["importance_sampling_ratio"]
    assert (ratio[mask] == 0).any() and (ratio[mask] == 1).any()   # masked, NaN -> 1
    for mode in ("sequence_mask", "sequence_truncate"):
        assert setup.inputs[mode]["importance_sampling_ratio"].shape == (len(PROMPTS), 1)
    # the OPSM threshold drops some negative-advantage rows and keeps others
    lp = logprobs_of(setup.stock, inputs)
    keep = setup.stock.get_off_policy_mask(inputs["advantages"].unsqueeze(1), lp,
                                           inputs["sampling_per_token_logps"], mask.float(),
                                           0.01)
    assert (keep == 0).any() and (keep[inputs["advantages"] < 0] == 1).any()


KERNEL_OPTIONS_OFF = ("plain", "delta_below", "entropy", "opsm", "delta_above")
KERNEL_OPTIONS_KL = ("all", "kl", "kl_no_bias_correction")


def kernel_rows(loss_type):
    """The interpreter's covering set, two rows per loss_type: (level, IS mode, option set).

    Loss type i runs token level with beta = 0 if i is even (> 0 if odd) and sequence level
    with the other beta, so every loss_type meets both levels and both betas, and the pairs
    (level, beta) all occur. The IS modes cycle through the 16 rows (row 2i token, 2i + 1
    sequence), which puts every IS mode at both levels and with both betas (VESPO takes
    token_truncate for a sequence mode, as TRL allows). The option sets rotate: beta > 0 rows
    among the KL ones ("all" carries every option), beta = 0 rows among the others."""
    i = LOSS_TYPES.index(loss_type)
    rows = []
    for j, level in enumerate(("token", "sequence")):
        r = 2 * i + j
        mode = IS_MODES[r % len(IS_MODES)]
        if loss_type == "vespo" and mode in ("sequence_mask", "sequence_truncate"):
            mode = "token_truncate"
        with_kl = (i + j) % 2 == 1
        options = KERNEL_OPTIONS_KL[r % len(KERNEL_OPTIONS_KL)] if with_kl else \
            KERNEL_OPTIONS_OFF[r % len(KERNEL_OPTIONS_OFF)]
        rows.append((level, mode, options))
    return rows


def test_kernel_rows_cover_the_pairs():
    """The covering set holds what kernel_rows promises (so a change to it cannot quietly
    drop a pair): loss_type x level, loss_type x beta, level x beta, IS mode x level, IS mode
    x beta."""
    rows = [(lt,) + row for lt in LOSS_TYPES for row in kernel_rows(lt)]
    beta = {name: OPTION_SETS[name].get("beta", 0.0) > 0 for name in OPTION_SETS}
    pairs = lambda a, b: {(x[a], beta[x[3]] if b == 3 else x[b]) for x in rows}  # noqa: E731
    assert pairs(0, 1) == {(lt, lv) for lt in LOSS_TYPES for lv in ("token", "sequence")}
    assert pairs(0, 3) == {(lt, kl) for lt in LOSS_TYPES for kl in (False, True)}
    assert pairs(1, 3) == {(lv, kl) for lv in ("token", "sequence") for kl in (False, True)}
    assert pairs(2, 1) == {(m, lv) for m in IS_MODES for lv in ("token", "sequence")}
    assert pairs(2, 3) == {(m, kl) for m in IS_MODES for kl in (False, True)}
    assert {x[3] for x in rows} == set(OPTION_SETS)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_matches_trl_on_the_kernels(setup, loss_type):
    """The Triton kernels (interpreter on CPU) behind fused_linear_logprobs, policy_loss and
    kl_penalty_terms against stock TRL, on the covering set of kernel_rows."""
    skip_without_kernels()
    with glm_kernels.force_backend(KERNEL_BACKEND):
        for level, is_mode, options in kernel_rows(loss_type):
            compare(setup, loss_type, level, is_mode, OPTION_SETS[options])


def test_matches_trl_under_bf16_autocast(tmp_path):
    """TRL's default bf16=True: both LM heads run under CPU bf16 autocast; bf16 tolerance."""
    bf16 = Setup(tmp_path, bf16=True)
    with glm_kernels.force_backend("torch"):
        compare(bf16, "grpo", "sequence", "token_mask", OPTION_SETS["all"], tol=1e-2)


def test_moe_load_balancing_loss_matches_trl(tmp_path):
    """A MoE model with router_aux_loss_coef: TRL adds coef x the model's load-balancing loss
    (and logs ``aux_loss``); so does the fused trainer, from its own forward."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Qwen2MoeConfig(
        vocab_size=25, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
        bos_token_id=None, router_aux_loss_coef=0.05)
    moe = Setup(tmp_path, model=transformers.Qwen2MoeForCausalLM(cfg))
    assert moe.stock.aux_loss_enabled and moe.ours.aux_loss_enabled
    with glm_kernels.force_backend("torch"):
        for loss_type, level, options in (("dapo", "token", {}),
                                          ("grpo", "sequence", OPTION_SETS["all"])):
            compare(moe, loss_type, level, "token_mask", options)
    configure(moe.stock, "dapo", "token", "token_mask", {})
    assert run(moe.stock, moe.inputs["token_mask"])[2]["aux_loss"][0] > 0


def test_adaptive_entropy_controller_matches_trl(setup):
    """use_adaptive_entropy: the coefficient applied and its update at each optimizer step
    (window entropy vs entropy_target) are TRL's, over three steps."""
    stock, ours = setup.stock, setup.ours
    for tr in (stock, ours):
        configure(tr, "dapo", "token", "token_mask", dict(entropy_coef=0.1))
        tr.use_adaptive_entropy = True
        tr._last_world_entropy, tr._entropy_window_stats = float("inf"), None
        tr.args.entropy_target, tr.args.entropy_coef_delta = 3.0, 0.02
    try:
        for _ in range(3):
            ref = run(stock, setup.inputs["token_mask"])
            got = run(ours, setup.inputs["token_mask"])
            assert_close(got[1], ref[1], tol=TOL, name="grad")
            assert_same_metrics(got[2], ref[2], tol=10 * TOL)
            assert ours.entropy_coef == stock.entropy_coef
            assert ours._last_world_entropy == pytest.approx(stock._last_world_entropy, 1e-6)
        assert stock.entropy_coef != 0.1                     # the controller moved
    finally:
        for tr in (stock, ours):
            tr.use_adaptive_entropy = False


def test_refuses_what_trl_refuses(tmp_path):
    tokenizer = make_tokenizer()
    ds = datasets.Dataset.from_dict({"prompt": PROMPTS})

    rollout = CraftedRollout(tokenizer)
    rollout.logprobs = [[0.0] * len(c) for c in COMPLETIONS]

    def build(cls, **overrides):
        return cls(model=make_model(), reward_funcs=digit_reward,
                   args=config(trl.GRPOConfig, tmp_path, **overrides), train_dataset=ds,
                   processing_class=tokenizer, rollout_func=rollout)

    # TRL refuses an unknown loss_type / level at the first loss; the fused trainer at once
    for bad, message in ((dict(loss_type="gspo"), "Unknown loss type: gspo"),
                         (dict(importance_sampling_level="segment"),
                          "Unknown importance sampling level: segment")):
        stock = build(trl.GRPOTrainer, **bad)
        inputs = stock._generate_and_score_completions([{"prompt": p} for p in PROMPTS])
        with pytest.raises(ValueError, match=message):
            stock._compute_loss(stock.model, inputs)
        with pytest.raises(ValueError, match=message):
            build(gt.FusedGRPOTrainer, **bad)
    # GRPOConfig's own refusals hold for both (the IcePop config is a GRPOConfig)
    for cfg in (trl.GRPOConfig, gt.IcePopGRPOConfig):
        with pytest.raises(ValueError, match="must be less than"):
            config(cfg, tmp_path, vllm_importance_sampling_clip_min=2.0,
                   vllm_importance_sampling_clip_max=1.0)
        with pytest.raises(ValueError, match="At least one of"):
            config(cfg, tmp_path, vllm_importance_sampling_mode="token_truncate",
                   vllm_importance_sampling_clip_min=None,
                   vllm_importance_sampling_clip_max=None)
    # what TRL accepts, the fused trainer accepts
    for options in (dict(loss_type="vespo"), dict(loss_type="sapo", delta=0.9),
                    dict(importance_sampling_level="sequence", loss_type="cispo"),
                    dict(top_entropy_quantile=0.2, use_adaptive_entropy=True),
                    dict(off_policy_mask_threshold=0.0,
                         vllm_importance_sampling_mode="sequence_truncate")):
        assert build(gt.FusedGRPOTrainer, **options).fused_calls == 0


def test_docs_fused_example_prints_what_the_page_shows(tmp_path, monkeypatch, capsys):
    """docs/trl.md's FusedGRPOTrainer example (after the page's first example, whose names it
    uses) runs as written -- a real TRL training loop with beta > 0 and TRL's reference
    model -- and prints exactly the lines the page shows."""
    from tests.integrations.test_trl import _doc_example_and_output
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    page = os.path.join(root, "docs", "trl.md")
    first, _ = _doc_example_and_output(page, 0)
    code, shown = _doc_example_and_output(page, 1)
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(first, "docs/trl.md", "exec"), namespace)
    capsys.readouterr()
    exec(compile(code, "docs/trl.md", "exec"), namespace)
    printed = capsys.readouterr().out.splitlines()
    expected = shown.splitlines()
    assert printed[-len(expected):] == expected, "\n".join(printed[-len(expected) - 2:])
    trainer = namespace["trainer"]
    assert isinstance(trainer, gt.FusedGRPOTrainer) and trainer.state.global_step == 2


def test_icepop_real_run_on_the_general_path(tmp_path):
    """TRL's own training loop with IcePopGRPOTrainer (coupled) on options off the single pass
    (SAPO at sequence level, entropy mask and bonus, OPSM): every step runs the general path,
    logs TRL's keys and icepop/pop_frac, and moves the weights."""
    ds = datasets.Dataset.from_dict({"prompt": PROMPTS})
    args = config(gt.IcePopGRPOConfig, tmp_path, max_steps=2, learning_rate=1e-2,
                  loss_type="sapo", importance_sampling_level="sequence",
                  top_entropy_quantile=0.5, entropy_coef=0.01, off_policy_mask_threshold=0.5)
    trainer = gt.IcePopGRPOTrainer(model=make_model(), reward_funcs=digit_reward, args=args,
                                   train_dataset=ds, processing_class=make_tokenizer(),
                                   rollout_func=gt.generate_with_logprobs)
    assert not trainer._single_pass()
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert trainer.icepop_calls == 2 and trainer.state.global_step == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logs) == 2
    for h in logs:
        assert {"entropy", "policy_loss", "entropy_coef", "icepop/pop_frac"} <= set(h), h
    assert logs[0]["icepop/pop_frac"] == 0.0          # on-policy first step: nothing popped
