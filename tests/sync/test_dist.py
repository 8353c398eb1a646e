"""torch.distributed transport end to end: gloo, 2 spawned ranks, 20 sparse steps, one
refusal and the all_reduce-driven resync."""
import torch.multiprocessing as mp

from tests.sync._helpers import STEPS, gloo_rank

DRIFT_AT = 9


def test_gloo_broadcast_twenty_steps_with_resync(tmp_path):
    ctx = mp.get_context("spawn")
    report_q = ctx.Queue()
    init_file = str(tmp_path / "pg_init")
    procs = [ctx.Process(target=gloo_rank, args=(r, 2, init_file, "zstd", DRIFT_AT, report_q),
                         daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        sent, got = {}, {}
        for _ in range(2 * (STEPS + 1)):
            msg = report_q.get(timeout=180)
            assert msg[0] != "crash", msg[2]
            (sent if msg[0] == 0 else got)[msg[1]] = msg[2:]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    # Every step was reported above (a rank that failed mid-run reports "crash" or times
    # out); the exit codes only reflect gloo's teardown, which may abort under load.
    assert not any(p.is_alive() for p in procs)
    for step in range(STEPS + 1):
        version, sender_bytes, was_full = sent[step]
        held, receiver_bytes, error = got[step]
        assert version == step + 1
        assert was_full == (step in (0, DRIFT_AT + 1)), step
        if step == DRIFT_AT:
            assert error is not None and "delta refused" in error and held == step
            continue
        assert error is None and held == version
        for k in sender_bytes:
            assert receiver_bytes[k] == sender_bytes[k], f"step {step}: {k} differs"
