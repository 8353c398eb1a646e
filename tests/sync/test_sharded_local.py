"""Sharded sync in one process: layouts and pieces, FP8 block quantization (reference,
hand-derived cases, the Triton kernel under the interpreter, bitwise), argument checks, a
missing trainer part refused whole, and the publish path's peak host memory."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import glm_kernels
from glm_kernels import sync
from glm_kernels.sync import _reference as ref
from glm_kernels.sync import layout
from tests.conftest import skip_without_kernels


# ---------------------------------------------------------------------------- layouts
@pytest.mark.parametrize("box,size,limit", [(((0, 7), (3, 50)), 2, 60), (((2, 9),), 4, 8),
                                            (((0, 3), (0, 5), (0, 200)), 1, 64),
                                            (((0, 1), (0, 1)), 8, 1)])
def test_chunks_tile_the_box_within_the_limit(box, size, limit):
    got = list(layout.chunks(box, size, limit))
    assert layout.tiles(box, got)
    assert all(layout.volume(c) * size <= max(limit, size) for c in got)


def test_piece_names_round_trip_and_malformed_names_are_plain():
    full, target, box = (300, 16), ((150, 300), (0, 16)), ((150, 200), (0, 16))
    name = layout.piece_name("emb.weight", full, target, box)
    assert name == "emb.weight@300x16[150:300,0:16]/[150:200,0:16]"
    assert layout.parse_piece(name) == ("emb.weight", full, target, box)
    assert layout.parse_piece("s@[]/[]") == ("s", (), (), ())
    for bad in ["emb.weight", "w@300x16[0:400,0:16]/[0:10,0:16]",      # target outside
                "w@300x16[0:100,0:16]/[90:110,0:16]",                   # piece outside target
                "w@300x16[0:100]/[0:10]", "w@300x16[0:-1,0:16]/[0:1,0:16]", "w@3" + "x1" * 9
                + "[]/[]"]:
        assert layout.parse_piece(bad) is None, bad


def test_tiles_refuses_gaps_and_overlaps():
    target = ((0, 10), (0, 4))
    assert layout.tiles(target, [((0, 5), (0, 4)), ((5, 10), (0, 4))])
    assert not layout.tiles(target, [((0, 5), (0, 4))])
    assert not layout.tiles(target, [((0, 6), (0, 4)), ((5, 10), (0, 4)), ((0, 0), (0, 4))])
    assert not layout.tiles(target, [((0, 6), (0, 4)), ((4, 8), (0, 4))])


# ---------------------------------------------------------------------------- FP8
def test_fp8_reference_hand_derived():
    # one 2x2 block with amax 448: scale 1, every value representable -> q == w
    w = torch.tensor([[1.0, -2.0], [0.5, 448.0]])
    q, s = ref.quantize_fp8_blocks(w, (2, 2))
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert q.float().tolist() == [[1.0, -2.0], [0.5, 448.0]] and s.tolist() == [[1.0]]
    # amax 224 -> values doubled; an all-zero block keeps the 1e-4 floor; partial blocks
    w = torch.zeros(3, 3)
    w[0, 0], w[1, 1] = 224.0, -1.0
    q, s = ref.quantize_fp8_blocks(w, (2, 2))
    assert s.shape == (2, 2) and s[0, 0].item() == 0.5
    assert s[1, 1].item() == pytest.approx(1e-4 / 448.0, rel=1e-6)
    assert q.float()[0, 0].item() == 448.0 and q.float()[1, 1].item() == -2.0
    assert q.float()[2, 2].item() == 0.0 and q.shape == (3, 3)
    # round to nearest even: 448/amax * x lands halfway between 80 and 88 -> 80
    w = torch.tensor([[84.0, 448.0]])
    assert ref.quantize_fp8_blocks(w, (1, 2))[0].float().tolist() == [[80.0, 448.0]]


@pytest.mark.parametrize("shape,block", [((5, 7), (4, 8)), ((130, 70), (64, 32)),
                                         ((64, 64), (32, 32)), ((1, 1), (128, 128)),
                                         ((0, 9), (4, 4))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_kernel_matches_reference_bitwise_interpreted(shape, block, dtype):
    skip_without_kernels()
    g = torch.Generator().manual_seed(shape[0] * 31 + shape[1])
    w = (torch.randn(shape, generator=g) * torch.rand(shape, generator=g) * 3).to(dtype)
    if w.numel():
        w.view(-1)[0] = 0.0
        w.view(-1)[-1] = -0.0
    want_q, want_s = ref.quantize_fp8_blocks(w, block)
    with glm_kernels.force_backend("interpret"):
        q, s = sync.quantize_fp8_blocks(w, block)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s.view(torch.int32), want_s.view(torch.int32))


def test_fp8_kernel_writes_every_element():
    skip_without_kernels()
    from glm_kernels.sync import _kernels
    w = torch.randn(37, 45).bfloat16()
    real_empty = torch.empty

    def poisoned(*a, **k):
        t = real_empty(*a, **k)
        t.view(torch.uint8).fill_(0xFF) if t.numel() else None
        return t
    _kernels.torch.empty = poisoned
    try:
        with glm_kernels.force_backend("interpret"):
            q, s = _kernels.quantize_fp8_blocks(w, (16, 16))
    finally:
        _kernels.torch.empty = real_empty
    want_q, want_s = ref.quantize_fp8_blocks(w, (16, 16))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s, want_s)


def test_fp8_bad_arguments():
    with pytest.raises(ValueError, match="block"):
        sync.FP8Blocks(block=(100, 128))
    with pytest.raises(TypeError, match="names"):
        sync.FP8Blocks(names=3)
    with pytest.raises(ValueError, match="2-D"):
        sync.quantize_fp8_blocks(torch.zeros(4))
    with pytest.raises(TypeError, match="fp8"):
        sync.Sender(sync.LocalTransport(), fp8="yes")
    fp8 = sync.FP8Blocks(names=["w"])
    sender = sync.Sender(sync.LocalTransport(), fp8=fp8, slices={"w": (0, 100, 300, (300, 8))})
    with pytest.raises(ValueError, match="block boundaries"):
        sender.publish({"w": torch.zeros(200, 8)})


def test_fp8_weights_sent_as_deltas_of_fp8_bytes_and_scales(tmp_path):
    names = ["l.weight"]
    master = {"l.weight": (torch.randn(300, 260) * 0.02).bfloat16(), "b": torch.randn(7)}
    link = sync.DiskTransport(str(tmp_path))
    sender = sync.Sender(link, fp8=sync.FP8Blocks(names=names), encoding="gap16")
    held = {"l.weight": torch.zeros(300, 260, dtype=torch.uint8).view(torch.float8_e4m3fn),
            "l.weight_scale_inv": torch.zeros(3, 3), "b": torch.zeros(7)}
    receiver = sync.Receiver(sync.DiskTransport(str(tmp_path)), held)
    for step in range(3):
        if step:
            master["l.weight"].view(torch.int16)[::50] += 1
        assert sender.publish(master) == step + 1 and receiver.poll() == step + 1
        q, s = sync.quantize_fp8_blocks(master["l.weight"])
        assert torch.equal(held["l.weight"].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(held["l.weight_scale_inv"], s) and torch.equal(held["b"], master["b"])
    # the last step changed only some fp8 bytes and scales: a delta, not the weight again
    assert sender.last_stats.delta_tensors == sender.last_stats.tensors
    assert 0 < receiver.last_stats.changed < 300 * 260 // 10


# ---------------------------------------------------------------------------- checks
def test_sharded_argument_checks():
    link = sync.LocalTransport()
    with pytest.raises(ValueError, match=r"slices\['w'\]"):
        sync.Sender(link, slices={"w": (0, 0, 5, (10, 3))}).publish({"w": torch.zeros(4, 3)})
    with pytest.raises(ValueError, match="base"):
        sync.Sender(link, base="gpu")
    with pytest.raises(ValueError, match="delta"):
        sync.Sender(link, delta=False, slices={})

    class TwoRanks:
        def size(self):
            return 2
    with pytest.raises(TypeError, match="several publishing ranks"):
        sync.Sender(link, group=TwoRanks())
    with pytest.raises(ValueError, match=r"slices\['w'\].*shape"):
        sync.Receiver(link, {"w": torch.zeros(4, 3)}, slices={"w": (1, 0, 2, (4, 3))})
    with pytest.raises(ValueError, match="not in params"):
        sync.Receiver(link, {"w": torch.zeros(4, 3)}, slices={"v": (0, 0, 4, (4, 3))})
    with pytest.raises(TypeError, match="group"):
        sync.Receiver(link, {"w": torch.zeros(4, 3)}, group="engines")


def test_missing_trainer_part_is_refused_whole_and_a_full_snapshot_repairs(tmp_path):
    """A version that carries only rank 0's half of a tensor (its other part missing) does
    not tile the receiver's box: refused, nothing written; the full snapshot it asks for
    (from a sender holding the whole tensor) applies."""
    full = torch.randn(10, 6)
    link = sync.LocalTransport()
    receiver = sync.Receiver(link, {"w": torch.zeros(10, 6), "b": torch.zeros(2)},
                             slices={"w": (0, 0, 10, (10, 6))})
    half = sync.Sender(link, slices={"w": (0, 0, 5, (10, 6))})
    half.publish({"w": full[:5], "b": torch.ones(2)})
    with pytest.raises(sync.SyncError, match="do not tile"):
        receiver.poll()
    assert receiver.version == 0 and not receiver.params["w"].any()
    assert not receiver.params["b"].any()
    whole = sync.Sender(link, slices={"w": (0, 0, 10, (10, 6))})
    whole.publish({"w": full, "b": torch.ones(2)})
    assert receiver.poll() == 1 and torch.equal(receiver.params["w"], full)


# ---------------------------------------------------------------------------- memory
_MEMORY = textwrap.dedent("""
    import json, sys, tempfile, torch
    from glm_kernels import sync
    def rss():
        with open("/proc/self/status") as f:
            d = dict(l.split(":", 1) for l in f)
        return int(d["VmRSS"].split()[0]) * 1024, int(d["VmHWM"].split()[0]) * 1024
    def reset_peak():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    torch.set_num_threads(1)
    rows, cols, bucket = 2048, 4096, 1 << 20                 # a 16 MiB bf16 shard
    shard = (torch.randn(rows, cols) * 0.02).bfloat16()
    spec = {"w": (0, 0, rows, (rows, cols))}
    fp8 = sync.FP8Blocks(names=["w"]) if sys.argv[1:] == ["fp8"] else None
    if fp8 is not None:                                      # 8 MiB of FP8 bytes
        rows, cols = 8192, 1024
        shard = (torch.randn(rows, cols) * 0.02).bfloat16()
        spec = {"w": (0, 0, rows, (rows, cols))}
    root = tempfile.mkdtemp()
    small = {"w": shard[:8].clone()}
    warm = sync.Sender(sync.DiskTransport(root + "/warm"), slices={"w": (0, 0, 8, (8, cols))},
                       encoding="gap16", bucket_bytes=bucket)
    warm.publish(small); small["w"].view(torch.int16)[::3] += 1; warm.publish(small)
    out = {}
    sender = sync.Sender(sync.DiskTransport(root + "/d"), slices=spec, encoding="gap16",
                         bucket_bytes=bucket, fp8=fp8)
    reset_peak(); before, _ = rss()
    sender.publish({"w": shard})
    after, peak = rss()
    out["first"] = (peak - before, after - before)
    for density in (0.01, 0.3):
        mask = torch.rand(rows, cols) < density
        shard.view(torch.int16)[mask] += 1
        del mask
        reset_peak(); before, _ = rss()
        sender.publish({"w": shard})
        after, peak = rss()
        out[str(density)] = (peak - before, sender.last_stats.payload_bytes)
    print(json.dumps(out))
