"""The policy as a Hugging Face checkpoint: a directory that stock ``transformers`` loads with
``AutoModelForCausalLM`` / ``AutoTokenizer`` (no glm_kernels, no example code), so a trained
policy can be shared, inspected and decoded like any other causal LM.

The weights are saved as held (safetensors, ``model_type`` ``glm_moe_dsa``); the glm_kernels
patch lives on the instance, so nothing of it is saved. A stock load computes the patched
function up to rounding (glm_kernels scores routers as ``1 / (1 + exp(-l))``, batch-invariant,
transformers with ``torch.sigmoid``: logits ~1e-8 apart), provided it runs eager attention as
the policy does, which config.json therefore records (:func:`save_hf_checkpoint`).

The tokenizer is a ``tokenizers`` WordLevel model, one token per id of ``env/vocab.py``. Where
``tora_task.TOKENIZER``'s texts are ambiguous it differs: the reverse / tool digits read
``<d0>``.. (there, as the decimal digits: a non-canonical parse), and the role / task tokens
``<|system|>``.., as chat templates' control tokens do.
"""
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Dict, List, Sequence

import torch

from ..env import tora_task, vocab

_CONTROL = {vocab.SYSTEM: "system", vocab.USER: "user", vocab.ASSISTANT: "assistant",
            vocab.OBSERVATION: "observation", vocab.EOS: "eos", vocab.TOOL_CALL: "tool_call",
            vocab.TASK_REVERSE: "task_reverse", vocab.TASK_TOOL: "task_tool",
            vocab.TASK_TORA: "task_tora"}


def token_texts(cfg) -> Dict[int, str]:
    """The text of every id of ``cfg``'s vocabulary (``vocab.vocab_size(cfg)`` distinct texts)."""
    texts = {i: f"<|{name}|>" for i, name in _CONTROL.items()}
    # The ToRA code pieces, error marker and decimal digits keep the example's own texts, so
    # a sandbox program reads the same through either tokenizer.
    texts.update({i: tora_task.TOKENIZER.pieces[i] for i in range(vocab.PY_OPEN, vocab.N_SPECIAL)})
    texts.update({vocab.N_SPECIAL + d: f"<d{d}>" for d in range(cfg.vocab_digits)})
    return texts


