"""Delta codec: bytes per changed element and throughput, glm_kernels vs baselines vs floor.

Inputs are bf16 weights (what an RL trainer ships to its rollout engines):
  adamw_lr1e-06 / adamw_lr3e-06: fp32 master weights N(0, 0.02) after one AdamW-like step
      (update m/(sqrt(v)+eps) from 10 Adam steps on noisy gradients with a per-weight mean,
      betas (0.9, 0.95), weight decay 0.1); the bf16 copies before and after are encoded and
      the resulting density is measured and reported;
  ulp_0.1% .. ulp_50%: a fixed fraction of the weights, at uniformly random positions, moved
      by one unit in the last place (random sign).
Bytes per changed element = serialized packet bytes (72-byte header included) / changes, for
glm_kernels int32 / gap16 / zstd (level 3, base-relative) and two baselines: slime-style XOR
+ zstd-1 (the whole XOR'd tensor at level 1) and int32 + zstd-1 (int32 positions and raw
values at level 1).
Throughput: encode (cold; and chained: ``old_checksum`` given, as a sender streaming versions
does), and apply (verified, in place), per encoding, on this machine's backend;
peer: a torch ne/nonzero/gather pipeline (int32 positions + values, no checksum) and its
index_copy apply. Floors over the copy bandwidth measured in the same run: encode reads new
and old and writes the payload; apply reads the target once (the verification every apply
does), reads the payload and writes the changed elements.
CPU goal: the C++ host codec at 2 threads vs the numpy implementation of the same format.

    python benchmarks/bench_delta.py [--quick] [--json out.json]
"""
from __future__ import annotations

import os
import sys
import time

if "--cpu" in sys.argv:                      # the interpreter check needs this before import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

import glm_kernels  # noqa: E402
from glm_kernels import _dispatch  # noqa: E402
from glm_kernels.delta import ENCODINGS, DeltaPacket, apply_, checksum, encode  # noqa: E402
from glm_kernels.delta import _host_codec  # noqa: E402
from glm_kernels.delta import _reference as ref  # noqa: E402

FIXED_DENSITIES = (0.001, 0.01, 0.03, 0.1, 0.5)
ADAMW_LRS = (1e-6, 3e-6)
NO_ZSTD = "zstandard not installed"


def _zstandard():
    try:
        import zstandard
    except ImportError:
        return None
    return zstandard