""")


def _publish_memory(*args):
    # glibc's fixed mmap threshold: a freed large temporary goes back to the system at once
    # (the default threshold rises after the first free, and freed heap then counts in RSS
    # as if it were still held), so VmHWM follows what is alive
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH",
                                                                                ""),
               MALLOC_MMAP_THRESHOLD_="131072")
    done = subprocess.run([sys.executable, "-c", _MEMORY, *args], capture_output=True,
                          text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    import json
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux VmHWM")
def test_publish_peak_host_memory_is_one_bucket_beyond_the_base():
    """Peak resident memory of a publish (VmHWM, reset before it), in a fresh process: the
    first publish adds the base (the shard's size) and at most about a bucket; a delta
    publish at most about a bucket, whatever the update's size (30 % density: 20 MB of
    packets go out bucket by bucket). Freed memory the allocator kept can hide an
    allocation from RSS, so this bounds what was newly touched, not every malloc."""
    got = _publish_memory()
    base, bucket, slack = 16 << 20, 1 << 20, 2 << 20
    assert got["first"][1] >= base * 0.95                     # the base is kept
    assert got["first"][0] <= base + bucket + slack, got
    assert got["0.3"][1] > 8 * bucket                         # a large update ...
    for density in ("0.01", "0.3"):
        assert got[density][0] <= bucket + slack, got          # ... within a bucket


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux VmHWM")
def test_fp8_publish_never_holds_the_shards_fp8_copy():
    """The same with FP8 rollout weights (a 16 MiB bf16 shard [8192, 1024], 8 MiB of FP8
    bytes): the base is the FP8 bytes and scales; a publish quantizes piece by piece, so
    beyond the base it holds a bucket and one block row's quantization working set (the CPU
    reference's fp32 temporaries, about 16 B x 128 x 1024 = 2 MiB), never the 8 MiB copy."""
    got = _publish_memory("fp8")
    base, bucket, block_row, slack = 8 << 20, 1 << 20, 2 << 20, 2 << 20
    assert got["first"][1] >= base * 0.95
    assert got["first"][0] <= base + bucket + block_row + slack, got
    assert got["0.3"][1] > got["0.01"][1] > 0                  # deltas of FP8 bytes went out
    for density in ("0.01", "0.3"):
        assert got[density][0] <= bucket + block_row + slack, got


