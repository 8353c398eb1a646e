"""The policy as a Hugging Face checkpoint (``model/hf_checkpoint.py``): stock transformers
loads the very weights, the tokenizer reads every id and every task's text back, a save
replaces an earlier one whole and refuses a symlink, and stock greedy decoding of the
checkpoint is the patched in-memory model's."""
import json
import os
import re

import pytest
import torch

pytest.importorskip("transformers")

from examples.async_trainer.config import TrainerConfig  # noqa: E402
from examples.async_trainer.env import task, vocab  # noqa: E402
from examples.async_trainer.model import hf_checkpoint, policy  # noqa: E402

CFG = TrainerConfig(device="cpu")


def _model(seed):
    torch.manual_seed(seed)
    return policy.new_policy(CFG).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = _model(0)
    path = tmp_path_factory.mktemp("hf") / "policy"
    hf_checkpoint.save_hf_checkpoint(model, CFG, path)
    return model, path


def _prompts(per_task=4):
    gen = torch.Generator().manual_seed(1)
    return [task.make_prompt(CFG, t, gen) for t in task.TASKS for _ in range(per_task)]


def _texts_round_trip(tok):
    for i in range(vocab.vocab_size(CFG)):
        assert tok.convert_tokens_to_ids(tok.convert_ids_to_tokens(i)) == i
    for prompt in _prompts(2):
        ids = prompt + task.expected_completion(CFG, prompt)
        assert tok(tok.decode(ids), add_special_tokens=False).input_ids == ids


def test_tokenizer_round_trips():
    tok = hf_checkpoint.tokenizer(CFG)
    assert len(tok) == vocab.vocab_size(CFG)
    assert (tok.eos_token_id, tok.pad_token_id) == (vocab.EOS, vocab.PAD)
    _texts_round_trip(tok)


def test_stock_transformers_loads_the_weights_and_tokenizer(saved):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model, path = saved
    assert json.loads((path / "config.json").read_text())["attn_implementation"] == "eager"
    loaded = AutoModelForCausalLM.from_pretrained(path, **hf_checkpoint.load_kwargs(path))
    assert loaded.config.model_type == "glm_moe_dsa"
    assert loaded.config._attn_implementation == "eager"
    mine, theirs = model.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys()
    for name, tensor in mine.items():
        assert theirs[name].dtype == tensor.dtype and torch.equal(theirs[name], tensor), name
    tok = AutoTokenizer.from_pretrained(path)
    assert (tok.eos_token_id, tok.pad_token_id) == (vocab.EOS, vocab.PAD)
    _texts_round_trip(tok)
    assert loaded.generation_config.eos_token_id == vocab.EOS
    assert loaded.generation_config.pad_token_id == vocab.PAD


def test_greedy_answers_match_the_patched_model(saved):
    # Stock and patched logits differ by rounding only (~1e-8: glm_kernels scores routing
    # as 1 / (1 + exp(-l)), transformers with torch.sigmoid), too little to flip an argmax here.
    model, path = saved
    prompts = _prompts()
    budget = task.max_len(CFG) - max(map(len, prompts))
    want = []
    with torch.no_grad():
        for prompt in prompts:
            x = torch.tensor([prompt])
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=budget, eos_token_id=vocab.EOS,
                                 pad_token_id=vocab.PAD)[0, len(prompt):].tolist()
            want.append(out[:out.index(vocab.EOS) + 1] if vocab.EOS in out else out)
    assert hf_checkpoint.greedy_answers(path, CFG, prompts, budget) == want


def test_a_second_save_replaces_the_first(tmp_path):
    from transformers import AutoModelForCausalLM
    path = tmp_path / "policy"
    hf_checkpoint.save_hf_checkpoint(_model(0), CFG, path)
    (path / "stale.txt").write_text("from the first save")
    second = _model(1)
    hf_checkpoint.save_hf_checkpoint(second, CFG, path)
    assert not (path / "stale.txt").exists()
    assert os.listdir(tmp_path) == ["policy"]        # no temporary or old sibling left
    loaded = AutoModelForCausalLM.from_pretrained(path).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in second.state_dict().items())


def test_a_symlink_or_file_path_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    link = tmp_path / "policy"
    link.symlink_to(target)
    model = _model(0)
    with pytest.raises(ValueError, match=re.escape(str(link))):
        hf_checkpoint.save_hf_checkpoint(model, CFG, link)
    assert os.listdir(target) == [] and link.is_symlink()
    plain = tmp_path / "file"
    plain.write_text("not a checkpoint")
    with pytest.raises(ValueError, match=re.escape(str(plain))):
        hf_checkpoint.save_hf_checkpoint(model, CFG, plain)
    assert plain.read_text() == "not a checkpoint"


def test_a_run_ends_with_a_checkpoint_whose_greedy_answers_are_its_evaluation(tmp_path):
    """A short run (SFT, then a 0-step RL stage: its model is the SFT one) writes
    ``<out-dir>/model/``; stock greedy decoding of it answers the held-out reverse prompts
    token for token as the run's own greedy evaluation did, so the pass rates agree."""
    from examples.async_trainer.rollout.local import generate
    from examples.async_trainer.train.recipe import held_out_prompts
    from examples.async_trainer.trainer import train

    cfg = TrainerConfig(tasks="reverse", sft_steps=25, rl_steps=0, opd_steps=0,
                        eval_prompts=16, rollout_backend="process", device="cpu",
                        progress=False, out_dir=str(tmp_path / "run")).validate()
    out = train(cfg)
    assert "model/" in out["outputs"]
    path = tmp_path / "run" / "model"
    prompts = held_out_prompts(cfg, "reverse")
    budget = task.max_len(cfg) - len(prompts[0])
    stock = hf_checkpoint.greedy_answers(path, cfg, prompts, budget)
    rewards = [task.reward(cfg, p + a, len(p)) for p, a in zip(prompts, stock)]
    assert sum(rewards) / len(rewards) == out["evals"]["rl:reverse"]["reverse"]
    final = policy.new_policy(cfg, state=torch.load(tmp_path / "run" / "checkpoint.pt",
                                                    weights_only=True)["finished"]["rl:reverse"])
    own = generate(cfg, final.eval(), prompts, 1, greedy=True)
    for p, a, s in zip(prompts, stock, own):
        answer = s["tokens"][len(p):]
        assert a == answer[:len(a)] and all(t == vocab.EOS for t in answer[len(a):])
