"""``checkpoint.pt``: tensors and plain data only, written atomically, read with
``torch.load(weights_only=True)`` (a checkpoint never runs code when it is loaded).

Layout (``format`` 2), a dict:

* ``format`` 2; ``config``: the ``TrainerConfig`` fields; ``global_step``, ``rollout_procs``
  (rollout processes started so far: the prefix of new sample ids);
* ``records``: every metrics record so far (``metrics.jsonl`` is rewritten from them on resume);
* ``trained``: stage -> ids of the samples trained on; ``accounting``: stage ->
  ``generated`` / ``trained`` / ``unconsumed`` / ``stale`` / ``dropped`` sample counts;
* ``finished``: stage -> ``{parameter name: tensor}`` of every finished stage;
* inside a stage also ``stage``, ``step`` (optimizer steps done in it), ``model`` and
  ``optimizer`` (its ``state_dict()``: per-parameter tensors and numbers, hyperparameters).
"""
import math
import os
import tempfile
from typing import Callable, Dict, Optional

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


# A stage's sample accounting (generated = trained + unconsumed + stale + dropped).
ACCOUNTING = ("generated", "trained", "unconsumed", "stale", "dropped")


def validate(ckpt: dict, path: str, stage_steps: Dict[str, int], reference: Dict[str, torch.Tensor],
             new_optimizer: Callable[[str], Optional[torch.optim.Optimizer]]) -> None:
    """Check every field of a loaded checkpoint before anything of it is applied (issue 25):
    types, ranges, the shape / dtype / finiteness of every tensor; CheckpointError naming
    the field otherwise.

    ``stage_steps``: stage name -> its number of optimizer steps under the resumed config;
    ``reference``: a fresh model's state dict (names, shapes, dtypes); ``new_optimizer(stage)``:
    a throwaway optimizer of that stage over a fresh model, into which the saved optimizer
    state is loaded as a dry run.
    """
    def bad(field, why):
        return CheckpointError(f"config.resume: {path!r}: {field} {why}")

    def count(field, value, hi=None):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0 \
                or (hi is not None and value > hi):
            raise bad(field, f"must be an int in [0, {'inf' if hi is None else hi}], got "
                             f"{value!r:.40}")

    def stage_name(field, name):
        if name not in stage_steps:
            raise bad(field, f"names stage {name!r:.40}, not one of {list(stage_steps)}")

    count("global_step", ckpt["global_step"])
    count("rollout_procs", ckpt["rollout_procs"])
    for i, rec in enumerate(ckpt["records"]):
        if not isinstance(rec, dict) or not all(isinstance(k, str) for k in rec):
            raise bad(f"records[{i}]", "must be a dict with str keys")
    for stage, ids in ckpt["trained"].items():
        stage_name(f"trained[{stage!r}]", stage)
        if not isinstance(ids, list) or not all(isinstance(x, str) for x in ids):
            raise bad(f"trained[{stage!r}]", "must be a list of sample ids (str)")
    for stage, acc in ckpt["accounting"].items():
        stage_name(f"accounting[{stage!r}]", stage)
        if not isinstance(acc, dict) or set(acc) - set(ACCOUNTING):
            raise bad(f"accounting[{stage!r}]", f"must be a dict of {list(ACCOUNTING)}")
        for key, value in acc.items():
            count(f"accounting[{stage!r}][{key!r}]", value)
    for stage, state in ckpt["finished"].items():
        stage_name(f"finished[{stage!r}]", stage)
        check_model_state(f"finished[{stage!r}]", state, reference, bad)
    if "stage" not in ckpt:
        return
    stage = ckpt["stage"]
    stage_name("stage", stage)
    if stage in ckpt["finished"]:
        raise bad("stage", f"{stage!r} is also in finished")
    count("step", ckpt["step"], stage_steps[stage])
    check_model_state("model", ckpt["model"], reference, bad)
    if ckpt["optimizer"] is not None:
        check_optimizer_state("optimizer", ckpt["optimizer"], new_optimizer(stage), bad)


def check_model_state(field: str, state, reference: Dict[str, torch.Tensor], bad) -> None:
    """``state`` has exactly ``reference``'s names, each a finite tensor of its shape and dtype."""
    if not isinstance(state, dict):
        raise bad(field, f"must be a dict name -> tensor, got {type(state).__name__}")
    missing, extra = sorted(set(reference) - set(state)), sorted(set(state) - set(reference))
    if missing or extra:
        raise bad(field, f"does not match the model: missing {missing[:4]}, unexpected "
                         f"{extra[:4]}")
    for name, want in reference.items():
        got = state[name]
        where = f"{field}[{name!r}]"
        if not isinstance(got, torch.Tensor):
            raise bad(where, f"is a {type(got).__name__}, not a tensor")
        if got.shape != want.shape or got.dtype != want.dtype:
            raise bad(where, f"has shape {tuple(got.shape)} {got.dtype}, the model needs "
                             f"{tuple(want.shape)} {want.dtype}")
        _check_finite(where, got, bad)


def _check_finite(where: str, value, bad) -> None:
    if isinstance(value, torch.Tensor):
        if (value.is_floating_point() or value.is_complex()) and not bool(
                torch.isfinite(value).all()):
            raise bad(where, f"holds {int((~torch.isfinite(value)).sum())} non-finite values")
    elif isinstance(value, float) and not math.isfinite(value):
        raise bad(where, f"is {value}")


def check_optimizer_state(field: str, state, optimizer, bad) -> None:
    """A dry run: ``state`` loads into ``optimizer`` (a throwaway of the stage's kind over a
    fresh model), every number in it is finite, and every per-parameter tensor that is not a
    scalar has its parameter's shape."""
    if not isinstance(state, dict) or not isinstance(state.get("state"), dict) \
            or not isinstance(state.get("param_groups"), list):
        raise bad(field, "must be an optimizer state_dict (state, param_groups)")

    def walk(where, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{where}[{k!r}]", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{where}[{i}]", v)
        else:
            _check_finite(where, value, bad)
    walk(field, state)
    try:
        optimizer.load_state_dict(state)
    except Exception as err:    # group / parameter counts that do not match this model
        raise bad(field, f"does not fit this stage's optimizer ({type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else ''})") from None
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() and value.shape != p.shape:
                    raise bad(f"{field} param_groups[{gi}] parameter {pi} {key!r}",
                              f"has shape {tuple(value.shape)}, the parameter "
                              f"{tuple(p.shape)}")