def test_lazy_fp8_boxes_are_the_whole_quantizations_bytes():
    """Any box of a LazyFP8 (block-aligned or not, edge blocks partial) and its scales, in
    any band size, equal quantize_fp8_blocks of the whole shard bit for bit."""
    from glm_kernels.sync.fp8 import LazyFP8, quantize_fp8_blocks
    weight = (torch.randn(300, 520, generator=torch.Generator().manual_seed(3)) * 0.05
              ).bfloat16()
    weight[130:140, 260:270] *= 40                            # one block with another scale
    q, scales = quantize_fp8_blocks(weight, (128, 128))
    lazy = LazyFP8(weight, (128, 128))
    boxes = [(slice(0, 300), slice(0, 520)), (slice(0, 1), slice(0, 520)),
             (slice(5, 260), slice(100, 300)), (slice(127, 129), slice(511, 520)),
             (slice(256, 300), slice(0, 128)), (slice(200, 200), slice(0, 520))]
    for rows, cols in boxes:
        assert torch.equal(lazy[rows, cols].view(torch.uint8), q[rows, cols].view(torch.uint8))
    for band in (1, 128 * 520, 1 << 30):
        assert torch.equal(lazy.scales(band), scales)
    with pytest.raises(TypeError, match="unit-step slices"):
        lazy[::2, :]


