"""torch.distributed transport end to end: gloo, 2 spawned ranks, 20 sparse steps, one
refusal and the all_reduce-driven resync."""
from tests.sync._helpers import ENC, STEPS, gloo_faults, gloo_rank, gloo_reports

DRIFT_AT = 9


def test_gloo_broadcast_twenty_steps_with_resync(tmp_path):
    sent, got = {}, {}
    for msg in gloo_reports(gloo_rank, (str(tmp_path / "pg_init"), ENC, DRIFT_AT),
                            2 * (STEPS + 1)):
        (sent if msg[0] == 0 else got)[msg[1]] = msg[2:]
    # Every step was reported above (a rank that failed mid-run reports "crash" or times
    # out); the exit codes only reflect gloo's teardown, which may abort under load.
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


def test_gloo_aborted_publish_and_restarted_sender_keep_lock_step(tmp_path):
    """A publish that dies half-way is discarded whole by the receiver (one poll per publish
    still matches: nothing blocks until the group timeout), and a restarted sender's full
    snapshot v1 is accepted at once by a receiver holding v3."""
    msgs = gloo_reports(gloo_faults, (str(tmp_path / "pg"),), 6)
    assert not [m for m in msgs if m[0] == "crash"], msgs
    sent = {m[1]: m[2:] for m in msgs if m[0] == 0}
    got = {m[1]: m[2:] for m in msgs if m[0] == 1}
    assert got[0][0] == 1 and got[0][2] is None
    assert got[1][0] == 1 and "aborted by its sender" in got[1][2]
    v3, was_full, v3_bytes = sent["v3"]
    assert v3 == 3 and was_full and got[2][0] == 3 and got[2][1] == v3_bytes and got[2][2] is None
    v1, restart_bytes = sent["restart"]
    assert v1 == 1 and got[3][0] == 1 and got[3][1] == restart_bytes and got[3][2] is None
