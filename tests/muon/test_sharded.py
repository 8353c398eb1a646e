"""MuonSplit on FSDP2 (DTensor Shard(0)) parameters, gloo on CPU, world sizes 2, 3, 4.

One spawn per world size runs everything on one model (aligned heads, straddling heads, lone
heads, plain and 3-D matrices, uneven and empty shards, AdamW parameters): five steps against
one-process MuonSplit fed the same full gradients (bitwise, in fp32 and again in bf16, with
the parameter and state dtypes one process keeps), the state round trip (sharded ->
sharded, full -> sharded, sharded -> full), the bytes moved by the step, counted by wrapping
torch.distributed's collectives and DTensor's functional ones, a bad placement, and plain data
parallelism through torch's ZeroRedundancyOptimizer; world 2 also runs blocks big enough for
threaded gemms, a torch.distributed.checkpoint round trip and the docs example. HSDP (a 2 x 2
mesh, Replicate x Shard(0)) runs in a spawn of its own.
"""
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import glm_kernels
from glm_kernels.muon import HeadSplit, sharded
from glm_kernels.muon.ns import NSConfig, head_block_views, orthogonalize
from glm_kernels.muon.coefficients import resolve_coefficients
from glm_kernels.optim import MuonSplit, muon_param_groups
from tests._gloo import run_ranks

API = sharded.dtensor_api()
needs_fsdp2 = pytest.mark.skipif(
    API.fully_shard is None or not dist.is_available() or not dist.is_gloo_available(),
    reason="needs torch.distributed with gloo and FSDP2 fully_shard (torch >= 2.4)")
STEPS, SAVE_AFTER = 5, 3
# FSDP2's forward needs CUDA before torch 2.6 ("FSDP requires CUDA for streams" in 2.4 and
# 2.5.1): the docs example (a real forward/backward) runs from 2.6; the optimizer runs on
# FSDP2 parameters from 2.4 (tested with 2.4.1).
FSDP2_CPU_FORWARD = torch.torch_version.TorchVersion(torch.__version__) >= (2, 6)


class Attention(nn.Module):
    def __init__(self, heads_q, heads_kv, q_rank=12, kv_rank=8, hidden=13):
        super().__init__()
        self.q_b_proj = nn.Linear(q_rank, heads_q * (6 + 2), bias=False)
        self.kv_b_proj = nn.Linear(kv_rank, heads_kv * (6 + 4), bias=False)
        self.o_proj = nn.Linear(heads_kv * 4, hidden, bias=True)


class Model(nn.Module):
    """layer 0: q_b 2W heads (aligned, 2 per rank), kv_b W+1 heads (straddling, uneven);
    layer 1: q_b W heads (aligned, one lone head per rank), kv_b 3 heads; plain matrices
    [13, 4(W+1)], [24, 13], [2, 5] (empty ranks for W > 2), a 3-D stack of 2W+1 experts
    [3, 4] (a lone local expert on the last rank for W = 3, none for W = 4); AdamW:
    embedding, norm, biases."""

    def __init__(self, world):
        super().__init__()
        self.embed = nn.Embedding(11, 13)
        self.layers = nn.ModuleList([Attention(2 * world, world + 1), Attention(world, 3)])
        self.norm = nn.LayerNorm(13)
        self.mlp = nn.Linear(13, 24)
        self.tiny = nn.Linear(5, 2, bias=False)
        self.conv = nn.Parameter(torch.randn(2 * world + 1, 3, 4))

    @staticmethod
    def head_splits(world):
        return {"layers.0.q_b_proj.weight": HeadSplit(2 * world, [6, 2]),
                "layers.0.kv_b_proj.weight": HeadSplit(world + 1, [6, 4]),
                "layers.1.q_b_proj.weight": HeadSplit(world, [6, 2]),
                "layers.1.kv_b_proj.weight": HeadSplit(3, [6, 4])}


class BigModel(nn.Module):
    """Blocks big enough that a batch-of-one gemm runs on 2 threads (64 x 1024 is): q_b of
    3 heads [64, 16] x 1024 over 2 ranks (a lone local head on each rank, head 1 straddles)
    and a plain 128 x 1024 matrix."""

    def __init__(self, world):
        super().__init__()
        self.q_b_proj = nn.Linear(1024, 3 * 80, bias=False)
        self.o_proj = nn.Linear(1024, 128, bias=False)

    @staticmethod
    def head_splits(world):
        return {"q_b_proj": HeadSplit(3, [64, 16])}


