"""TRL plug-in against TRL's own code (TRL 1.16.0): ``IcePopGRPOTrainer``'s loss and gradient
vs ``GRPOTrainer._compute_loss`` in token_mask mode on the same batch, every supported
loss_type, and a real CPU run of TRL's training loop with the IcePop trainer.

The batches are made by TRL itself: ``_generate_and_score_completions`` with a ``rollout_func``
that returns crafted completions and crafted rollout log-probs (tokens exactly on the gate
bounds, popped tokens with -inf, an empty mask from a truncated completion), so pi_old, the
advantages and TRL's token_mask importance weights are TRL's own computation. The model and
the tokenizer are built in code (no hub download). Clip bounds are not hit exactly here: the
two trainers compute log pi_theta by different (equally exact) kernels, so a token within an
ulp of 1 +- eps could go either way; the verl tests cover exact clip bounds.

Skipped only when TRL is not installed; CI installs it (README, the ``[integrations]`` extra).
"""
import copy
import math
import os

import pytest
import torch

from glm_kernels.integrations.trl import trainer as gt
from glm_kernels.loss.mismatch.mismatch import MISMATCH_KEYS
from tests._compare import assert_close, assert_sum_close

trl = pytest.importorskip("trl", reason=f"TRL missing: {gt.INSTALL_HINT}")
transformers = pytest.importorskip("transformers", reason=f"TRL missing: {gt.INSTALL_HINT}")
tokenizers = pytest.importorskip("tokenizers", reason=f"TRL missing: {gt.INSTALL_HINT}")
datasets = pytest.importorskip("datasets", reason=f"TRL missing: {gt.INSTALL_HINT}")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

TOL = 1e-5
WORDS = ["<pad>", "<eos>", "<unk>"] + [str(i) for i in range(10)] + list("abcdefghij") + \
    ["count", ":"]
G, T_MAX = 4, 6
PROMPTS = ["count : 3 c"] * G + ["count : 7 h"] * G


def make_tokenizer():
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
        padding_side="left")


