"""Sharded weight sync in gloo worlds: T trainer ranks (2, 3, 4; uneven Shard(0) cuts) publish
collectively to a TP-1 engine and a TP-2 engine (uneven slices along dim 0 and dim 1), over
DiskTransport (one directory) and P2PTransport, bf16 + fp32 + int64 + an FP8 weight; then a
trainer rank dying mid-version (and restarting without a base) and an engine rank refusing
(the next publish re-sends in full only the pieces cut for the refusing engine's boxes)."""
import functools

import pytest

from tests._gloo import run_ranks
from tests.sync import _sharded


def _check_trainers(log, rank, kind):
    for step in range(4):
        status, version, full, delta_tensors, _ = log[step]
        assert (status, version, full) == ("ok", step + 1, step == 0), (kind, rank, step)
    status, error_type, text = log[4]
    assert status == "error" and error_type == ("RuntimeError" if rank == 1 else "SyncError")
    assert "died mid-version" in text
    status, version, full, delta_tensors, tensors = log[5]
    assert (status, version, full) == ("ok", 6, False)
    # only the restarted rank's shards go full; the others stay deltas
    assert (delta_tensors == 0) == (rank == 1) and tensors > 0, (kind, rank, log[5])
    assert tuple(log[6][:3]) == ("ok", 7, False)
    # after engine B's refusal: a delta version whose pieces cut for engine B's boxes are full
    status, version, full, delta_tensors, tensors, resent = log[7]
    assert (status, version, full) == ("ok", 8, False), (kind, rank, log[7])
    assert tensors - delta_tensors == resent and delta_tensors > 0, (kind, rank, log[7])
    return resent


def _check_engine(log, part, kind, trainers, pieces_sent):
    for step in range(4):
        rec = log[step]
        assert rec["error"] is None and rec["version"] == step + 1, (kind, part, step, rec)
        assert rec["bad"] == [], (kind, part, step, rec)
        if step:
            # only the changed elements of this rank's own slice came (+ framing)
            assert rec["changed"] == rec["expected_changed"] > 0, (kind, part, step, rec)
            assert rec["changed"] <= rec["payload"] <= 80 * rec["pieces"] + 10 * rec["changed"]
            if kind != "disk":          # P2P, IPC: only this rank's pieces came
                assert rec["transport_bytes"] == rec["payload"], rec
            else:
                # + the safetensors headers of the version's files: they index every piece
                # of every rank (about 200 bytes a piece), the tensor bytes read are its own
                header = rec["transport_bytes"] - rec["payload"]
                assert 0 < header <= 400 * pieces_sent[step] + 1024 * trainers, (rec, header)
    rec = log[4]                     # a trainer rank died mid-version: previous version kept
    assert rec["version"] == 4 and rec["unchanged"] and rec["bad_vs_previous"] == [], rec
    assert (rec["error"] is None) if kind == "disk" else ("aborted" in rec["error"])
    assert log[5]["version"] == 6 and log[5]["bad"] == [] and log[5]["error"] is None, log[5]
    rec = log[6]                     # engine B rank 1 drifted and refused v7
    if part is None:
        assert rec["version"] == 7 and rec["bad"] == [] and rec["error"] is None, rec
    else:
        assert rec["version"] == 6 and rec["error"] is not None and rec["unchanged"], rec
        assert rec["bad_vs_previous"] == (["emb.weight"] if part == 1 else []), rec
        if part == 0:
            assert "another rank of the engine group refused" in rec["error"], rec
    rec = log[7]                     # every engine on v8, bitwise
    assert rec["version"] == 8 and rec["bad"] == [] and rec["error"] is None, rec
    if part is None:
        # its pieces of the names engine B slices came as deltas (the whole-tensor names'
        # pieces are cut for a box engine B holds too: full)
        assert rec["changed"] == rec["expected_changed_sliced"] > 0, rec
    else:
        # engine B took only full pieces, each byte of its slices once
        assert rec["changed"] == 0 and rec["payload"] == rec["held_bytes"], rec
        if kind != "disk":
            assert rec["transport_bytes"] == rec["held_bytes"], rec


@pytest.mark.parametrize("trainers", [2, 3, 4])
def test_sharded_trainers_to_tp1_and_tp2_engines(tmp_path, trainers):
    world = trainers + 3
    verdicts = run_ranks(functools.partial(_sharded.world_body, trainers), world, tmp_path,
                         f"sharded sync T={trainers}")
    for rank, verdict in enumerate(verdicts):
        for kind in ("disk", "p2p"):
            if rank < trainers:
                # every rank holds rows of some box of engine B
                assert _check_trainers(verdict[kind], rank, kind) > 0, (kind, rank)
            else:
                part = None if rank == trainers else rank - trainers - 1
                pieces_sent = [sum(verdicts[t][kind][step][4] for t in range(trainers))
                               for step in range(4)]
                _check_engine(verdict[kind], part, kind, trainers, pieces_sent)
    if trainers == 2 and _sharded.DTENSOR_API:  # DTensor shards (torch's chunking), same engines
        for rank, verdict in enumerate(verdicts):
            if rank < trainers:
                assert verdict["dtensor"] == [1, 2], verdict["dtensor"]
            else:
                assert verdict["dtensor"] == [[1, []], [2, []]], verdict["dtensor"]
