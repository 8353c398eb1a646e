"""IPC transport end to end: a spawned receiver process, CPU shared memory (the CUDA path is
the same code with CUDA tensors: IPC handles instead of shared memory)."""
import pytest
import torch
import torch.multiprocessing as mp

from glm_kernels import sync
from tests.sync._helpers import STEPS, ipc_receiver, make_state, plain_bytes, sparse_step

DRIFT_AT = 11   # the receiver damages its own copy before this step: refusal, then resync


def _run(device, encoding="zstd"):
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