def _make(world, mesh=None, cls=Model, ns_steps=5, dtype=torch.float32):
    torch.manual_seed(0)
    model = cls(world).to(dtype)
    if mesh is not None:
        API.fully_shard(model, mesh=mesh)
    opt = MuonSplit(muon_param_groups(model, cls.head_splits(world)), lr=0.02, adamw_lr=3e-3,
                    ns_steps=ns_steps)
    return model, opt


def _grads(model, step):
    gen = torch.Generator().manual_seed(1000 + step)
    return {name: torch.randn(p.shape, generator=gen) for name, p in model.named_parameters()}


def _step(model, opt, step, mesh=None):
    grads = _grads(model, step)
    for name, p in model.named_parameters():
        g = grads[name].to(p.dtype)
        p.grad = g if mesh is None else API.DTensor.from_local(
            g[_rows(p)], p.device_mesh, p.placements, run_check=False, shape=p.shape,
            stride=p.stride())
    opt.step()


def _rows(p):
    """The rows of the full parameter that this rank's shard of ``p`` holds (all if plain or
    replicated), by torch.chunk sizes over the mesh dim that holds Shard(0)."""
    if not sharded.is_dtensor(p):
        return slice(None)
    mesh = p.device_mesh
    dims = [d for d, placement in enumerate(p.placements) if isinstance(placement, API.Shard)]
    if not dims:
        return slice(None)
    return slice(*sharded.chunk_ranges(p.shape[0], mesh.size(dims[0]))[
        mesh.get_local_rank(dims[0])])


def _mismatches(model, reference):
    """Names of parameters of ``model`` whose local rows are not bitwise equal to the same
    rows of ``reference``'s (one-process) parameters; no communication."""
    ref = dict(reference.named_parameters())
    return [name for name, p in model.named_parameters()
            if not torch.equal(sharded.local(p).detach(), ref[name].detach()[_rows(p)])]


class _ByteCounter:
    """Wraps torch.distributed's collectives and the functional collectives that DTensor's
    implicit redistribution calls: counts calls and the bytes of the tensor each one sends."""
    NAMES = ("all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor",
             "all_reduce", "broadcast", "reduce_scatter_tensor", "scatter", "gather", "send",
             "recv", "isend", "irecv")

    def __enter__(self):
        import torch.distributed._functional_collectives as funcol
        self.calls, self.bytes = 0, 0
        self.saved = [(dist, n, getattr(dist, n)) for n in self.NAMES if hasattr(dist, n)]
        self.saved += [(funcol, n, getattr(funcol, n)) for n in dir(funcol)
                       if n.startswith(("all_", "reduce_scatter", "broadcast", "permute"))
                       and callable(getattr(funcol, n))]
        for module, name, fn in self.saved:
            setattr(module, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc):
        for module, name, fn in self.saved:
            setattr(module, name, fn)

    def _wrap(self, name, fn):
        def wrapped(*args, **kwargs):
            self.calls += 1
            tensors = [a for a in args if torch.is_tensor(a)]
            source = tensors[1] if name == "all_to_all_single" and len(tensors) > 1 \
                else tensors[0]
            self.bytes += source.numel() * source.element_size()
            return fn(*args, **kwargs)
        return wrapped


def _movable_bounds(model, world):
    """[lower, upper] bytes the in-direction must move in total: each plain matrix or
    straddling head moves all but its owner's rows; the owner is unknown here. A 3-D stack
    of experts moves nothing (Shard(0) hands out whole experts)."""
    splits = Model.head_splits(world)
    lower = upper = 0
    for name, p in model.named_parameters():
        if p.dim() != 2 or name == "embed.weight":
            continue
        cols = math.prod(p.shape[1:]) * 4
        ranges = sharded.chunk_ranges(p.shape[0], world)
        split = splits.get(name)
        unit = split.rows_per_head if split else p.shape[0]
        for start in range(0, p.shape[0], unit):
            held = [min(start + unit, b) - max(start, a) for a, b in ranges]
            held = [h for h in held if h > 0]
            if len(held) > 1:
                lower += (unit - max(held)) * cols
                upper += (unit - (min(held) if split else 0)) * cols
    return lower, upper


