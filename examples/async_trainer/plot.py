"""metrics.png: reward, IcePop pop fraction, staleness, the OPD reverse KL and the routing
mismatch rate (train vs rollout experts; replay on or off, named in the panel) and the samples
re-queued by engine restarts (Ray rollout; restarts marked) over steps."""
import os
from typing import Optional

from .log import warn_once

PANELS = (("reward", "sampled reward"), ("pop_frac", "IcePop pop fraction"),
          ("staleness", "staleness (versions)"), ("reverse_kl", "OPD reverse KL"),
          ("routing_mismatch", "routing mismatch"),
          ("samples_requeued", "samples re-queued\n(Ray engine restarts)"))


def plot(cfg, records) -> Optional[str]:
    """Write ``metrics.png`` into ``cfg.out_dir``; returns its path, or None when nothing was
    written (no matplotlib, or no RL/OPD step recorded yet)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warn_once("plot", "matplotlib not installed: skipping metrics.png")
        return None
    train = [r for r in records if r.get("kind") == "train" and r["stage"] != "sft"]
    if not train:
        return None
    stages = list(dict.fromkeys(r["stage"] for r in train))
    fig, axes = plt.subplots(len(PANELS), 1, figsize=(7, 13), sharex=True)
    for ax, (key, label) in zip(axes, PANELS):
        for i, stage in enumerate(stages):
            pts = [(r["global_step"], r[key]) for r in train if r["stage"] == stage and key in r]
            if pts:
                ax.plot(*zip(*pts), label=stage, color=f"C{i}")
        if key == "routing_mismatch":
            label += f"\n(replay {'on' if getattr(cfg, 'routing_replay', False) else 'off'})"
        ax.set_ylabel(label, fontsize=8)
    for r in records:
        if r.get("kind") == "eval":
            axes[0].axvline(r["global_step"], color="grey", lw=0.5, ls=":")
        if r.get("event") == "engine_restart":
            axes[-1].axvline(r["global_step"], color="red", lw=0.8, ls="--")
    axes[0].legend(fontsize=7)
    axes[-1].set_xlabel("optimizer step (all stages)")
    fig.tight_layout()
    path = os.path.join(cfg.out_dir, "metrics.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