def test_receiver_whose_box_no_sender_cut_for_refuses(tmp_path):
    """A sliced receiver whose layout the sender never saw (its LAYOUT file removed) gets
    no piece of its tensors: refused with every tensor unchanged, never "applied" empty.
    In-process (LocalTransport) the layout reaches the sender and the slice applies."""
    full = torch.randn(12, 5)
    spec = {"w": (0, 6, 12, (12, 5))}
    receiver = sync.Receiver(sync.DiskTransport(str(tmp_path)), {"w": torch.zeros(6, 5)},
                             slices=spec)
    for f in tmp_path.glob("LAYOUT-*.json"):
        f.unlink()
    sync.Sender(sync.DiskTransport(str(tmp_path)), slices={"w": (0, 0, 12, (12, 5))}) \
        .publish({"w": full})
    with pytest.raises(sync.SyncError, match="no piece of tensor 'w'"):
        receiver.poll()
    assert receiver.version == 0 and not receiver.params["w"].any()
    link = sync.LocalTransport()
    local = sync.Receiver(link, {"w": torch.zeros(6, 5)}, slices=spec)
    sender = sync.Sender(link, slices={"w": (0, 0, 12, (12, 5))}, encoding="gap16")
    for step in range(2):
        full.view(-1).view(torch.int32)[::7] += step
        sender.publish({"w": full})
        assert local.poll() == step + 1 and torch.equal(local.params["w"], full[6:])
    assert local.last_stats.changed == 4          # flat 35, 42, 49, 56 of its rows 6..11