def _body(rank, world, out_dir):
    mesh = API.init_device_mesh("cpu", (world,))
    verdicts = {}
    with glm_kernels.force_backend("torch"):
        ref, ref_opt = _make(world)
        model, opt = _make(world, mesh)
        sent, received = [], []
        for step in range(1, SAVE_AFTER + 1):
            _step(ref, ref_opt, step)
            with _ByteCounter() as counter:
                _step(model, opt, step, mesh)
            verdicts[f"step{step}_counter"] = [counter.calls, counter.bytes]
            verdicts[f"step{step}_stats"] = dict(opt.comm_stats)
            sent.append(opt.comm_stats["bytes_sent"])
            received.append(opt.comm_stats["bytes_received"])
        verdicts["mismatch_after_3"] = _mismatches(model, ref)
        verdicts["sent"], verdicts["received"] = sent, received
        verdicts["bounds"] = _movable_bounds(model, world)

        # state round trips: sharded -> sharded (torch.save), full -> sharded, sharded -> full
        path = os.path.join(out_dir, f"opt{rank}.pt")
        torch.save(opt.state_dict(), path)
        from_sharded, from_sharded_opt = _make(world, mesh)
        from_full, from_full_opt = _make(world, mesh)
        to_full, to_full_opt = _make(world)
        with torch.no_grad():
            for copy in (from_sharded, from_full, to_full):
                for p, source in zip(copy.parameters(), model.parameters()):
                    if sharded.is_dtensor(p):
                        p.to_local().copy_(source.to_local())
                for p, source in zip(to_full.parameters(), ref.parameters()):
                    p.copy_(source)
        from_sharded_opt.load_state_dict(torch.load(path, weights_only=False))
        from_full_opt.load_state_dict(ref_opt.state_dict())
        to_full_opt.load_state_dict(sharded.full_state_dict(opt.state_dict()))
        momentum = next(iter(from_full_opt.state.values()))["momentum_buffer"]
        verdicts["full_to_sharded_is_dtensor"] = sharded.is_dtensor(momentum)
        for step in range(SAVE_AFTER + 1, STEPS + 1):
            _step(ref, ref_opt, step)
            _step(to_full, to_full_opt, step)
            for m, o in ((model, opt), (from_sharded, from_sharded_opt),
                         (from_full, from_full_opt)):
                _step(m, o, step, mesh)
        for label, m in (("mismatch", model), ("mismatch_from_sharded", from_sharded),
                         ("mismatch_from_full", from_full), ("mismatch_to_full", to_full)):
            verdicts[label] = _mismatches(m, ref)
        verdicts["fp32_dtypes"] = _dtype_verdict(ref, ref_opt, {
            "sharded": (model, opt), "from_sharded": (from_sharded, from_sharded_opt),
            "from_full": (from_full, from_full_opt), "to_full": (to_full, to_full_opt)})
        verdicts["max_abs_diff"] = max(
            float((sharded.local(p).detach() - q.detach()[_rows(p)]).abs().sum(0).max())
            if sharded.local(p).numel() else 0.0
            for p, q in zip(model.parameters(), ref.parameters()))

        # an aligned head-split matrix alone (64 heads over 8 ranks in GLM-5): nothing moves
        aligned = model.layers[0].q_b_proj.weight
        aligned_opt = MuonSplit([{"params": [aligned],
                                  "head_split": HeadSplit(2 * world, [6, 2])}], lr=0.02)
        aligned.grad = _step_grad(aligned, mesh)
        with _ByteCounter() as counter:
            aligned_opt.step()
        verdicts["aligned"] = [counter.calls, counter.bytes,
                               aligned_opt.comm_stats["collectives"]]
        with _ByteCounter() as counter:             # the counter sees DTensor's own traffic
            aligned.grad.detach() @ aligned.grad.detach().T
        verdicts["counter_sees_redistribution"] = counter.calls

        # bad input: a placement other than Shard(0) / Replicate is refused, named
        bad = nn.Parameter(API.distribute_tensor(torch.randn(4, 6), mesh, [API.Shard(1)]))
        bad.grad = torch.zeros_like(bad)
        try:
            MuonSplit([bad], lr=0.02).step()
            verdicts["bad_placement"] = "no error"
        except ValueError as exc:
            verdicts["bad_placement"] = str(exc)
        verdicts["zero"] = _zero_check(world)
        verdicts["bf16_dtypes"] = _dtype_check(world, mesh, torch.bfloat16)
    if world == 2:          # in the same spawn: starting processes costs more than the check
        verdicts["big"] = _big_check(world, mesh)
        verdicts["dcp_mismatch"] = _dcp_check(world, mesh)
        verdicts["interpret"] = _interpret_check(world, mesh)
        if FSDP2_CPU_FORWARD:
            verdicts["docs_example"] = _docs_example(rank, world)
    return verdicts


