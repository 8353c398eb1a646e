"""Shared pieces of the sync tests: a small model state, random sparse steps, and the bodies of
the spawned processes (kept here so ``spawn`` can import them by name)."""
import faulthandler
import os
import queue
import signal
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

try:
    import zstandard  # noqa: F401
    HAVE_ZSTD = True
except ImportError:        # optional: zstd cases skip, the default encoding is gap16
    HAVE_ZSTD = False
ENC = "zstd" if HAVE_ZSTD else "gap16"      # the best encoding installed
needs_zstd = pytest.mark.skipif(not HAVE_ZSTD, reason="zstandard not installed")
ZSTD = pytest.param("zstd", marks=needs_zstd)

STEPS = 20
# Odd sizes, three dtypes (bf16 weights, fp32 norms, int64 counters), one empty tensor.
SHAPES = {"layer.0.w": ((37, 29), torch.bfloat16), "layer.0.norm": ((101,), torch.float32),
          "layer.1.w": ((3, 7, 11), torch.bfloat16), "step": ((5,), torch.int64),
          "empty": ((0, 3), torch.float32)}


def make_state(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in SHAPES.items():
        if dtype.is_floating_point:
            out[name] = torch.randn(shape, generator=g).to(dtype)
        else:
            out[name] = torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)
    return out


def blank_like(state):
    """Receiver-side tensors: same names/shapes/dtypes, bytes 0xFF (never the sender's)."""
    out = {}
    for k, v in state.items():
        t = torch.empty_like(v)
        t.view(-1).view(torch.uint8).fill_(0xFF) if t.numel() else None
        out[k] = t
    return out


_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def sparse_step(state, step: int, seed: int = 0):
    """Change a random sparse subset of elements in place (never element 0, so a test can
    damage element 0 of a receiver and know no update repairs it by chance)."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    density = (0.0, 0.002, 0.02, 0.3)[step % 4]
    for t in state.values():
        bits = t.view(-1).view(_INT[t.element_size()])
        if bits.numel() <= 1:
            continue
        mask = torch.rand(bits.numel(), generator=g) < density
        mask[0] = False
        pos = mask.nonzero().reshape(-1).to(t.device)
        ulp = torch.randint(-2, 3, (pos.numel(),), generator=g, dtype=torch.int64)
        bits[pos] = (bits[pos].to(torch.int64) + ulp.to(t.device)).to(bits.dtype)   # ~1 ulp


def raw_bytes(state):
    return {k: v.contiguous().view(-1).view(torch.uint8).clone() for k, v in state.items()}


def plain_bytes(state):
    """Like raw_bytes but as ``bytes``: a tensor sent through a queue is shared by file
    descriptor and cannot be unpickled once the sending process has exited."""
    return {k: v.contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
            for k, v in state.items()}


def damage(t: torch.Tensor) -> None:
    """Flip one bit of element 0 (see sparse_step)."""
    t.view(-1).view(torch.uint8)[0] ^= 1


# ---------------------------------------------------------------------------- IPC processes
def ipc_receiver(link, report_q, drift_at, device="cpu"):
    """Receive STEPS + 1 updates; after each, send back (version, bytes or error text)."""
    try:
        torch.set_num_threads(1)
        from glm_kernels import sync
        params = {k: v.to(device) for k, v in blank_like(make_state()).items()}
        receiver = sync.Receiver(link, params)
        for step in range(STEPS + 1):
            if step == drift_at:
                damage(params["layer.0.w"])
            try:
                receiver.receive(timeout=120)
                report_q.put((step, receiver.version, plain_bytes(params), None))
            except sync.SyncError as exc:
                report_q.put((step, receiver.version, plain_bytes(params), str(exc)))
    except BaseException:
        report_q.put(("crash", traceback.format_exc()))


# ---------------------------------------------------------------------------- gloo processes
def _in_gloo(rank, world, init_file, report_q, timeout_s, body):
    """``body(link)`` in a gloo group over a broadcast link from rank 0. A crash is reported
    and ends the process. The reports are flushed to the parent before the teardown: a put
    only queues them for the queue's feeder thread, and a rank stuck in gloo's teardown with
    the GIL held would starve it (the likely reading of a CI stall on torch 2.4 under load:
    one rank had exited 0, so every collective had completed, yet a report never arrived).
    The process then leaves by ``os._exit`` after the barrier: gloo's teardown changes no
    verdict and must not hang a rank whose steps are all reported."""
    faulthandler.register(signal.SIGUSR1)      # collect_reports dumps a stalled rank's stacks
    try:
        torch.set_num_threads(1)
        import datetime
        import torch.distributed as dist
        from glm_kernels import sync
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        body(sync.BroadcastTransport(src=0))
    except BaseException:
        report_q.put(("crash", rank, traceback.format_exc()))
        _flush(report_q)
        os._exit(1)
    _flush(report_q)
    try:
        dist.barrier()
    except BaseException:
        pass
    os._exit(0)


def _flush(report_q):
    """Wait until every report put so far has reached the pipe: os._exit (and a process
    stuck afterwards) skips the queue's feeder thread, and the parent would see nothing."""
    report_q.close()
    report_q.join_thread()