def test_fp8_quantize_under_torch_compile_fullgraph():
    w = torch.randn(130, 70).bfloat16()
    compiled = torch.compile(lambda x: sync.quantize_fp8_blocks(x, (64, 32)), fullgraph=True)
    q, s = compiled(w)
    want_q, want_s = ref.quantize_fp8_blocks(w, (64, 32))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s, want_s)


# ---------------------------------------------------------------------------- targeted resync
_ROWS, _COLS, _CUT = 24, 6, 16


def _resync_world(path):
    """A sharded sender (whole ``w`` given with slices, and ``b``) over one directory, to
    receivers holding rows [0, 16) and [16, 24) of ``w``, and one holding ``w`` whole; every
    receiver holds ``b`` whole. Pieces of 64 bytes (2 rows of ``w``)."""
    g = torch.Generator().manual_seed(5)
    state = {"w": torch.randn(_ROWS, _COLS, generator=g), "b": torch.randn(5, generator=g)}
    sender = sync.Sender(sync.DiskTransport(path, full_every=100), encoding="gap16",
                         slices={"w": (0, 0, _ROWS, (_ROWS, _COLS))}, bucket_bytes=256)
    receivers = [sync.Receiver(sync.DiskTransport(path, poll_interval=0.01),
                               {"w": torch.zeros(b - a, _COLS), "b": torch.zeros(5)},
                               slices={"w": (0, a, b, (_ROWS, _COLS))})
                 for a, b in ((0, _CUT), (_CUT, _ROWS))]
    receivers.append(sync.Receiver(sync.DiskTransport(path), {"w": torch.zeros(_ROWS, _COLS),
                                                              "b": torch.zeros(5)}, slices={}))
    return state, sender, receivers


def _step(state, step):
    state["w"].view(-1).view(torch.int32)[step % 5::5] += 1
    state["b"].view(torch.int32)[step % 2::2] += 1


def _holds(receivers, state):
    rows = ((0, _CUT), (_CUT, _ROWS), (0, _ROWS))
    return [torch.equal(r.params["w"], state["w"][a:b]) and torch.equal(r.params["b"],
                                                                        state["b"])
            for r, (a, b) in zip(receivers, rows)]


def _requests(path):
    return sorted(p.name for p in path.glob("FULL_REQUESTED*"))