def tokenizer(cfg):
    """A ``transformers.PreTrainedTokenizerFast`` over ``cfg``'s task vocabulary.

    ``cfg``: a ``TrainerConfig`` (its ``vocab_digits`` sets the vocabulary's size). Text to ids
    is canonical (the texts are prefix-free: a text has one parse), ids to text concatenates;
    a character no token covers raises. Role, task and ``<|eos|>`` tokens are special (dropped
    by ``skip_special_tokens``); eos and pad are ``<|eos|>`` (``vocab.PAD == vocab.EOS``).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    texts = token_texts(cfg)
    assert len(set(texts.values())) == len(texts) == vocab.vocab_size(cfg)
    tok = Tokenizer(models.WordLevel({t: i for i, t in texts.items()}, unk_token=None))
    # One alternative per token text, longest first, so the pre-tokenizer cuts a text exactly
    # into token texts; what matches none is left as a piece of its own, which WordLevel
    # refuses (no unk token: an unknown character must not become some id silently).
    pattern = "|".join(re.escape(t) for t in sorted(texts.values(), key=len, reverse=True))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    tok.decoder = decoders.Fuse()
    # Multi-character texts are also added tokens: matched before pre-tokenization whatever
    # surrounds them (the code pieces hold newlines), and the control ones marked special.
    tok.add_tokens([AddedToken(texts[i], normalized=False) for i in texts
                    if i not in _CONTROL and len(texts[i]) > 1])
    tok.add_special_tokens([AddedToken(texts[i], special=True, normalized=False)
                            for i in sorted(_CONTROL)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=texts[vocab.EOS],
                                   pad_token=texts[vocab.PAD],
                                   clean_up_tokenization_spaces=False)


def save_hf_checkpoint(model, cfg, path) -> Path:
    """Write ``model`` as a Hugging Face checkpoint directory at ``path``, atomically.

    ``model``: the policy (``policy.new_policy``), saved in the dtype it holds. ``cfg``: its
    ``TrainerConfig`` (the tokenizer's vocabulary). ``path``: the directory; an existing one
    (an earlier save) is replaced whole, a symlink or a non-directory is refused (ValueError).
    The checkpoint is written into a hidden sibling, the old one renamed away, the new one
    renamed in, the old one deleted: ``path`` holds a whole checkpoint, old or new, never a mix
    (between the two renames, for an instant, none). Returns ``path`` as a ``Path``.
    """
    from transformers import GenerationConfig

    path = Path(path)
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise ValueError(f"save_hf_checkpoint: {str(path)!r} is a symlink or not a directory; "
                         "refusing to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp, old = path.with_name(f".{path.name}.tmp-{tag}"), path.with_name(f".{path.name}.old-{tag}")
    os.mkdir(tmp)           # not mkdtemp: its 0700 would become the checkpoint's mode
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        # config.json does not record the attention implementation, and a stock load picks
        # sdpa, under which transformers 5.10's DSA attention has no causal mask (the indexer
        # gets none; huggingface/transformers#48363): every key visible. Recorded here,
        # from_pretrained loads the model's own (eager).
        conf = tmp / "config.json"
        conf.write_text(json.dumps({**json.loads(conf.read_text()),
                                    "attn_implementation": model.config._attn_implementation},
                                   indent=2, sort_keys=True) + "\n")
        tokenizer(cfg).save_pretrained(tmp)
        GenerationConfig(eos_token_id=vocab.EOS, pad_token_id=vocab.PAD).save_pretrained(tmp)
        _fsync([*tmp.iterdir(), tmp])    # on disk before the rename that publishes it
        if path.exists():
            os.rename(path, old)
        try:
            os.rename(tmp, path)
        except BaseException:
            if old.exists():
                os.rename(old, path)
            raise
        _fsync([path.parent])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return path


def _fsync(paths) -> None:
    """Flush files and directories (their entries) to disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def load_kwargs(path) -> dict:
    """``from_pretrained`` arguments for the checkpoint at ``path``: the attention
    implementation its config.json records (transformers 5.10 reads it from there, 5.2 does
    not and would load sdpa, under which this model is not causal)."""
    conf = json.loads((Path(path) / "config.json").read_text())
    return {"attn_implementation": conf["attn_implementation"]}


@torch.no_grad()
def greedy_answers(path, cfg, prompts: Sequence[List[int]], max_new_tokens: int) -> List[List[int]]:
    """Greedy completions of ``prompts`` by the checkpoint at ``path``, as a user would get
    them: stock ``AutoModelForCausalLM`` (``load_kwargs``) / ``AutoTokenizer``,
    ``generate(do_sample=False)``.

    ``cfg``: the ``TrainerConfig`` (its device). ``prompts``: token-id lists, each decoded to
    text and re-encoded by the saved tokenizer (ValueError if that changes its ids), then
    generated alone (no padding). ``max_new_tokens``: the most tokens per answer. Returns the
    generated ids of each prompt, cut after the first ``<|eos|>`` (kept).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = cfg.resolved_device()
    model = AutoModelForCausalLM.from_pretrained(path, **load_kwargs(path)).to(device).eval()
    tok = AutoTokenizer.from_pretrained(path)
    answers = []
    for prompt in prompts:
        ids = tok(tok.decode(prompt), add_special_tokens=False).input_ids
        if ids != list(prompt):
            raise ValueError(f"the tokenizer at {str(path)!r} reads {prompt} back as {ids}")
        x = torch.tensor([ids], device=device)
        # an explicit all-ones mask: with pad == eos generate cannot infer one
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=vocab.EOS,
                             pad_token_id=vocab.PAD)[0, len(ids):].tolist()
        answers.append(out[:out.index(vocab.EOS) + 1] if vocab.EOS in out else out)
    return answers
