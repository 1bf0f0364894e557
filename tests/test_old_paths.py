"""Old module paths still import, and pickles made before the core moved into layer folders
still load (lightning_replay/_aliases.py; the layers: docs/architecture.md).

``tests/data/pickles_before_layers.json`` holds pickles made by lightning_replay at 4374250,
when every module lived in ``lightning_replay/`` side by side: they name
``lightning_replay.planner.Plan``, ``lightning_replay.contract.ReplayContract``,
``lightning_replay.installation._new_plain`` (an installed model pickles as a plain one), and, as
older versions wrote, ``lightning_replay.engine._new_plain``.
"""

from __future__ import annotations

import base64
import importlib
import json
import pickle
import pickletools
from pathlib import Path

import pytest
import torch

import lightning_replay as lr
from lightning_replay import _aliases

PICKLES = json.loads((Path(__file__).parent / "data" / "pickles_before_layers.json").read_text())[
    "pickles"
]


def _load(name: str):
    return pickle.loads(base64.b64decode(PICKLES[name]))


def _globals(name: str) -> set[str]:
    """The ``module.name`` globals a pickle names."""
    raw = base64.b64decode(PICKLES[name])
    return {arg.replace(" ", ".") for op, arg, _ in pickletools.genops(raw) if op.name == "GLOBAL"}


@pytest.mark.parametrize("old", sorted(_aliases.MOVED))
def test_an_old_path_is_the_moved_module_itself(old):
    new = _aliases.MOVED[old]
    module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert module.__name__ == new and module.__spec__.name == new  # its own spec, not the alias's


def test_attributes_set_through_an_old_path_reach_the_module():
    import lightning_replay.planner as old

    new = importlib.import_module(_aliases.MOVED.get("lightning_replay.planner", old.__name__))
    old._i29_probe = 1
    try:
        assert new._i29_probe == 1
    finally:
        del old._i29_probe


def test_old_pickles_name_the_old_paths():
    # (what makes the tests below a check of the old paths)
    assert "lightning_replay.planner.Plan" in _globals("plan")
    assert "lightning_replay.contract.ReplayContract" in _globals("contract")
    assert "lightning_replay.records.Record" in _globals("record")
    assert "lightning_replay.installation._new_plain" in _globals("installed_model")
    assert "lightning_replay.engine._new_plain" in _globals("installed_model_older")


def test_old_pickles_of_plans_costs_and_settings_load_equal():
    from lightning_replay.planner import Option, Plan, SegmentCost

    assert _load("plan") == Plan({"a": "retain", "b": "whole"}, 123, 0.5, "joint", 1000, 7)
    assert _load("segment_cost") == SegmentCost(
        "a", 6, {"retain": Option(10, 0.0), "whole": Option(4, 0.1, True, 3)}
    )
    assert _load("budget") == lr.Budget(bytes=2**30)
    assert _load("replan_settings") == lr.ReplanSettings()
    assert _load("record") == lr.Record(
        run_id="r",
        step=3,
        rank=0,
        segment="1",
        contract_version=1,
        check="derivative",
        outcome="match",
        detail="{}",
        created_at=1.5,
    )


def test_an_old_pickled_contract_loads_as_a_contract():
    c = _load("contract")
    assert type(c) is lr.ReplayContract
    assert lr.ReplayContract.from_dict(c.to_dict()) == c
    assert c.segment == "1" and any(e.name.endswith("running_mean") for e in c.state)


@pytest.mark.parametrize("name", ["installed_model", "installed_model_older"])
def test_an_old_pickled_installed_model_loads_as_a_plain_model(name):
    model = _load(name)
    assert [type(m) for m in model] == [torch.nn.Linear, torch.nn.BatchNorm1d, torch.nn.Linear]
    assert int(model[1].num_batches_tracked) == 1
    model(torch.randn(8, 4)).sum().backward()  # trains as a plain model
