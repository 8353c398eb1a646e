"""One GRPO optimizer step in TRL: TRL's GRPOTrainer vs IcePopGRPOTrainer decoupled / coupled
vs FusedGRPOTrainer, and (``--loss-types``) TRL vs FusedGRPOTrainer per loss_type.

Same model, same batch, V = 151,936 (the Qwen vocabulary), 1K-4K completion tokens. A step is
what the trainer does per batch after generation:

* ``trl``       -- TRL 1.16's own GRPOTrainer, token_mask IS (its vLLM-path correction): the
                   old-log-prob forward (no grad, its fused LM head), then its loss (fused LM
                   head log-probs + entropy), backward, AdamW step.
* ``decoupled`` -- IcePopGRPOTrainer, icepop_mode="decoupled": the same old-log-prob forward,
                   then the fused IcePop loss from hidden states + LM head, backward, step.
* ``coupled``   -- IcePopGRPOTrainer, icepop_mode="coupled" (TITO): no old-log-prob forward.
* ``fused``     -- FusedGRPOTrainer (TRL's loss, every option; no gate), token_mask IS as
                   ``trl``: the old-log-prob forward, then log-probs + entropy from hidden
                   states + LM head (fused_linear_logprobs), policy_loss, backward, step.

``--loss-types cispo sapo ...`` adds one ``trl`` and one ``fused`` row per loss_type (at the
first ``--tokens`` value); the other rows use loss_type dapo.

Peak memory is the step's high-water mark above what was live before it: on CUDA
``max_memory_allocated``; on CPU the process's peak RSS (VmHWM, reset through
/proc/self/clear_refs) in a separate process where glibc serves every block over 64 KiB by
mmap, so freed memory leaves the RSS. Times are medians over interleaved repeats: each
(variant, loss_type) lives in its own process, built and warmed up once, and round r times
one step of each, in an order rotated by r, one process at a time (a busy stretch of a shared
machine then spreads over every variant). Wall time, and on CPU also the process CPU time
(user + sys of all threads; one torch thread by default, ``--threads``), which other jobs
disturb less; ``cpu_spread`` is (max - min) / median of the CPU times. The timed processes
are alive together, so the run needs the sum of their footprints (at the CPU defaults, V =
151,936: ~1.5-3 GiB each). No generation is timed (the batch is random token ids).

    python benchmarks/bench_trl.py              # GPU: hidden 2048, 4 layers, bf16
    python benchmarks/bench_trl.py --cpu        # CPU: hidden 256, 2 layers, fp32
    python benchmarks/bench_trl.py --cpu --tokens 1024 --repeats 3
    python benchmarks/bench_trl.py --cpu --tokens 512 --vocab 32768 --loss-types cispo vespo
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
import _common  # noqa: E402

VARIANTS = ("trl", "decoupled", "coupled", "fused")
QWEN_VOCAB = 151_936
PROMPT_LEN = 64
COMPLETION_LEN = 256              # tokens per completion; the batch size sets the total


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class PeakMemory:
    """Peak bytes above the level at start, for one block of work."""

    def __init__(self, device: str):
        self.device = device

    def __enter__(self):
        import torch
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")                      # reset VmHWM to the current RSS
            self.base = _rss_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc):
        import torch
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
        else:
            self.peak = _rss_kib("VmHWM") * 1024 - self.base
        return False


def build(variant: str, args, workdir: str):
    """(trainer, optimizer, inputs) for one variant on the shared seeded model and batch."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    import trl
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    from datasets import Dataset
    from glm_kernels.integrations.trl import trainer as gt

    device = args.device
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    words = ["<pad>", "<eos>", "<unk>"] + [str(i) for i in range(10)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                        eos_token="<eos>", unk_token="<unk>",
                                        padding_side="left")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=max(args.hidden // 64, 1),
                         num_key_value_heads=max(args.hidden // 128, 1),
                         max_position_embeddings=PROMPT_LEN + COMPLETION_LEN,
                         tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
                         bos_token_id=None)
    model = Qwen2ForCausalLM(config).to(device=device, dtype=dtype)
    batch = args.tokens // COMPLETION_LEN
    common = dict(output_dir=workdir, per_device_train_batch_size=batch, num_generations=batch,
                  max_completion_length=COMPLETION_LEN, report_to="none", bf16=False,
                  use_cpu=not device.startswith("cuda"), save_strategy="no", seed=0,
                  disable_tqdm=True, loss_type=args.loss_type, epsilon=0.2, epsilon_high=0.28,
                  vllm_importance_sampling_mode="token_mask",
                  vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=2.0)
    ds = Dataset.from_dict({"prompt": ["1 2 3"] * batch})
    reward = lambda completions, **kw: [0.0] * len(completions)   # noqa: E731 (not called)
    if variant in ("trl", "fused"):
        cls = trl.GRPOTrainer if variant == "trl" else gt.FusedGRPOTrainer
        trainer = cls(model=model, reward_funcs=reward, args=trl.GRPOConfig(**common),
                      train_dataset=ds, processing_class=tokenizer)
        trainer.use_vllm = True      # its token_mask IS is applied on the vLLM path
    else:
        trainer = gt.IcePopGRPOTrainer(
            model=model, reward_funcs=reward,
            args=gt.IcePopGRPOConfig(**common, icepop_mode=variant), train_dataset=ds,
            processing_class=tokenizer, rollout_func=gt.generate_with_logprobs)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1

    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(2, args.vocab, (batch, PROMPT_LEN), generator=g)
    completion_ids = torch.randint(2, args.vocab, (batch, COMPLETION_LEN), generator=g)
    lengths = torch.randint(COMPLETION_LEN // 2, COMPLETION_LEN + 1, (batch,), generator=g)
    completion_mask = (torch.arange(COMPLETION_LEN) < lengths[:, None]).long()
    # Rollout log-probs near the untrained model's own (~ -log V), with engine-like noise.
    sampling = -math.log(args.vocab) + 0.3 * torch.randn(batch, COMPLETION_LEN, generator=g)
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids),
              "completion_ids": completion_ids, "completion_mask": completion_mask,
              "advantages": torch.randn(batch, generator=g),
              "sampling_per_token_logps": sampling,
              "num_items_in_batch": completion_mask.sum().float()}
    inputs = {k: v.to(device) for k, v in inputs.items()}
    optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=1e-6)
    return trainer, optimizer, inputs