def test_refusing_receiver_gets_its_boxes_in_full_the_others_deltas(tmp_path):
    """The receiver of rows [16, 24) drifts and refuses v3: the next versions re-send in
    full only the pieces cut for its boxes (its rows of ``w``, and ``b``, whose whole box the
    others hold too), every other piece a delta on v3, until it has applied one; it takes
    the newest (v5) straight from v2, and every receiver holds the trainer's bytes."""
    state, sender, receivers = _resync_world(tmp_path)
    for step in range(2):
        _step(state, step)
        sender.publish(state)
        assert [r.poll() for r in receivers] == [step + 1] * 3
    receivers[1].params["w"].view(-1).view(torch.uint8)[0] ^= 1
    _step(state, 2)
    assert sender.publish(state) == 3
    assert receivers[0].poll() == 3 and receivers[2].poll() == 3
    with pytest.raises(sync.SyncError, match="delta refused"):
        receivers[1].poll()
    assert receivers[1].version == 2 and len(_requests(tmp_path)) == 1
    mine = len(list(layout.chunks(((_CUT, _ROWS), (0, _COLS)), 4, sender.chunk_bytes))) + 1
    for step in (3, 4):            # the request stands until its receiver applies a version
        _step(state, step)
        assert sender.publish(state) == step + 1
        stats = sender.last_stats
        assert not stats.full and stats.tensors == 8 + 4 + 12 + 1, stats
        assert stats.tensors - stats.delta_tensors == mine == 5, stats
    import json
    lid = _requests(tmp_path)[0].split("-")[1]
    records = json.loads((tmp_path / "MANIFEST.json").read_text())["versions"]
    assert [r.get("full") for r in records[-2:]] == [[lid], [lid]]
    assert receivers[0].poll() == 5 and receivers[2].poll() == 5
    assert receivers[1].poll() == 5 and receivers[1].last_stats.changed == 0
    assert receivers[1].last_stats.payload_bytes == (_ROWS - _CUT) * _COLS * 4 + 5 * 4
    assert receivers[0].last_stats.changed > 0 and receivers[2].last_stats.changed > 0
    assert _holds(receivers, state) == [True] * 3
    assert _requests(tmp_path) == []           # answered: removed by its receiver
    _step(state, 5)
    sender.publish(state)
    assert sender.last_stats.delta_tensors == sender.last_stats.tensors
    assert [r.poll() for r in receivers] == [6] * 3 and _holds(receivers, state) == [True] * 3


def test_full_snapshot_answers_and_removes_standing_requests(tmp_path):
    """A full snapshot answers every request it read: the sender removes them (a receiver
    that died after asking costs its boxes until then, not forever)."""
    state, sender, receivers = _resync_world(tmp_path)
    sender.publish(state)
    assert [r.poll() for r in receivers] == [1] * 3
    receivers[0].params["w"].view(-1).view(torch.uint8)[0] ^= 1
    _step(state, 1)
    sender.publish(state)
    with pytest.raises(sync.SyncError):
        receivers[0].poll()
    assert len(_requests(tmp_path)) == 1
    _step(state, 2)
    assert sender.publish(state, full=True) == 3 and sender.last_stats.full
    assert _requests(tmp_path) == []
    assert [r.poll() for r in receivers] == [3] * 3 and _holds(receivers, state) == [True] * 3
    _step(state, 3)
    sender.publish(state)
    assert sender.last_stats.delta_tensors == sender.last_stats.tensors


def test_receiver_with_only_full_pieces_of_a_delta_version_applies_it():
    """Receiver side of a targeted resync: a delta version (base 3) whose every piece for
    this receiver is full applies on any older version; one delta piece among them, or a
    box left uncovered, is refused with the receiver unchanged."""
    from glm_kernels.sync.protocol import Update, delta_entry, full_entry
    from glm_kernels.delta import encode
    spec = (0, 4, 10, (10, 3))
    receiver = sync.Receiver(sync.LocalTransport(), {"w": torch.zeros(6, 3)},
                             slices={"w": spec})
    target = layout.slice_box(spec)
    new = torch.randn(10, 3)
    halves = (((4, 7), (0, 3)), ((7, 10), (0, 3)))
    pieces = [full_entry(layout.piece_name("w", (10, 3), target, box),
                         new[box[0][0]:box[0][1]].contiguous()) for box in halves]
    other = full_entry(layout.piece_name("w", (10, 3), ((0, 4), (0, 3)), ((0, 4), (0, 3))),
                       new[:4].contiguous())
    with pytest.raises(sync.SyncError, match="do not tile"):
        receiver.apply_update(Update(4, 3, pieces[:1] + [other], "e0"))
    packet = encode(new[7:].contiguous(), torch.zeros(3, 3), encoding="gap16")
    mixed = pieces[:1] + [delta_entry(pieces[1].name, (3, 3), packet)]
    with pytest.raises(sync.VersionError, match="delta on v3"):
        receiver.apply_update(Update(4, 3, mixed, "e0"))
    assert receiver.version == 0 and not receiver.params["w"].any()
    assert receiver.apply_update(Update(4, 3, pieces + [other], "e0")) == 4
    assert torch.equal(receiver.params["w"], new[4:])
    with pytest.raises(sync.VersionError, match="not newer"):
        receiver.apply_update(Update(4, 2, pieces, "e0"))