def _dtypes(model, opt):
    """{name: [parameter dtype, [(state key, dtype), ...]]} of every parameter, with the
    local shard's dtype for DTensors (what the rank computes with and stores)."""
    out = {}
    for name, p in model.named_parameters():
        state = opt.state.get(p, {})
        out[name] = [str(sharded.local(p).dtype),
                     sorted((key, str(sharded.local(value).dtype)) for key, value in
                            state.items() if torch.is_tensor(value) and value.dim())]
    return out


def _dtype_check(world, mesh, dtype):
    """Parameters in ``dtype`` (bf16: the Nesterov combination and every elementwise step
    must round the same on a shard as on the whole tensor): five steps bitwise equal to one
    process, also across the state round trips (full -> sharded, sharded -> full) after
    step 3, with the parameter and state dtypes one process keeps."""
    ref, ref_opt = _make(world, dtype=dtype)
    model, opt = _make(world, mesh, dtype=dtype)
    for step in range(1, SAVE_AFTER + 1):
        _step(ref, ref_opt, step)
        _step(model, opt, step, mesh)
    from_full, from_full_opt = _make(world, mesh, dtype=dtype)
    to_full, to_full_opt = _make(world, dtype=dtype)
    with torch.no_grad():
        for p, source in zip(from_full.parameters(), model.parameters()):
            sharded.local(p).copy_(sharded.local(source))
        for p, source in zip(to_full.parameters(), ref.parameters()):
            p.copy_(source)
    from_full_opt.load_state_dict(ref_opt.state_dict())
    to_full_opt.load_state_dict(sharded.full_state_dict(opt.state_dict()))
    for step in range(SAVE_AFTER + 1, STEPS + 1):
        _step(ref, ref_opt, step)
        _step(to_full, to_full_opt, step)
        for m, o in ((model, opt), (from_full, from_full_opt)):
            _step(m, o, step, mesh)
    return _dtype_verdict(ref, ref_opt, {"sharded": (model, opt),
                                         "from_full": (from_full, from_full_opt),
                                         "to_full": (to_full, to_full_opt)})


def _dtype_verdict(ref, ref_opt, runs):
    """Per run (label -> (model, opt)): parameters not bitwise one process's, and parameter
    or state dtypes unlike one process's; plus one process's parameter dtypes."""
    theirs = _dtypes(ref, ref_opt)
    verdict = {"param_dtypes": sorted({v[0] for v in theirs.values()})}
    for label, (m, o) in runs.items():
        ours = _dtypes(m, o)
        verdict[label] = {"mismatch": _mismatches(m, ref),
                          "dtypes": {name: [ours[name], theirs[name]] for name in ours
                                     if ours[name] != theirs[name]}}
    return verdict


class KernelModel(nn.Module):
    """Aligned q_b (4 heads over 2 ranks), straddling kv_b (3 heads), a plain matrix."""

    def __init__(self, world):
        super().__init__()
        self.attn = Attention(2 * world, world + 1)

    @staticmethod
    def head_splits(world):
        return {"q_b_proj": HeadSplit(2 * world, [6, 2]),
                "kv_b_proj": HeadSplit(world + 1, [6, 4])}


def _interpret_check(world, mesh):
    """The Triton kernels (interpreter: bf16 results, 2-byte rows on the way back) in the
    sharded step against one process running the same kernels: bitwise."""
    from glm_kernels import _dispatch
    reason = _dispatch.interpreter_unavailable_reason()
    if reason is not None or os.environ.get("TRITON_INTERPRET") != "1":
        return f"skipped: {reason or 'TRITON_INTERPRET is not set'}"
    with glm_kernels.force_backend("interpret"):     # one NS step: the interpreter is slow
        ref, ref_opt = _make(world, cls=KernelModel, ns_steps=1)
        model, opt = _make(world, mesh, cls=KernelModel, ns_steps=1)
        _step(ref, ref_opt, 1)
        _step(model, opt, 1, mesh)
    return _mismatches(model, ref)