def make_model(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(
        vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    return transformers.Qwen2ForCausalLM(cfg)


def digit_reward(completions, **kwargs):
    """Toy verifiable reward: 1 when the completion starts with a digit."""
    return [1.0 if c.strip()[:1].isdigit() else 0.0 for c in completions]


def length_reward(completions, **kwargs):
    return [float(len(c.split()) % 3) for c in completions]


def config(cls, tmp_path, **overrides):
    kwargs = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=G,
                  max_completion_length=T_MAX, report_to="none", use_cpu=True, bf16=False,
                  save_strategy="no", seed=0, disable_tqdm=True, logging_steps=1,
                  epsilon=0.2, epsilon_high=0.28)
    kwargs.update(overrides)
    return cls(**kwargs)


# Completions: EOS (id 1) at different places; row 5 has no EOS (truncated: with
# mask_truncated_completions its mask is empty).
COMPLETIONS = [[3, 4, 1], [5, 1], [13, 14, 15, 6, 1], [7, 8, 9, 10, 11, 1], [1],
               [3, 3, 3, 3, 3, 3], [12, 4, 1], [20, 21, 1]]


class CraftedRollout:
    """A rollout_func returning fixed completions and the rollout log-probs set on it."""

    def __init__(self, tokenizer):
        self.prompt_ids = tokenizer(text=PROMPTS)["input_ids"]
        self.logprobs = None

    def __call__(self, prompts, trainer):
        assert list(prompts) == PROMPTS
        return {"prompt_ids": [list(p) for p in self.prompt_ids],
                "completion_ids": [list(c) for c in COMPLETIONS],
                "logprobs": [list(lp) for lp in self.logprobs]}


def trainers(tmp_path, loss_type, mode, *, reward=length_reward, bf16=False, delta=None):
    """(TRL's GRPOTrainer, IcePopGRPOTrainer, rollout) on two identical copies of one model."""
    tokenizer = make_tokenizer()
    model = make_model()
    rollout = CraftedRollout(tokenizer)
    ds = datasets.Dataset.from_dict({"prompt": PROMPTS})
    common = dict(loss_type=loss_type, mask_truncated_completions=True, bf16=bf16, delta=delta,
                  vllm_importance_sampling_mode="token_mask",
                  vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=2.0)
    theirs = trl.GRPOTrainer(model=copy.deepcopy(model), reward_funcs=reward,
                             args=config(trl.GRPOConfig, tmp_path / "trl", **common),
                             train_dataset=ds, processing_class=tokenizer,
                             rollout_func=rollout)
    # TRL applies its token_mask IS only on its vLLM path; switching the flag on after init
    # runs that path (old-log-prob forward, IS ratio, the loss) with our rollout_func.
    theirs.use_vllm, theirs._last_loaded_step = True, 0
    ours = gt.IcePopGRPOTrainer(model=copy.deepcopy(model), reward_funcs=reward,
                                args=config(gt.IcePopGRPOConfig, tmp_path / "ours",
                                            icepop_mode=mode, icepop_gate_low=0.5,
                                            icepop_gate_high=2.0, **common),
                                train_dataset=ds, processing_class=tokenizer,
                                rollout_func=rollout)
    for tr in (theirs, ours):
        tr.model.train()
        tr.current_gradient_accumulation_steps = 2
    return theirs, ours, rollout


def logprobs_of(trainer, inputs):
    """TRL's own scoring of the batch's completion tokens under the current weights."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        return trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, attention, inputs["completion_ids"].size(1),
            batch_size=len(PROMPTS))[0]


def generate(trainer, rollout, sampled=None):
    """TRL's _generate_and_score_completions on the crafted rollout; ``sampled`` [B, T] are
    the rollout log-probs (zeros when None)."""
    if sampled is None:
        sampled = torch.zeros(len(COMPLETIONS), T_MAX)
    rollout.logprobs = [sampled[i, :len(c)].tolist() for i, c in enumerate(COMPLETIONS)]
    return trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS])


def perturb(*models, seed=11, scale=0.05):
    """The same small step on every copy (pi_theta != pi_old, so some ratios clip)."""
    for model in models:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(scale * torch.randn(p.shape, generator=g))


def loss_and_grads(trainer, compute, inputs):
    trainer.model.zero_grad(set_to_none=True)
    loss = compute(trainer.model, inputs)
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in trainer.model.parameters()])
    return loss.detach(), grads


@pytest.mark.parametrize("loss_type", gt.SUPPORTED_LOSS_TYPES)
def test_decoupled_matches_trl_token_mask(tmp_path, loss_type):
    theirs, ours, rollout = trainers(tmp_path, loss_type, "decoupled")
    old = logprobs_of(theirs, generate(theirs, rollout))
    g = torch.Generator().manual_seed(5)
    sampled = old + 0.4 * torch.randn(old.shape, generator=g)
    # k = exp(old - rollout) exactly on the gate bounds, then the bounds set to those values.
    sampled[0, 0] = old[0, 0] - math.log(2.0)
    sampled[0, 1] = old[0, 1] + math.log(2.0)
    k_hi = float(torch.exp(old[0, 0] - sampled[0, 0]))
    k_lo = float(torch.exp(old[0, 1] - sampled[0, 1]))
    sampled[2, 1] = float("-inf")                          # popped, carries -inf
    theirs.vllm_importance_sampling_clip_min, theirs.vllm_importance_sampling_clip_max = \
        k_lo, k_hi
    ours.icepop_config.icepop_gate_low, ours.icepop_config.icepop_gate_high = k_lo, k_hi
    inputs = generate(theirs, rollout, sampled)
    assert torch.equal(inputs["old_per_token_logps"], old)
    mask = inputs["completion_mask"].bool()
    ratio = inputs["importance_sampling_ratio"]
    assert ratio[0, 0] == k_hi and ratio[0, 1] == k_lo     # TRL keeps both bounds too
    assert not mask[5].any()                               # truncated: empty mask
    assert (ratio[mask] == 0).sum() >= 2                   # some popped, -inf among them
    assert inputs["advantages"].abs().sum() > 0

    perturb(theirs.model, ours.model)
    ref = loss_and_grads(theirs, theirs._compute_loss, inputs)
    got = loss_and_grads(ours, ours._compute_loss, inputs)
    assert ours.icepop_calls == 1
    assert_close(got[0], ref[0], tol=TOL, name=f"loss {loss_type}")
    assert_close(got[1], ref[1], tol=TOL, name=f"grad {loss_type}")


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_coupled_matches_trl_loss_on_rollout_base(tmp_path, loss_type):
    """Coupled: TRL's own loss with pi_old := the rollout log-probs and its IS weight := the
    IcePop gate 1[lo <= exp(logp - rollout) <= hi] (logp: TRL's own, current policy)."""
    theirs, ours, rollout = trainers(tmp_path, loss_type, "coupled")
    first = generate(ours, rollout)
    assert "old_per_token_logps" not in first               # coupled: no old-log-prob forward
    perturb(theirs.model, ours.model)
    current = logprobs_of(theirs, first)
    g = torch.Generator().manual_seed(6)
    sampled = current + 0.5 * torch.randn(current.shape, generator=g)
    for _ in range(3):         # keep every ratio away from the bounds (different kernels)
        rho = torch.exp(current - sampled)
        near = ((rho - 0.5).abs() < 1e-3) | ((rho - 2.0).abs() < 1e-3)
        sampled = torch.where(near, sampled + 0.01, sampled)
    sampled = torch.nn.functional.pad(sampled, (0, T_MAX - sampled.shape[1]))
    inputs = generate(ours, rollout, sampled)
    rho = torch.exp(current - inputs["sampling_per_token_logps"])
    assert not (((rho - 0.5).abs() < 1e-4) | ((rho - 2.0).abs() < 1e-4)).any()
    gate = ((rho >= 0.5) & (rho <= 2.0)).float()
    mask = inputs["completion_mask"].bool()
    assert (gate[mask] == 0).any() and (gate[mask] == 1).any()
    trl_inputs = dict(inputs, old_per_token_logps=inputs["sampling_per_token_logps"],
                      importance_sampling_ratio=gate)
    ref = loss_and_grads(theirs, theirs._compute_loss, trl_inputs)
    got = loss_and_grads(ours, ours._compute_loss, inputs)
    # A mean over random-sign advantages cancels far below its terms: the budget scales with
    # the same loss over |A| (its fp32 summation order differs from TRL's).
    magnitude = loss_and_grads(theirs, theirs._compute_loss,
                               dict(trl_inputs, advantages=inputs["advantages"].abs()))[0]
    assert_sum_close(got[0], ref[0], magnitude, tol=TOL, name=f"loss {loss_type}")
    assert_close(got[1], ref[1], tol=TOL, name=f"grad {loss_type}")


def test_nan_rollout_logprob_is_popped(tmp_path):
    """A NaN rollout log-prob pops its token (docs/design.md 3.1); TRL would give it ratio 1.
    The loss
    equals the one with that token popped by -inf, and stays finite."""
    _, ours, rollout = trainers(tmp_path, "bnpo", "coupled")
    old = logprobs_of(ours, generate(ours, rollout))
    results = []
    for bad in (float("nan"), float("-inf")):
        sampled = old.clone()
        sampled[0, 0] = bad
        inputs = generate(ours, rollout, sampled)
        results.append(loss_and_grads(ours, ours._compute_loss, inputs))
    assert torch.isfinite(results[0][0]) and torch.isfinite(results[0][1]).all()
    assert_close(results[0][0], results[1][0], tol=TOL, name="loss")
    assert_close(results[0][1], results[1][1], tol=TOL, name="grad")


def test_token_truncate_with_the_gate_open_is_tis(tmp_path):
    """token_truncate, gate [0, inf] (nothing popped): TRL's TIS weight clamp(k, C_min,
    C_max) on the same batch (the gate composed with it: test_trl_losses.py)."""
    theirs, ours, rollout = trainers(tmp_path, "bnpo", "decoupled")
    for tr in (theirs, ours):
        tr.vllm_importance_sampling_mode = "token_truncate"
        tr.vllm_importance_sampling_clip_min, tr.vllm_importance_sampling_clip_max = 0.5, 1.5
    ours.icepop_config.icepop_gate_low, ours.icepop_config.icepop_gate_high = 0.0, math.inf
    old = logprobs_of(theirs, generate(theirs, rollout))
    g = torch.Generator().manual_seed(8)
    inputs = generate(theirs, rollout, old + 0.4 * torch.randn(old.shape, generator=g))
    mask = inputs["completion_mask"].bool()
    w = inputs["importance_sampling_ratio"]
    assert (w[mask] == 1.5).any() and (w[mask] == 0.5).any()    # both ends truncated
    perturb(theirs.model, ours.model)
    ref = loss_and_grads(theirs, theirs._compute_loss, inputs)
    got = loss_and_grads(ours, ours._compute_loss, inputs)
    assert_close(got[0], ref[0], tol=TOL, name="loss")
    assert_close(got[1], ref[1], tol=TOL, name="grad")


def test_two_sided_clipping_delta_matches_trl(tmp_path):
    """TRL's delta (two-sided clipping) is the kernel's dual clip: a policy step large enough
    that negative-advantage tokens pass r = delta = 1.3, against TRL's own loss."""
    theirs, ours, rollout = trainers(tmp_path, "dapo", "decoupled", delta=1.3)
    old = logprobs_of(theirs, generate(theirs, rollout))
    g = torch.Generator().manual_seed(12)
    inputs = generate(theirs, rollout, old + 0.2 * torch.randn(old.shape, generator=g))
    perturb(theirs.model, ours.model, scale=0.3)
    ratio = torch.exp(logprobs_of(theirs, inputs) - old)
    mask = inputs["completion_mask"].bool() & (inputs["importance_sampling_ratio"] > 0)
    negative = (inputs["advantages"] < 0).unsqueeze(-1).expand_as(ratio)
    assert (mask & negative & (ratio > 1.3)).sum() >= 1     # the cap binds: the check can fail
    ref = loss_and_grads(theirs, theirs._compute_loss, inputs)
    got = loss_and_grads(ours, ours._compute_loss, inputs)
    assert_close(got[0], ref[0], tol=TOL, name="loss")
    assert_close(got[1], ref[1], tol=TOL, name="grad")


def test_decoupled_matches_trl_under_bf16_autocast(tmp_path):
    """TRL's default bf16=True: both LM heads run under CPU bf16 autocast; bf16 tolerance."""
    theirs, ours, rollout = trainers(tmp_path, "dapo", "decoupled", bf16=True)
    with theirs.accelerator.autocast():
        assert torch.is_autocast_enabled("cpu")
    old = logprobs_of(theirs, generate(theirs, rollout))
    g = torch.Generator().manual_seed(9)
    inputs = generate(theirs, rollout, old + 0.4 * torch.randn(old.shape, generator=g))
    perturb(theirs.model, ours.model)
    ref = loss_and_grads(theirs, theirs._compute_loss, inputs)
    got = loss_and_grads(ours, ours._compute_loss, inputs)
    assert_close(got[0], ref[0], tol=1e-2, name="loss")
    assert_close(got[1], ref[1], tol=1e-2, name="grad")


def _count_scorer_calls(trainer) -> list:
    """A list that gains an entry each time TRL's log-prob scorer (the pi_old forward) runs."""
    calls = []
    scorer = trainer._get_per_token_logps_and_entropies
    trainer._get_per_token_logps_and_entropies = \
        lambda *a, **k: calls.append(1) or scorer(*a, **k)
    return calls


def test_real_tiny_run_coupled_skips_old_forward(tmp_path):
    """TRL's own training loop, 10 optimizer steps on CPU: the loss is ours every micro-step,
    TRL's log-prob scorer is never called (no old-log-prob forward, not TRL's loss), and the
    toy reward goes up."""
    tokenizer = make_tokenizer()
    ds = datasets.Dataset.from_dict(
        {"prompt": [f"count : {i % 10} {chr(97 + i % 10)}" for i in range(64)]})
    args = config(gt.IcePopGRPOConfig, tmp_path, max_steps=10, learning_rate=3e-2,
                  gradient_accumulation_steps=2, per_device_train_batch_size=4)
    trainer = gt.IcePopGRPOTrainer(model=make_model(), reward_funcs=digit_reward, args=args,
                                   train_dataset=ds, processing_class=tokenizer,
                                   rollout_func=gt.generate_with_logprobs)
    scorer_calls = _count_scorer_calls(trainer)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert trainer.state.global_step == 10
    assert trainer.icepop_calls == 20                       # 10 steps x 2 accumulation
    assert scorer_calls == []
    moved = [not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters())]
    assert all(moved)
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logs) == 10
    assert all("icepop/pop_frac" in h for h in logs)
    # TRL's default gradient checkpointing was on; the first step (before any update) is
    # on-policy: ratio 1 to fp32 rounding, nothing popped
    assert args.gradient_checkpointing and trainer.model.is_gradient_checkpointing
    assert logs[0]["icepop/pop_frac"] == 0.0
    assert abs(logs[0]["icepop/ratio_min"] - 1) <= 1e-5, logs[0]
    assert abs(logs[0]["icepop/ratio_max"] - 1) <= 1e-5, logs[0]
    rewards = [h["reward"] for h in logs]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3, rewards


