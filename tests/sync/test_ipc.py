"""IPC transport end to end: a spawned receiver process, CPU shared memory (the CUDA path is
the same code with CUDA tensors: IPC handles instead of shared memory)."""
import pytest
import torch.multiprocessing as mp

from glm_kernels import sync
from glm_kernels.sync.protocol import full_entry, pack
from tests.sync._helpers import STEPS, ipc_receiver, make_state, plain_bytes, sparse_step

DRIFT_AT = 11   # the receiver damages its own copy before this step: refusal, then resync


def _run(device, encoding=None):
    ctx = mp.get_context("spawn")
    link = sync.IpcTransport(ctx, device=device)
    report_q = ctx.Queue()
    proc = ctx.Process(target=ipc_receiver, args=(link, report_q, DRIFT_AT, device),
                       daemon=True)
    proc.start()
    try:
        state = {k: v.to(device) for k, v in make_state().items()}
        sender = sync.Sender(link, delta=True, encoding=encoding, bucket_bytes=1500)
        for step in range(STEPS + 1):
            if step:
                sparse_step(state, step)
            sender.publish(state)
            stats = sender.last_stats
            got = report_q.get(timeout=120)
            assert got[0] != "crash", got[1]
            rstep, version, received, error = got
            assert rstep == step
            sent = plain_bytes(state)
            if step == DRIFT_AT:
                assert error is not None and "delta refused" in error
                assert version == step          # kept the version it held
                assert received["layer.0.w"] != sent["layer.0.w"]
                continue
            assert error is None, error
            assert version == step + 1
            assert stats.full == (step in (0, DRIFT_AT + 1)), (step, stats)
            for k in sent:
                assert received[k] == sent[k], f"step {step}: {k} differs"
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0


def test_ipc_cpu_twenty_steps_with_resync():
    _run("cpu")


@pytest.mark.gpu
def test_ipc_cuda_twenty_steps_with_resync():
    _run("cuda")


def test_incomplete_update_refused_after_frame_timeout():
    """Only the first frame of a multi-frame update arrives: refused, tensors unchanged,
    and the sender is asked for a full snapshot (one process, both ends)."""
    ctx = mp.get_context("spawn")
    link = sync.IpcTransport(ctx, frame_timeout=0.2)
    state = make_state()
    params = {k: v.clone() for k, v in state.items()}
    receiver = sync.Receiver(link, params, version=3)
    frames = list(pack(4, None, (full_entry(k, v) for k, v in state.items()), 200))
    assert len(frames) > 1
    link._frames.put(tuple(frames[0]))
    before = plain_bytes(params)
    with pytest.raises(sync.SyncError, match="incomplete update"):
        receiver.receive(timeout=30)
    assert plain_bytes(params) == before and receiver.version == 3
    assert link.full_requested() and not link.full_requested()
    assert receiver.receive(timeout=0) is None


def test_bad_transport_setup():
    with pytest.raises(RuntimeError, match="init_process_group"):
        sync.BroadcastTransport()
    with pytest.raises(ValueError, match="full_every"):
        sync.DiskTransport("/tmp/unused-glm-sync", full_every=0)