def _dcp_check(world, mesh):
    """torch.distributed.checkpoint's full optimizer state_dict (keyed by name, gathered) out
    of a sharded MuonSplit and back into a fresh one: two more steps still bitwise."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    options = StateDictOptions(full_state_dict=True)
    with glm_kernels.force_backend("torch"):
        ref, ref_opt = _make(world)
        model, opt = _make(world, mesh)
        for step in range(1, 3):
            _step(ref, ref_opt, step)
            _step(model, opt, step, mesh)
        saved = get_optimizer_state_dict(model, opt, options=options)
        fresh, fresh_opt = _make(world, mesh)
        with torch.no_grad():
            for p, source in zip(fresh.parameters(), model.parameters()):
                p.to_local().copy_(source.to_local())
        set_optimizer_state_dict(fresh, fresh_opt, saved, options=options)
        for step in range(3, 5):
            _step(ref, ref_opt, step)
            _step(fresh, fresh_opt, step, mesh)
        return _mismatches(fresh, ref)


def _docs_example(rank, world):
    """docs/muon.md's FSDP2 example (real forward/backward through fully_shard), run here."""
    doc = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "muon.md")
    with open(doc) as f:
        text = f.read()
    start = text.index("# sharded_muon_example.py")
    namespace = {"__name__": "sharded_muon_example"}
    exec(compile(text[start:text.index("```", start)], doc, "exec"), namespace)
    from glm_kernels import _dispatch
    # the backend a CPU tensor gets here: torch by default, the interpreter when the
    # environment forces it (GLM_KERNELS_BACKEND=interpret, as kernel test runs may set)
    return dict(namespace["train"](rank, world),
                backend=_dispatch.select_backend("muon_split", torch.empty(0)))