def test_real_run_decoupled_computes_old_logprobs(tmp_path):
    tokenizer = make_tokenizer()
    ds = datasets.Dataset.from_dict({"prompt": PROMPTS})
    args = config(gt.IcePopGRPOConfig, tmp_path, max_steps=2, learning_rate=1e-2,
                  icepop_mode="decoupled")
    trainer = gt.IcePopGRPOTrainer(model=make_model(), reward_funcs=digit_reward, args=args,
                                   train_dataset=ds, processing_class=tokenizer,
                                   rollout_func=gt.generate_with_logprobs)
    scorer_calls = _count_scorer_calls(trainer)
    trainer.train()
    assert trainer.icepop_calls == 2 and len(scorer_calls) == 2    # one pi_old pass a step


def test_bad_configs_are_refused(tmp_path):
    tokenizer = make_tokenizer()
    ds = datasets.Dataset.from_dict({"prompt": PROMPTS})

    def build(cfg):
        return gt.IcePopGRPOTrainer(model=make_model(), reward_funcs=digit_reward, args=cfg,
                                    train_dataset=ds, processing_class=tokenizer,
                                    rollout_func=gt.generate_with_logprobs)

    with pytest.raises(TypeError, match="IcePopGRPOConfig"):
        build(config(trl.GRPOConfig, tmp_path))
    # what TRL refuses (TRL at the first loss, the trainer at construction)
    with pytest.raises(ValueError, match="Unknown loss type: gspo"):
        build(config(gt.IcePopGRPOConfig, tmp_path, loss_type="gspo"))
    # the options the trainer refused before it had TRL's whole loss are accepted
    for options in (dict(loss_type="cispo"), dict(delta=1.1), dict(top_entropy_quantile=0.5),
                    dict(importance_sampling_level="sequence", loss_type="luspo"),
                    dict(off_policy_mask_threshold=0.5, entropy_coef=0.01)):
        assert build(config(gt.IcePopGRPOConfig, tmp_path, **options)).icepop_calls == 0
    with pytest.raises(ValueError, match="icepop_mode"):
        config(gt.IcePopGRPOConfig, tmp_path, icepop_mode="tito")
    # every IcePop mode x IS mode is accepted (test_trl_losses.py checks what they compute)
    for mode in ("coupled", "decoupled"):
        for is_mode in ("token_mask", "token_truncate", "sequence_mask", "sequence_truncate"):
            config(gt.IcePopGRPOConfig, tmp_path, icepop_mode=mode,
                   vllm_importance_sampling_mode=is_mode)
    # VESPO with a sequence IS mode: TRL refuses it (its __init__, with vLLM); so does the
    # IcePop config, which applies the IS correction with or without vLLM
    with pytest.raises(ValueError, match="VESPO loss requires"):
        config(gt.IcePopGRPOConfig, tmp_path, loss_type="vespo",
               vllm_importance_sampling_mode="sequence_mask")
    config(gt.IcePopGRPOConfig, tmp_path, loss_type="vespo",
           vllm_importance_sampling_mode="sequence_mask",
           vllm_importance_sampling_correction=False)
    with pytest.raises(ValueError, match="icepop_gate_low"):
        config(gt.IcePopGRPOConfig, tmp_path, icepop_gate_low=3.0)
    with pytest.raises(ValueError, match="icepop_beta"):
        config(gt.IcePopGRPOConfig, tmp_path, icepop_beta=0.0)
    with pytest.raises(AttributeError, match="no attribute"):
        gt.NotAThing   # noqa: B018