def one_step(variant: str, trainer, optimizer, inputs):
    import torch
    batch = dict(inputs)
    if variant in ("trl", "decoupled", "fused"):
        # The old-log-prob forward, by TRL's own scorer, as TRL runs it while scoring.
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        with torch.no_grad():
            old = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, attention, batch["completion_ids"].size(1),
                batch_size=ids.size(0))[0]
        batch["old_per_token_logps"] = old
        if variant in ("trl", "fused"):   # TRL's token_mask weights (grpo_trainer.py, IS block)
            diff = torch.nan_to_num((old - batch["sampling_per_token_logps"])
                                    * batch["completion_mask"], nan=0.0)
            ratio = torch.exp(diff)
            batch["importance_sampling_ratio"] = ratio.masked_fill((ratio < 0.5) | (ratio > 2.0),
                                                                   0.0)
    loss = trainer._compute_loss(trainer.model, batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def memory_worker(args) -> dict:
    """--measure memory: the peak of one step after a warm-up step, in this fresh process."""
    with tempfile.TemporaryDirectory() as workdir:
        trainer, optimizer, inputs = build(args.worker, args, workdir)
        one_step(args.worker, trainer, optimizer, inputs)             # warm-up, optimizer state
        with PeakMemory(args.device) as mem:
            one_step(args.worker, trainer, optimizer, inputs)
    return {"peak_bytes": mem.peak}


def serve(args) -> None:
    """--measure time: build the variant, take the warm-up step, print READY, then time one
    step per ``step`` line read from stdin (RESULT: wall and process CPU seconds)."""
    import torch
    cuda = args.device.startswith("cuda")
    if not cuda:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as workdir:
        trainer, optimizer, inputs = build(args.worker, args, workdir)
        one_step(args.worker, trainer, optimizer, inputs)             # warm-up, optimizer state
        print("READY", flush=True)
        for line in sys.stdin:
            if line.strip() != "step":
                break
            if cuda:
                torch.cuda.synchronize()
            start, start_cpu = time.perf_counter(), time.process_time()
            one_step(args.worker, trainer, optimizer, inputs)
            if cuda:
                torch.cuda.synchronize()
            print("RESULT " + json.dumps({"step_s": time.perf_counter() - start,
                                          "cpu_s": time.process_time() - start_cpu}),
                  flush=True)


def _worker_cmd(variant: str, tokens: int, args, loss_type: str, measure: str) -> list:
    return [sys.executable, os.path.abspath(__file__), "--worker", variant, "--measure",
            measure, "--tokens", str(tokens), "--vocab", str(args.vocab), "--hidden",
            str(args.hidden), "--layers", str(args.layers), "--dtype", args.dtype,
            "--device", args.device, "--loss-type", loss_type, "--threads", str(args.threads)]


def _read_line(proc, tag: str, err, what: str) -> str:
    """The next stdout line of ``proc`` starting with ``tag`` (its stderr in the error)."""
    for line in proc.stdout:
        if line.startswith(tag):
            return line[len(tag):].strip()
    proc.wait()
    err.seek(0)
    raise RuntimeError(f"{what} ended (rc {proc.returncode}) without {tag.strip()}:\n"
                       f"{err.read()[-3000:]}")


def time_interleaved(specs, tokens: int, args) -> dict:
    """Medians over ``args.repeats`` rounds of one timed step per (variant, loss_type), each
    in its own long-lived process (built and warmed up once), the rounds interleaved: round r
    runs the variants in an order rotated by r, one process at a time, so a slow or busy
    stretch of a shared machine spreads over every variant instead of landing on one."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    procs, errs = {}, {}
    try:
        for spec in specs:
            errs[spec] = tempfile.TemporaryFile(mode="w+")
            procs[spec] = subprocess.Popen(
                _worker_cmd(spec[0], tokens, args, spec[1], "time"), stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=errs[spec], text=True, env=env)
        for spec, proc in procs.items():
            _read_line(proc, "READY", errs[spec], f"{spec} at {tokens} tokens")
        samples = {spec: {"step_s": [], "cpu_s": []} for spec in specs}
        for r in range(args.repeats):
            for spec in specs[r % len(specs):] + specs[:r % len(specs)]:
                proc = procs[spec]
                proc.stdin.write("step\n")
                proc.stdin.flush()
                out = json.loads(_read_line(proc, "RESULT ", errs[spec],
                                            f"{spec} at {tokens} tokens"))
                for key in ("step_s", "cpu_s"):
                    samples[spec][key].append(out[key])
    finally:
        for proc in procs.values():
            if proc.stdin and not proc.stdin.closed:
                proc.stdin.close()
            proc.wait()
        for err in errs.values():
            err.close()
    results = {}
    for spec, s in samples.items():
        cpu = s["cpu_s"]
        results[spec] = {"step_s": statistics.median(s["step_s"]),
                         "cpu_s": statistics.median(cpu),
                         "cpu_spread": (max(cpu) - min(cpu)) / statistics.median(cpu)}
        print(f"  {spec[0]:9s} {spec[1]:7s} {tokens:5d} tokens: cpu s "
              f"{[round(c, 3) for c in cpu]}", flush=True)
    return results


def peak_memory(variant: str, tokens: int, args, loss_type: str = "dapo") -> dict:
    """Peak memory of one step in a fresh process (glibc serves blocks over 64 KiB by mmap,
    so the RSS follows the live tensors; slower, so not timed)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    if not args.device.startswith("cuda"):
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    proc = subprocess.run(_worker_cmd(variant, tokens, args, loss_type, "memory"),
                          capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{variant} (memory) at {tokens} tokens failed:\n"
                           f"{proc.stderr[-3000:]}")
    out = json.loads(lines[-1][len("RESULT "):])
    print(f"  {variant:9s} {loss_type:7s} {tokens:5d} tokens memory: {out}", flush=True)
    return out


def _parse(argv=None):
    def hook(parser):
        parser.add_argument("--worker", choices=VARIANTS)
        parser.add_argument("--tokens", type=int, nargs="*")
        parser.add_argument("--vocab", type=int, default=QWEN_VOCAB)
        parser.add_argument("--hidden", type=int)
        parser.add_argument("--layers", type=int)
        parser.add_argument("--dtype", choices=("fp32", "bf16"))
        parser.add_argument("--repeats", type=int)
        parser.add_argument("--device")
        parser.add_argument("--measure", choices=("time", "memory"), default="time")
        parser.add_argument("--threads", type=int, default=1,
                            help="torch threads per timed CPU process (default 1)")
        parser.add_argument("--loss-type", default="dapo")
        parser.add_argument("--loss-types", nargs="*", default=[])
    args = _common.bench_args(__doc__, hook, argv)
    gpu = not args.cpu and _common.default_device() == "cuda"
    args.device = args.device or ("cuda" if gpu else "cpu")
    args.hidden = args.hidden or (2048 if gpu else 256)
    args.layers = args.layers or (4 if gpu else 2)
    args.dtype = args.dtype or ("bf16" if gpu else "fp32")
    args.repeats = args.repeats or (5 if gpu or not args.quick else 3)
    return args


def run(quick: bool = False, cpu: bool = False) -> dict:
    """The table at this machine's defaults (what run_all / gpu_check call). TRL is not on
    every image (not on the lent H200's): then the result says so instead of failing."""
    missing = [name for name in ("trl", "transformers", "datasets")
               if importlib.util.find_spec(name) is None]
    if missing:
        reason = (f"skipped: {', '.join(missing)} not installed (pip install "
                  "'glm_kernels[integrations]')")
        print(f"bench_trl: {reason}")
        return {"benchmark": "trl", "skipped": reason}
    return _table(_parse((["--quick"] if quick else []) + (["--cpu"] if cpu else [])))


def _row(tokens, name, r, base, decoupled=None) -> dict:
    return {"tokens": tokens, "variant": name, "step_ms": r["step_s"] * 1e3,
            "cpu_ms": r["cpu_s"] * 1e3, "cpu_spread": r["cpu_spread"],
            "peak_MiB": r["peak_bytes"] / 2**20,
            "time_vs_trl": r["step_s"] / base["step_s"], "cpu_vs_trl": r["cpu_s"] / base["cpu_s"],
            "mem_vs_trl": r["peak_bytes"] / max(base["peak_bytes"], 1),
            "time_vs_decoupled": (float("nan") if decoupled is None
                                  else r["step_s"] / decoupled["step_s"]),
            "cpu_vs_decoupled": (float("nan") if decoupled is None
                                 else r["cpu_s"] / decoupled["cpu_s"])}


def _table(args) -> dict:
    tokens = args.tokens or ([1024] if args.quick else [1024, 2048, 4096])
    rows = []
    for i, n in enumerate(tokens):
        specs = [(v, "dapo") for v in VARIANTS]
        if i == 0:
            specs += [(v, lt) for lt in args.loss_types for v in ("trl", "fused")]
        results = time_interleaved(specs, n, args)
        for spec in specs:
            results[spec].update(peak_memory(spec[0], n, args, spec[1]))
        base, decoupled = results[("trl", "dapo")], results[("decoupled", "dapo")]
        rows += [_row(n, v, results[(v, "dapo")], base, decoupled) for v in VARIANTS]
        for lt in (args.loss_types if i == 0 else []):
            base = results[("trl", lt)]
            rows += [_row(n, f"{v}:{lt}", results[(v, lt)], base) for v in ("trl", "fused")]
    where = "GPU" if args.device.startswith("cuda") else "CPU (not measured on GPU)"
    _common.print_table(
        f"GRPO optimizer step, V={args.vocab}, hidden {args.hidden}, {args.layers} layers, "
        f"{args.dtype}, {where}, medians of {args.repeats} interleaved repeats"
        + ("" if args.device.startswith("cuda") else f", {args.threads} torch thread(s)"),
        rows, ["tokens", "variant", "step_ms", "cpu_ms", "cpu_spread", "peak_MiB",
               "time_vs_trl", "cpu_vs_trl", "mem_vs_trl", "time_vs_decoupled",
               "cpu_vs_decoupled"])
    return {"benchmark": "trl", "environment": _common.environment(), "vocab": args.vocab,
            "hidden": args.hidden, "layers": args.layers, "dtype": args.dtype,
            "device": args.device, "repeats": args.repeats, "threads": args.threads,
            "rows": rows}


def main() -> None:
    args = _parse()
    if args.worker:
        args.tokens = args.tokens[0]
        if args.measure == "time":
            serve(args)
        else:
            print("RESULT " + json.dumps(memory_worker(args)))
        return
    _common.write_json(args.json, _table(args))


if __name__ == "__main__":
    main()