def adamw_pair(n: int, lr: float, device: str, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    master = torch.randn(n, generator=g, device=device) * 0.02
    signal = torch.randn(n, generator=g, device=device) * 0.5
    m = torch.zeros_like(master)
    v = torch.zeros_like(master)
    for _ in range(10):
        grad = signal + torch.randn(n, generator=g, device=device)
        m.mul_(0.9).add_(grad, alpha=0.1)
        v.mul_(0.95).addcmul_(grad, grad, value=0.05)
    update = (m / (1 - 0.9 ** 10)) / ((v / (1 - 0.95 ** 10)).sqrt() + 1e-8)
    old = master.bfloat16()
    new = (master - lr * (update + 0.1 * master)).bfloat16()
    return new, old


def ulp_pair(n: int, density: float, device: str, seed: int = 1):
    g = torch.Generator(device=device).manual_seed(seed)
    old = (torch.randn(n, generator=g, device=device) * 0.02).bfloat16()
    moved = torch.rand(n, generator=g, device=device) < density
    sign = torch.randint(0, 2, (n,), generator=g, device=device, dtype=torch.int16) * 2 - 1
    new = old.clone()
    new.view(torch.int16).add_(moved.to(torch.int16) * sign)
    return new, old


def inputs(n: int, device: str):
    for lr in ADAMW_LRS:
        yield f"adamw_lr{lr:.0e}", *adamw_pair(n, lr, device)
    for d in FIXED_DENSITIES:
        yield f"ulp_{d * 100:g}%", *ulp_pair(n, d, device)


def baseline_bytes(new, old, zstandard):
    """(XOR + zstd-1 of the whole tensor, int32 positions + values + zstd-1) in bytes."""
    nb, ob = new.view(torch.int16), old.view(torch.int16)
    xor = (nb ^ ob).cpu().numpy().tobytes()
    pos = torch.nonzero(nb != ob).reshape(-1)
    raw = pos.to(torch.int32).cpu().numpy().tobytes() + nb[pos].cpu().numpy().tobytes()
    cctx = zstandard.ZstdCompressor(level=1)
    return len(cctx.compress(xor)), len(cctx.compress(raw))


def torch_peer(new, old):
    """ne/nonzero/gather: int32 positions and values; apply = index_copy_ (no checks)."""
    nb, ob = new.view(torch.int16), old.view(torch.int16)

    def enc():
        pos = torch.nonzero(nb != ob).reshape(-1)
        return pos.to(torch.int32), nb[pos]
    pos, vals = enc()
    target = old.clone().view(torch.int16)
    return enc, lambda: target.index_copy_(0, pos.to(torch.int64), vals)


def _time(fn, device, repeats):
    return _common.time_fn(fn, device=device, warmup=1, repeats=repeats)


def _wall(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def measure_input(name, new, old, device, bandwidth, zstandard, repeats):
    n, size = new.numel(), new.element_size()
    row = {"input": name, "elements": n}
    pkts = {}
    for enc in ENCODINGS:
        if enc == "zstd" and zstandard is None:
            row["zstd_B/chg"] = NO_ZSTD
            continue
        pkts[enc] = encode(new, old, encoding=enc)
    count = pkts["gap16"].count
    row["density"] = count / n
    row["changes"] = count
    for enc, pkt in pkts.items():
        row[f"{enc}_B/chg"] = pkt.nbytes() / max(count, 1)
    if zstandard is None:
        row["xor_zstd1_B/chg"] = row["int32_zstd1_B/chg"] = NO_ZSTD
    else:
        xor_b, int32_b = baseline_bytes(new, old, zstandard)
        row["xor_zstd1_B/chg"] = xor_b / max(count, 1)
        row["int32_zstd1_B/chg"] = int32_b / max(count, 1)
    old_ck = checksum(old)
    for enc, pkt in pkts.items():
        back = encode(old, new, encoding=enc)        # apply forward then back: always valid
        target = old.clone()

        def there_and_back():
            apply_(target, pkt)
            apply_(target, back)
        host_bound = enc == "zstd" and device != "cpu"     # frames are compressed on the host
        timer = (lambda f: _wall(f, 3)) if host_bound else (lambda f: _time(f, device, repeats))
        enc_s = timer(lambda: encode(new, old, encoding=enc))
        chained_s = timer(lambda: encode(new, old, encoding=enc, old_checksum=old_ck))
        app_s = timer(there_and_back) / 2
        payload = pkt.payload_nbytes()
        enc_floor = (2 * n * size + payload) / bandwidth
        app_floor = (n * size + payload + count * size) / bandwidth
        row[f"{enc}_enc_ms"] = enc_s * 1e3
        row[f"{enc}_enc/floor"] = enc_s / enc_floor
        row[f"{enc}_chained_ms"] = chained_s * 1e3
        row[f"{enc}_chained/floor"] = chained_s / enc_floor
        row[f"{enc}_app_ms"] = app_s * 1e3
        row[f"{enc}_app/floor"] = app_s / app_floor
    peer_enc, peer_apply = torch_peer(new, old)
    row["torch_peer_enc_ms"] = _time(peer_enc, device, repeats) * 1e3
    row["torch_peer_app_ms"] = _time(peer_apply, device, repeats) * 1e3
    return row


def cpu_goal(n: int, repeats: int) -> dict:
    """C++ host codec (2 threads) vs numpy of the same format, 1 % one-ulp steps, bf16."""
    if _host_codec._ext is None:
        return {"skipped": "glm_kernels._host not built"}
    new, old = ulp_pair(n, 0.01, "cpu")
    nb, ob = ref.np_bits(new), ref.np_bits(old)
    words = n
    out = {"elements": n, "threads": 2, "rows": []}
    for label, spec in (("int32", ref.StreamSpec("int32", False, False)),
                        ("gap16", ref.StreamSpec("gap16", False, False)),
                        ("zstd streams", ref.StreamSpec("gap16", True, True))):
        streams = ref.encode_streams(nb, ob, spec)
        result_ck = ref.finalize(streams.s_new, words)
        base_ck = ref.finalize(streams.s_old, words) if spec.diff else b""
        target = ob.copy()

        def apply_cpp():
            target[:] = ob
            _host_codec._ext.apply(target, spec.positions == "gap16", spec.diff, spec.planar,
                                   streams.positions, streams.escapes, streams.values,
                                   streams.count, result_ck, base_ck, threads=2)

        def apply_np():
            target[:] = ob
            ref.apply_streams(target, streams, spec, result_ck, base_ck)
        reset_s = _wall(lambda: target.__setitem__(slice(None), ob), repeats)
        cpp_enc = _wall(lambda: _host_codec._ext.encode(nb, ob, spec.positions == "gap16",
                                                          spec.diff, spec.planar, hash=True,
                                                          threads=2), repeats)
        np_enc = _wall(lambda: ref.encode_streams(nb, ob, spec), max(2, repeats // 2))
        cpp_app = _wall(apply_cpp, repeats) - reset_s
        np_app = _wall(apply_np, max(2, repeats // 2)) - reset_s
        out["rows"].append({"format": label, "cpp_encode_ms": cpp_enc * 1e3,
                            "numpy_encode_ms": np_enc * 1e3, "encode_speedup": np_enc / cpp_enc,
                            "cpp_apply_ms": cpp_app * 1e3, "numpy_apply_ms": np_app * 1e3,
                            "apply_speedup": np_app / cpp_app})
    out["min_speedup"] = min(min(r["encode_speedup"], r["apply_speedup"]) for r in out["rows"])
    out["goal_4x_met"] = out["min_speedup"] >= 4.0
    return out


def interpreter_check(n: int = 5000) -> dict:
    """The Triton kernels (interpreter) produce the host codec's payload bytes."""
    new, old = ulp_pair(n, 0.05, "cpu")
    same = {}
    for enc in ("int32", "gap16"):
        with glm_kernels.force_backend("torch"):
            host = encode(new, old, encoding=enc)
        with glm_kernels.force_backend("interpret"):
            kern = encode(new, old, encoding=enc)
            target = old.clone()
            apply_(target, DeltaPacket.from_bytes(kern.to_bytes()))
        same[enc] = bytes(host.host_payload()) == bytes(kern.host_payload()) and \
            torch.equal(target.view(torch.int16), new.view(torch.int16))
    print(f"\ninterpreter check, {n} elements: kernel payload == host payload and apply exact: "
          f"{same}")
    return same


def run(quick: bool = False, cpu: bool = False) -> dict:
    device = "cpu" if cpu or not torch.cuda.is_available() else "cuda"
    if device == "cuda":
        n = 1 << (26 if quick else 29)           # 128 MiB / 1 GiB of bf16 per tensor
        repeats = 5
    else:
        n = 1 << (20 if quick else 22)
        repeats = 3 if quick else 5
    zstandard = _zstandard()
    bandwidth = _common.copy_bandwidth(device)
    backend = glm_kernels.select_backend("delta.encode", torch.zeros(1, device=device))
    rows = [measure_input(name, new, old, device, bandwidth, zstandard, repeats)
            for name, new, old in inputs(n, device)]
    size_cols = ["input", "density"] + [f"{e}_B/chg" for e in ENCODINGS] + \
        ["xor_zstd1_B/chg", "int32_zstd1_B/chg"]
    _common.print_table(f"delta codec: bytes per changed element, {n} bf16 elements on "
                        f"{device} (packets include the 72-byte header)", rows, size_cols)
    time_cols = ["input"] + [f"{e}_{k}" for e in ENCODINGS for k in
                             ("enc_ms", "enc/floor", "chained_ms", "chained/floor", "app_ms",
                              "app/floor")] + ["torch_peer_enc_ms", "torch_peer_app_ms"]
    _common.print_table(f"delta codec throughput on {device} (backend {backend}; copy "
                        f"bandwidth {bandwidth / 1e9:.1f} GB/s measured)", rows, time_cols)
    result = {"benchmark": "delta", "device": device, "backend": backend, "elements": n,
              "copy_bandwidth_Bps": bandwidth, "rows": rows,
              "zstandard": zstandard.__version__ if zstandard else NO_ZSTD,
              "env": _common.environment()}
    if device == "cpu":
        goal = cpu_goal(1 << (21 if quick else 23), repeats)
        result["cpu_goal"] = goal
        if "rows" in goal:
            _common.print_table(f"CPU goal: C++ host codec (2 threads) vs numpy, same format, "
                                f"{goal['elements']} bf16 elements, 1% one-ulp steps; min "
                                f"speedup {goal['min_speedup']:.1f}x (goal 4x)", goal["rows"],
                                list(goal["rows"][0]))
        if _dispatch.interpreter_active() and _dispatch.triton_available():
            result["interpreter_check"] = interpreter_check()
    result["fallbacks"] = _dispatch.fallbacks_logged()
    print(f"fallbacks logged: {result['fallbacks'] or 'none'}")
    return result


if __name__ == "__main__":
    _common.main(__doc__, run)