def test_without_engine_logprobs_is_an_error(tmp_path):
    """TRL's plain transformers generation records no log-probs: refused with the fix."""
    ds = datasets.Dataset.from_dict({"prompt": PROMPTS})
    trainer = gt.IcePopGRPOTrainer(model=make_model(), reward_funcs=digit_reward,
                                   args=config(gt.IcePopGRPOConfig, tmp_path),
                                   train_dataset=ds, processing_class=make_tokenizer())
    with pytest.raises(ValueError, match="generate_with_logprobs"):
        trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS])


def _doc_example_and_output(path, index=0):
    """The ``index``-th ```python block of a docs page and the ```text block after it (what
    the block prints, as the page shows it)."""
    import re
    with open(path) as f:
        text = f.read()
    code = list(re.finditer(r"```python\n(.*?)```", text, re.S))[index]
    shown = re.compile(r"```text\n(.*?)```", re.S).search(text, code.end())
    assert shown is not None, f"{path}: no ```text block after example {index}"
    return code.group(1), shown.group(1)


def test_docs_first_example_prints_what_the_page_shows(tmp_path, monkeypatch, capsys):
    """docs/trl.md's CPU example (TRL's defaults: gradient checkpointing on) runs as written
    in a scratch directory and prints exactly the lines the page shows: 3 loss calls, a first
    step with nothing popped and ratio 1 (to 5 decimals), and the logged icepop/ keys (after
    the log lines TRL prints itself)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code, shown = _doc_example_and_output(os.path.join(root, "docs", "trl.md"))
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(code, "docs/trl.md", "exec"), namespace)
    printed = capsys.readouterr().out.splitlines()
    expected = shown.splitlines()
    # TRL prints its own log dict each step first; the example's lines end the output
    assert printed[-len(expected):] == expected, "\n".join(printed[-len(expected) - 2:])
    trainer = namespace["trainer"]
    assert trainer.args.gradient_checkpointing and trainer.state.global_step == 3
    # the keys the page shows are the ones the trainer logs (a metric added to the loss
    # without the page being updated fails here)
    logged = sorted(k for k in trainer.state.log_history[0] if k.startswith("icepop/"))
    assert logged == sorted(f"icepop/{key}" for key in ("pop_frac", "clip_frac", "ratio_mean",
                                                        "ratio_max", "ratio_min") + MISMATCH_KEYS)


def _checkpointed_trainer(tmp_path):
    """An IcePopGRPOTrainer on TRL's defaults, with gradient checkpointing switched on the way
    transformers' Trainer.train does before the first step."""
    args = config(gt.IcePopGRPOConfig, tmp_path)
    assert args.gradient_checkpointing                     # TRL's default
    trainer = gt.IcePopGRPOTrainer(model=make_model(), reward_funcs=digit_reward, args=args,
                                   train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}),
                                   processing_class=make_tokenizer(),
                                   rollout_func=gt.generate_with_logprobs)
    trainer.model.train()
    trainer.model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
    assert trainer.model.is_gradient_checkpointing
    return trainer


