"""Check that glm_kernels' delta encoder writes the same files as *your* slime.

Runs slime's own ``UpdateWeightFromDiskDelta._publish`` (its ``_encode_delta`` and
``_write_delta_files``, loaded from a slime checkout) and the same
class after ``glm_kernels.integrations.slime_delta.install`` on identical weight steps, and
compares the version directories: every safetensors header (tensor names, shapes, offsets, the
per-tensor checksums), every data byte, and the index. What a single process cannot provide is
stood in (``_slime_harness.py``); torch.distributed runs for real as a one-rank gloo group.

    python examples/slime/check_delta_conformance.py --slime-src /path/to/slime [--steps 3]

Exit status 0 when every version directory matches, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _slime_harness import load_delta_updater, one_rank_gloo  # noqa: E402


def make_updater(cls, delta_dir, encoding, checksum, baseline):
    args = argparse.Namespace(update_weight_disk_dir=delta_dir,
                              update_weight_delta_encoding=encoding,
                              update_weight_delta_checksum=checksum,
                              custom_update_weight_post_write_path=None)
    u = cls(args, [], lambda: {}, model_name="glm5", quantization_config=None)
    u._is_pp_src_rank = True
    u.rollout_engines = []
    u._snapshot = {k: np.frombuffer(v.contiguous().view(torch.uint8).numpy().tobytes(), np.uint8)
                   for k, v in baseline.items()}
    u._baseline_captured = True
    return u


def model(seed, device):
    g = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (301, 64), "model.layers.0.self_attn.q_b_proj.weight":
              (257, 96), "model.layers.0.mlp.experts.3.down_proj.weight": (64, 129),
              "model.layers.0.input_layernorm.weight": (64,), "lm_head.weight": (301, 64)}
    out = {k: (torch.randn(s, generator=g) * 0.02).bfloat16() for k, s in shapes.items()}
    out["model.norm.weight"] = torch.ones(64)                    # fp32, never changes
    return {k: v.to(device) for k, v in out.items()}


def step(weights, seed, density=0.02):
    g = torch.Generator().manual_seed(seed)
    for name, w in weights.items():
        if name == "model.norm.weight":
            continue
        bits = w.view(torch.int16)
        hit = (torch.rand(bits.shape, generator=g) < density).to(w.device)
        bits += hit.to(torch.int16)


def files_of(version_dir):
    """Each file of a version directory, parsed: safetensors as (header dict, data bytes),
    JSON as a dict. (safetensors writes its ``__metadata__`` map in hash order, which differs
    from run to run even within slime, so raw bytes are not comparable; everything else is.)"""
    out = {}
    for name in sorted(os.listdir(version_dir)):
        blob = open(os.path.join(version_dir, name), "rb").read()
        if name.endswith(".safetensors"):
            header_len = int.from_bytes(blob[:8], "little")
            out[name] = (json.loads(blob[8:8 + header_len]), blob[8 + header_len:])
        else:
            out[name] = json.loads(blob)
    return out


def hook_runs_before_updater(slime_src: str) -> bool:
    """``install`` only works if slime calls the --custom-megatron-init-path hook (inside
    ``megatron_utils.initialize.init``) before the actor imports its delta updater class, and
    imports it lazily (a module-level import would bind the original class first)."""
    actor = open(os.path.join(slime_src, "slime", "backends", "megatron_utils",
                              "actor.py")).read()
    init_src = open(os.path.join(slime_src, "slime", "backends", "megatron_utils",
                                 "initialize.py")).read()
    lazy_import = "        from .update_weight.update_weight_from_disk_delta import"
    calls_init, imports_updater = actor.find("\n        init(args)"), actor.find(lazy_import)
    ok = ("custom_megatron_init_path" in init_src and 0 <= calls_init < imports_updater
          and "\nfrom .update_weight.update_weight_from_disk_delta" not in actor)
    print(f"hook order: init(args) {'before' if ok else 'NOT before'} the lazy import of "
          f"UpdateWeightFromDiskDelta in actor.py")
    return ok


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slime-src", required=True, help="a slime checkout (holds slime/)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--checksum", default="adler32",
                        help="xxh3-128 and blake3 need the xxhash / blake3 packages")
    parser.add_argument("--device-bytes", default=str(1 << 30),
                        help="GLM_KERNELS_SLIME_DELTA_DEVICE_BYTES for the glm_kernels side")
    args = parser.parse_args()
    os.environ["GLM_KERNELS_SLIME_DELTA_DEVICE_BYTES"] = args.device_bytes
    failures = 0 if hook_runs_before_updater(args.slime_src) else 1
    updater_mod = load_delta_updater(args.slime_src)
    theirs_cls = updater_mod.UpdateWeightFromDiskDelta
    from glm_kernels.integrations.slime import delta as slime_delta
    ours_cls = slime_delta.install(argparse.Namespace(update_weight_mode="delta"))
    assert updater_mod.UpdateWeightFromDiskDelta is ours_cls
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with one_rank_gloo(), tempfile.TemporaryDirectory() as tmp:
        for encoding in ("xor", "overwrite"):
            weights = model(0, device)
            baseline = {k: v.cpu() for k, v in weights.items()}
            sides = {"slime": make_updater(theirs_cls, f"{tmp}/slime-{encoding}", encoding,
                                           args.checksum, baseline),
                     "glm_kernels": make_updater(ours_cls, f"{tmp}/ours-{encoding}", encoding,
                                                 args.checksum, baseline)}
            for version in range(1, args.steps + 1):
                step(weights, version)
                written = {}
                for side, u in sides.items():
                    # fresh tensors per sync, as slime's gather + HF conversion makes them
                    u._iter_hf_tensors = lambda: iter([(k, v.clone()) for k, v in weights.items()])
                    u.weight_version = version
                    u._publish()
                    written[side] = files_of(u._version_dir)
                same = written["slime"] == written["glm_kernels"]
                failures += not same
                sizes = sum(len(v[1]) for v in written["slime"].values() if isinstance(v, tuple))
                print(f"{encoding:9s} v{version}: {len(written['slime'])} files, {sizes} data bytes, "
                      f"changed {sides['slime'].changed_bytes} / {sides['slime'].total_bytes} "
                      f"bytes: {'identical' if same else 'DIFFERENT'}")
    print("conformance:", "PASS" if not failures else f"FAIL ({failures} problems)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
