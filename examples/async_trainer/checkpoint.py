"""``checkpoint.pt``: tensors and plain data only, written atomically, read with
``torch.load(weights_only=True)`` (a checkpoint never runs code when it is loaded).

Layout (``format`` 2), a dict:

* ``format`` 2; ``config``: the ``TrainerConfig`` fields; ``global_step``, ``rollout_procs``
  (rollout processes started so far: the prefix of new sample ids);
* ``records``: every metrics record so far (``metrics.jsonl`` is rewritten from them on resume);
* ``trained``: stage -> ids of the samples trained on; ``accounting``: stage ->
  ``generated`` / ``trained`` / ``unconsumed`` / ``dropped`` sample counts;
* ``finished``: stage -> ``{parameter name: tensor}`` of every finished stage;
* inside a stage also ``stage``, ``step`` (optimizer steps done in it), ``model`` and
  ``optimizer`` (its ``state_dict()``: per-parameter tensors and numbers, hyperparameters).
"""
import os
import tempfile
import torch

FORMAT = 2
_SCALARS = (str, int, float, bool, type(None))


class CheckpointError(ValueError):
    """A ``config.resume`` file that is missing, refused or not this trainer's checkpoint."""


def check_plain(obj, where: str = "checkpoint") -> None:
    """Raise ``TypeError`` naming the first value that is not a tensor or plain data (dicts
    with str/int keys, lists, tuples, str, int, float, bool, None)."""
    if isinstance(obj, (torch.Tensor,) + _SCALARS):
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            check_plain(v, f"{where}[{i}]")
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"{where} has a {type(k).__name__} key {k!r}: checkpoint keys "
                                f"are str or int")
            check_plain(v, f"{where}[{k!r}]")
        return
    raise TypeError(f"{where} is a {type(obj).__name__}: a checkpoint holds only tensors and "
                    f"plain data (it is read with torch.load(weights_only=True))")


def tensors(state_dict) -> dict:
    """A module's ``state_dict`` as a plain ``{name: tensor}`` dict of detached CPU copies."""
    return {k: v.detach().to("cpu", copy=True) for k, v in state_dict.items()}


def save(path: str, state: dict) -> str:
    """Write ``state`` to ``path`` atomically: a fresh temporary file in the same directory,
    fsync'ed, then ``os.replace`` (a crash or a signal mid-write leaves the old file)."""
    check_plain(state)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp",
                               dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "wb") as f:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)   # mkstemp makes it 0600; like any file written here
            torch.save({"format": FORMAT, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


_REQUIRED = {"config": dict, "records": list, "trained": dict, "accounting": dict,
             "finished": dict, "global_step": int, "rollout_procs": int}
_IN_STAGE = {"stage": str, "step": int, "model": dict, "optimizer": (dict, type(None))}


def load(path: str) -> dict:
    """Read a checkpoint written by :func:`save`; anything else is refused with a
    :class:`CheckpointError` naming ``config.resume`` (nothing but tensors and plain data is
    ever unpickled)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"config.resume: no checkpoint at {path!r}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:    # UnpicklingError (objects), RuntimeError (not a torch zip file)
        first = (str(err).strip().splitlines() or [""])[0]
        raise CheckpointError(
            f"config.resume: {path!r} was refused by torch.load(weights_only=True) "
            f"({type(err).__name__}: {first}). This trainer's checkpoints hold only tensors and "
            f"plain data; a file with other objects (an older checkpoint format, or a crafted "
            f"pickle) is never unpickled") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        got = ckpt.get("format") if isinstance(ckpt, dict) else type(ckpt).__name__
        raise CheckpointError(f"config.resume: {path!r} is not a format-{FORMAT} checkpoint "
                              f"of this trainer (format {got!r})")
    need = dict(_REQUIRED, **(_IN_STAGE if "stage" in ckpt else {}))
    for key, kind in need.items():
        if not isinstance(ckpt.get(key), kind):
            raise CheckpointError(f"config.resume: {path!r} has no valid {key!r} entry "
                                  f"(got {type(ckpt.get(key)).__name__})")
    return ckpt