def test_generate_with_logprobs_records_the_models_logprobs_under_checkpointing(tmp_path):
    """With gradient checkpointing on, the rollout log-probs are the model's own: TRL's scorer
    on the same batch gives them back (ratio 1 before any update, fp32 tolerance); generate
    ran with checkpointing off (KV cache on) and checkpointing is on again afterwards."""
    trainer = _checkpointed_trainer(tmp_path)
    model = trainer.accelerator.unwrap_model(trainer.model)
    seen = []
    generate = model.generate

    def recording_generate(*args, **kwargs):
        seen.append(model.is_gradient_checkpointing)
        return generate(*args, **kwargs)
    model.generate = recording_generate
    inputs = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS])
    assert seen == [False] and model.is_gradient_checkpointing
    mask = inputs["completion_mask"].bool()
    assert int(mask.sum()) > len(PROMPTS)                  # more than one token a row somewhere
    rollout = inputs["sampling_per_token_logps"]
    scored = logprobs_of(trainer, inputs)
    assert_close(rollout[mask], scored[mask], tol=TOL, name="rollout vs TRL's scorer")
    ratio = torch.exp(scored - rollout)[mask]
    assert float((ratio - 1).abs().max()) <= 1e-5, (ratio.min(), ratio.max())


def test_generate_with_logprobs_restores_checkpointing_when_generate_raises(tmp_path):
    trainer = _checkpointed_trainer(tmp_path)
    model = trainer.accelerator.unwrap_model(trainer.model)
    seen = []

    def failing_generate(*args, **kwargs):
        seen.append(model.is_gradient_checkpointing)
        raise RuntimeError("generation failed")
    model.generate = failing_generate
    with pytest.raises(RuntimeError, match="generation failed"):
        gt.generate_with_logprobs(PROMPTS, trainer)
    assert seen == [False] and model.is_gradient_checkpointing
    # and a model without checkpointing is left without it
    model.gradient_checkpointing_disable()
    with pytest.raises(RuntimeError, match="generation failed"):
        gt.generate_with_logprobs(PROMPTS, trainer)
    assert seen == [False, False] and not model.is_gradient_checkpointing


def test_missing_trl_names_the_pip_line(monkeypatch):
    import sys
    monkeypatch.setattr(gt, "_classes", {})
    monkeypatch.setitem(sys.modules, "trl", None)                 # as if TRL were absent
    with pytest.raises(ImportError, match="pip install 'trl==1.16.0'"):
        gt.IcePopGRPOTrainer   # noqa: B018
