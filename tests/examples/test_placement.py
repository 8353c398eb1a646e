"""The engines' placement-group arithmetic (no Ray needed): the bundle an engine reserves, how
many fit a node, and which requests no cluster of the given nodes can ever hold. Placing
on a real two-node Ray cluster: test_engines_cluster.py."""
import pytest

from examples.async_trainer.config import TrainerConfig
from examples.async_trainer.rollout.placement import (STRATEGIES, PlacementError, copies_that_fit,
                                                      engine_bundle, why_never)
from examples.async_trainer.rollout.supervisor import RolloutError

TWO_NODES = {"a": {"CPU": 2.0, "memory": 1e9}, "b": {"CPU": 2.0, "GPU": 1.0}}


def test_engine_bundle_asks_gpus_only_when_the_engine_does():
    assert engine_bundle(1) == {"CPU": 1.0}
    assert engine_bundle(0.5, 0.25) == {"CPU": 0.5, "GPU": 0.25}
    assert engine_bundle(0, 1) == {"GPU": 1.0}
    with pytest.raises(ValueError):
        engine_bundle(0, 0)                      # Ray refuses an empty bundle


def test_copies_that_fit_one_node():
    assert copies_that_fit({"CPU": 1.0}, {"CPU": 2.0}) == 2
    assert copies_that_fit({"CPU": 0.3}, {"CPU": 0.9}) == 3          # no float round-down
    assert copies_that_fit({"CPU": 1.0, "GPU": 0.5}, {"CPU": 8.0, "GPU": 1.0}) == 2
    assert copies_that_fit({"CPU": 1.0, "GPU": 1.0}, {"CPU": 8.0}) == 0


@pytest.mark.parametrize("bundle, n, strategy, never", [
    ({"CPU": 1.0}, 4, "PACK", None),
    ({"CPU": 1.0}, 5, "PACK", "the nodes hold 4 of the 5 bundles at most"),
    ({"CPU": 1.0}, 4, "SPREAD", None),
    ({"CPU": 3.0}, 1, "SPREAD", "the nodes hold 0 of the 1 bundles at most"),
    ({"CPU": 1.0}, 2, "STRICT_PACK", None),
    ({"CPU": 1.0}, 3, "STRICT_PACK", "no node holds all 3 bundles (at most 2 on one node)"),
    ({"CPU": 2.0}, 2, "STRICT_SPREAD", None),
    ({"CPU": 1.0}, 3, "STRICT_SPREAD", "3 bundles need 3 nodes that hold one each, there are 2"),
    ({"CPU": 1.0, "GPU": 1.0}, 1, "PACK", None),
    ({"CPU": 1.0, "GPU": 1.0}, 2, "SPREAD", "the nodes hold 1 of the 2 bundles at most"),
])
def test_why_never_is_exact_for_equal_bundles(bundle, n, strategy, never):
    assert why_never(bundle, n, strategy, TWO_NODES) == never


def test_the_strategies_are_the_configs():
    for s in STRATEGIES:
        TrainerConfig(placement_strategy=s, rollout_backend="process").validate()
    with pytest.raises(ValueError, match="config.placement_strategy"):
        TrainerConfig(placement_strategy="pack", rollout_backend="process").validate()
    with pytest.raises(ValueError, match="config.engine_cpus"):
        TrainerConfig(engine_cpus=0.0, rollout_backend="process").validate()


def test_a_placement_error_is_a_rollout_error():
    # The CLI logs a RolloutError and exits 1 (no traceback).
    assert issubclass(PlacementError, RolloutError)


@pytest.mark.parametrize("args, field", [
    (["--placement-strategy", "pack"], "placement_strategy"),
    (["--engine-cpus", "0"], "engine_cpus"),
    (["--placement-timeout", "-1"], "placement_timeout"),
])
def test_placement_flags_are_validated_naming_the_flag(args, field, capsys):
    import examples.async_trainer.__main__ as cli
    assert cli.main(args + ["--rollout-backend", "process"]) == 2
    err = capsys.readouterr().err
    assert f"config.{field}" in err and f"--{field.replace('_', '-')}" in err