def _zero_check(world):
    """Plain data parallelism, ZeRO-1 style: torch's ZeroRedundancyOptimizer gives each rank
    whole parameters, MuonSplit steps them, ZeRO broadcasts them: bitwise one process too."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    ref, ref_opt = _make(world)
    torch.manual_seed(0)
    model = Model(world)
    opt = ZeroRedundancyOptimizer(muon_param_groups(model, Model.head_splits(world),
                                                    adamw_lr=3e-3),
                                  optimizer_class=MuonSplit, lr=0.02, adamw_lr=3e-3)
    for step in range(1, 4):
        _step(ref, ref_opt, step)
        _step(model, opt, step)
    owned = sum(len(g["params"]) for g in opt.optim.param_groups)
    return {"mismatch": _mismatches(model, ref), "owned": owned}


def _step_grad(p, mesh):
    g = torch.randn(p.shape, generator=torch.Generator().manual_seed(7))
    return API.DTensor.from_local(g[_rows(p)], mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())


def _big_check(world, mesh):
    """Blocks big enough that torch's CPU gemm of a batch of one runs on 2 threads: a lone
    head must not be computed as a batch of one where one process batches it with others
    (the check fails without the doubling in sharded.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with glm_kernels.force_backend("torch"):
            ref, ref_opt = _make(world, cls=BigModel)
            model, opt = _make(world, mesh, cls=BigModel)
            for step in range(1, 3):
                _step(ref, ref_opt, step)
                _step(model, opt, step, mesh)
            return {"mismatch": _mismatches(model, ref),
                    "collectives": opt.comm_stats["collectives"]}
    finally:
        torch.set_num_threads(threads)


def _check(per_rank, world):
    for rank, v in enumerate(per_rank):
        where = f"world {world} rank {rank}"
        for key in ("mismatch_after_3", "mismatch", "mismatch_from_sharded",
                    "mismatch_from_full", "mismatch_to_full"):
            assert v[key] == [], f"{where}: {key} {v[key]} (max abs diff {v['max_abs_diff']})"
        assert v["full_to_sharded_is_dtensor"], where
        assert "Shard(0)" in v["bad_placement"] and "Shard(dim=1)" in v["bad_placement"], \
            v["bad_placement"]
        # aligned head-split matrix: no collective, no byte, no DTensor redistribution
        assert v["aligned"] == [0, 0, 0], f"{where}: aligned head split moved {v['aligned']}"
        assert v["counter_sees_redistribution"] > 0, where
        for step in range(1, SAVE_AFTER + 1):
            calls, nbytes = v[f"step{step}_counter"]
            stats = v[f"step{step}_stats"]
            # every collective of the step is one of ours: nothing implicit, nothing hidden
            assert calls == stats["collectives"], (where, step, calls, stats)
            assert nbytes >= stats["bytes_sent"], (where, step)
        if world == 2:
            assert v["big"] == {"mismatch": [], "collectives": 4}, (where, v["big"])
        assert v["zero"]["mismatch"] == [], (where, v["zero"])
        for dtype in ("bf16", "fp32"):
            verdict = v[f"{dtype}_dtypes"]
            expected = "torch.bfloat16" if dtype == "bf16" else "torch.float32"
            assert verdict["param_dtypes"] == [expected], (where, verdict)
            for label in set(verdict) - {"param_dtypes"}:
                assert verdict[label] == {"mismatch": [], "dtypes": {}}, (where, dtype, label,
                                                                          verdict[label])
    if world == 2:
        assert all(v["dcp_mismatch"] == [] for v in per_rank), [v["dcp_mismatch"]
                                                               for v in per_rank]
        interpret = [v["interpret"] for v in per_rank]
        if not str(interpret[0]).startswith("skipped"):
            assert interpret == [[]] * world, interpret
    if world == 2 and FSDP2_CPU_FORWARD:
        # the docs example: kv_b's head 1 straddles (5 rows x 16 moved), o_proj 8 rows x 12;
        # q_b's 4 heads align: in as fp32, out as the NS result (fp32 on the torch path,
        # bf16 from the kernels: the interpreter when the environment forces it)
        stats = [v["docs_example"] for v in per_rank]
        backends = {s["backend"] for s in stats}
        assert len(backends) == 1 and backends <= {"torch", "interpret"}, stats
        out_bytes = 4 if backends == {"torch"} else 2
        assert sum(s["bytes_sent"] for s in stats) == (5 * 16 + 8 * 12) * (4 + out_bytes), \
            stats
        assert all(s["collectives"] == 4 for s in stats), stats
    params = sum(1 for _ in Model(world).parameters())
    assert sum(v["zero"]["owned"] for v in per_rank) == params      # each stepped by one rank
    lower, upper = per_rank[0]["bounds"]
    for step in range(SAVE_AFTER):
        sent = sum(v["sent"][step] for v in per_rank)
        received = sum(v["received"][step] for v in per_rank)
        assert sent == received, (world, step, sent, received)
        # once in, once out (fp32 both ways on the torch path)
        assert 2 * lower <= sent <= 2 * upper, (world, step, lower, upper, sent)
        assert lower > 0


@needs_fsdp2
@pytest.mark.parametrize("world", [2, 3, 4])
def test_fsdp2_bitwise_state_and_bytes(tmp_path, world):
    _check(run_ranks(_body, world, tmp_path, f"sharded MuonSplit world {world}"), world)


def _hsdp_body(rank, world, out_dir):
    """HSDP: 4 ranks as a 2 x 2 mesh (replicate, shard); fully_shard places every parameter
    (Replicate(), Shard(0)). Five steps bitwise equal to one process; the replicas hold equal
    shards; a full optimizer state loads onto the 2-D mesh and keeps stepping bitwise."""
    mesh = API.init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    shard_world = 2
    with glm_kernels.force_backend("torch"):
        ref, ref_opt = _make(shard_world)
        model, opt = _make(shard_world, mesh)
        placements = {str(tuple(p.placements)) for p in model.parameters()}
        for step in range(1, SAVE_AFTER + 1):
            _step(ref, ref_opt, step)
            _step(model, opt, step, mesh)
        verdicts = {"placements": sorted(placements), "mismatch_after_3": _mismatches(model, ref),
                    "collectives": opt.comm_stats["collectives"]}
        from_full, from_full_opt = _make(shard_world, mesh)
        with torch.no_grad():
            for p, source in zip(from_full.parameters(), model.parameters()):
                p.to_local().copy_(source.to_local())
        from_full_opt.load_state_dict(ref_opt.state_dict())
        for step in range(SAVE_AFTER + 1, STEPS + 1):
            _step(ref, ref_opt, step)
            for m, o in ((model, opt), (from_full, from_full_opt)):
                _step(m, o, step, mesh)
        verdicts["mismatch"] = _mismatches(model, ref)
        verdicts["mismatch_from_full"] = _mismatches(from_full, ref)
        # the two replicas of each shard: gathered over the replicate dim, bitwise equal
        replicas = mesh.get_group("replicate")
        unequal = []
        for name, p in model.named_parameters():
            mine = sharded.local(p).detach().contiguous()
            both = [torch.empty_like(mine) for _ in range(2)]
            dist.all_gather(both, mine, group=replicas)
            if not torch.equal(both[0], both[1]):
                unequal.append(name)
        verdicts["replicas_unequal"] = unequal
    return verdicts


@needs_fsdp2
def test_hsdp_two_dim_mesh_bitwise(tmp_path):
    per_rank = run_ranks(_hsdp_body, 4, tmp_path, "sharded MuonSplit HSDP 2 x 2")
    for rank, v in enumerate(per_rank):
        assert v["placements"] == ["(Replicate(), Shard(dim=0))"], (rank, v["placements"])
        for key in ("mismatch_after_3", "mismatch", "mismatch_from_full", "replicas_unequal"):
            assert v[key] == [], (rank, key, v[key])
        # rows move between the two ranks of a shard group: all_to_all in and out
        assert v["collectives"] > 0, (rank, v)


# --------------------------------------------------------------------------- no processes
def test_plan_balances_and_keeps_aligned_heads_local():
    """64 heads over 8 ranks: every head local. 4 plain matrices over 3 ranks: each owned once,
    FLOPs balanced; 5 heads over 2 ranks: only the straddling head moves, to a holder."""
    ranges8 = sharded.chunk_ranges(64 * 256, 8)
    split = HeadSplit(64, [192, 64])
    for rank in range(8):
        plan = sharded.plan_group(((64 * 256, 2048, ranges8),), split, 5, rank, 8)
        assert plan.items == () and plan.local == ((8 * rank, 8 * rank + 8),)
        assert not plan.moves and len(set(plan.loads)) == 1
    mats = tuple((r, 64, sharded.chunk_ranges(r, 3)) for r in (64, 64, 32, 32))
    plan = sharded.plan_group(mats, None, 5, 0, 3)
    assert sorted(item.index for item in plan.items) == [0, 1, 2, 3]
    assert sorted(plan.loads)[0] > 0                             # nobody idle
    plan = sharded.plan_group(((50, 7, sharded.chunk_ranges(50, 2)),), HeadSplit(5, [6, 4]),
                              5, 0, 2)
    (item,) = plan.items
    assert (item.start, item.stop) == (20, 30) and item.owner in (0, 1)
    assert plan.local == ((0, 2),)                  # heads 0, 1 on rank 0; head 2 straddles
    assert len(item.pieces) == 1 and item.pieces[0][0] != item.owner


def test_docstring_examples():
    import doctest
    failed, attempted = doctest.testmod(sharded, verbose=False)
    assert attempted > 0 and failed == 0, f"{failed} of {attempted}"


def test_lone_head_batch_is_bitwise_the_full_batch():
    """The property the sharded path relies on, at this process's thread count: a head
    computed in a batch of >= 2 (another head, or a copy of itself) equals the same head in
    the one-process batch of all heads. Large blocks, so multi-threaded gemms would show."""
    gen = torch.Generator().manual_seed(5)
    heads, rows, cols = 3, (192, 64), 2048
    U = torch.randn(heads * sum(rows), cols, generator=gen)
    schedule = resolve_coefficients("jordan", 5)

    def ns(sources):
        return orthogonalize(sources, schedule, method="standard", eps=1e-7,
                             config=NSConfig(), backend="torch")
    full = ns(head_block_views(U, heads, rows))
    one = U[sum(rows):2 * sum(rows)]
    for part, view in enumerate(head_block_views(one, 1, rows)):
        doubled = ns([torch.cat([view, view])])[0]
        assert torch.equal(doubled[0], full[part][1]), part
        assert torch.equal(doubled[1], full[part][1]), part


def test_bad_arguments():
    model = Model(2)
    with pytest.raises(ValueError, match="adamw_lr"):
        muon_param_groups(model, None, adamw_lr=float("nan"))
    groups = muon_param_groups(model, Model.head_splits(2), adamw_lr=1e-3)
    assert all(g["lr"] == 1e-3 for g in groups if not g["use_muon"])
    assert all("lr" not in g for g in groups if g["use_muon"])