def _receive_and_report(link, state, report_q, steps, before_poll=None):
    """Rank 1: poll once per publish, report (1, step, version held, bytes, error)."""
    from glm_kernels import sync
    params = blank_like(state)
    receiver = sync.Receiver(link, params)
    for step in range(steps):
        if before_poll is not None:
            before_poll(step, params)
        error = None
        try:
            receiver.poll()
        except sync.SyncError as exc:
            error = str(exc)
        report_q.put((1, step, receiver.version, plain_bytes(params), error))


def gloo_rank(rank, world, init_file, encoding, drift_at, report_q):
    """Rank 0 publishes STEPS + 1 versions, rank 1 receives; both report bytes per step."""
    def body(link):
        from glm_kernels import sync
        state = make_state()
        if rank == 0:
            sender = sync.Sender(link, delta=True, encoding=encoding, bucket_bytes=1500)
            for step in range(STEPS + 1):
                if step:
                    sparse_step(state, step)
                version = sender.publish(state)
                report_q.put((0, step, version, plain_bytes(state), sender.last_stats.full))
        else:
            def drift(step, params):
                if step == drift_at:
                    damage(params["layer.0.w"])
            _receive_and_report(link, state, report_q, STEPS + 1, drift)
    _in_gloo(rank, world, init_file, report_q, 120, body)


def gloo_faults(rank, world, init_file, report_q):
    """Rank 0: v1; v2 dies half-way through encoding; v3; then a restarted Sender (new
    epoch, numbering from 1 again). Rank 1 polls once per publish and reports each outcome."""
    def body(link):
        from glm_kernels import sync
        from glm_kernels.sync import sender as sender_mod
        state = make_state()
        if rank == 0:
            sender = sync.Sender(link, delta=True, bucket_bytes=300)
            sender.publish(state)
            real, calls = sender_mod.encode, []

            def dies(*a, **k):
                calls.append(1)
                if len(calls) == 3:
                    raise RuntimeError("trainer died mid-update")
                return real(*a, **k)
            sender_mod.encode = dies
            sparse_step(state, 2)
            try:
                sender.publish(state)
            except RuntimeError:
                pass
            sender_mod.encode = real
            sparse_step(state, 3)
            report_q.put((0, "v3", sender.publish(state), sender.last_stats.full,
                          plain_bytes(state)))
            restarted = sync.Sender(link, delta=True, bucket_bytes=300)
            state = make_state(seed=7)
            report_q.put((0, "restart", restarted.publish(state), plain_bytes(state)))
        else:
            _receive_and_report(link, state, report_q, 4)
    _in_gloo(rank, world, init_file, report_q, 60, body)


def gloo_reports(target, rank_args, count, world=2):
    """Spawn ``world`` ranks running ``target(rank, world, *rank_args, report_q)``; returns their
    ``count`` reports (:func:`collect_reports`); a rank still alive 30 s after that is killed
    (its teardown changes no verdict)."""
    ctx = mp.get_context("spawn")
    report_q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, *rank_args, report_q), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        return collect_reports(report_q, procs, count)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()


def collect_reports(report_q, procs, count, stall_s=240.0):
    """``count`` reports from the spawned ``procs``. A crash report fails at once with its
    traceback; ranks that have all exited short of ``count`` fail naming their exit codes;
    ``stall_s`` without a report while a rank lives (a loaded 2-core machine starts two
    torch processes slowly, the bound is generous) fails after dumping every live rank's
    Python stacks to stderr (faulthandler, SIGUSR1), which the failure report shows."""
    out, last = [], time.monotonic()
    while len(out) < count:
        try:
            msg = report_q.get(timeout=1.0)
        except queue.Empty:
            if not any(p.is_alive() for p in procs):
                try:                             # a report sent just before its rank exited
                    msg = report_q.get(timeout=5.0)
                except queue.Empty:
                    pytest.fail(f"the ranks exited (codes {[p.exitcode for p in procs]}) "
                                f"after {len(out)} of {count} reports: {_heads(out)}")
            elif time.monotonic() - last > stall_s:
                for p in procs:
                    if p.is_alive():
                        os.kill(p.pid, signal.SIGUSR1)
                time.sleep(2.0)
                pytest.fail(f"no report for {stall_s:.0f} s after {len(out)} of {count} "
                            f"(rank exit codes {[p.exitcode for p in procs]}; the live ranks' "
                            f"stacks are in the captured stderr): {_heads(out)}")
            else:
                continue
        assert msg[0] != "crash", msg[-1]
        out.append(msg)
        last = time.monotonic()
    return out


def _heads(reports):
    """(rank, step) of each report: the byte payloads would push the verdict out of a
    truncated CI log."""
    return [tuple(m[:2]) for m in reports]
