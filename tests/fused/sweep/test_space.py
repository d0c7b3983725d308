"""Search spaces: the flag-built space, spaces written as data, and user functions."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest

from plait.fused.sweep.space import SearchSpace, SpecSpace, load_space, read_spec


def trial() -> optuna.Trial:
    return optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0)).ask()


def test_search_space_leaves_out_what_it_is_not_given() -> None:
    params = SearchSpace(momentum=None, widths=None)(trial())
    assert set(params) == {"lr", "weight_decay", "batch_size"}
    params = SearchSpace(widths=(8, 16), batch_sizes=(32,))(trial())
    assert params["momentum"] == 0.9 and params["width"] in (8, 16)
    assert params["batch_size"] == 32 and 1e-3 <= params["lr"] <= 1.0


def test_spec_space_samples_each_kind_of_entry() -> None:
    spec = {
        "lr": {"low": 1e-4, "high": 0.1, "log": True},
        "width": {"low": 8, "high": 32, "step": 8},
        "batch_size": [16, 32],
        "eps": {"choices": [1e-8, 1e-6]},
        "momentum": 0.9,
        "betas": {"value": [0.9, 0.99]},
    }
    t = trial()
    params = SpecSpace(spec)(t)
    assert 1e-4 <= params["lr"] <= 0.1
    assert params["width"] in (8, 16, 24, 32) and isinstance(params["width"], int)
    assert params["batch_size"] in (16, 32) and params["eps"] in (1e-8, 1e-6)
    assert params["momentum"] == 0.9 and params["betas"] == [0.9, 0.99]
    # fixed values are not searched: Optuna only sees the sampled ones
    assert set(t.params) == {"lr", "width", "batch_size", "eps"}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({}, "expected a table"),
        ({"lr": []}, "empty list of choices"),
        ({"lr": {"low": 1}}, "low/high"),
        ({"lr": {"low": 1, "high": 2, "lg": True}}, "got keys"),
        ({"lr": {"low": 2, "high": 1}}, "low <= high"),
        ({"lr": {"low": 0, "high": 1, "log": True}}, "low > 0 with log"),
        ({"lr": {"low": "a", "high": 1}}, "must be numbers"),
    ],
)
def test_bad_specs_name_the_entry(spec: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpecSpace(spec)


def test_spec_files_and_functions_load(tmp_path: Path) -> None:
    toml = tmp_path / "space.toml"
    toml.write_text("lr = {low = 1e-3, high = 0.1, log = true}\nbatch_size = [16, 32]\n")
    js = tmp_path / "space.json"
    js.write_text(json.dumps({"lr": {"low": 1e-3, "high": 0.1}}))
    assert set(load_space(str(toml))(trial())) == {"lr", "batch_size"}
    assert set(read_spec(js)(trial())) == {"lr"}
    code = tmp_path / "myspace.py"
    code.write_text(
        "def suggest(trial):\n"
        "    return {'lr': trial.suggest_float('lr', 0.01, 0.1)}\n"
        "NOT_CALLABLE = 3\n"
    )
    assert set(load_space(f"{code}:suggest")(trial())) == {"lr"}
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        load_space(f"{code}:missing")
    with pytest.raises(ValueError, match="is not callable"):
        load_space(f"{code}:NOT_CALLABLE")
    with pytest.raises(ValueError, match="does not exist"):
        load_space(str(tmp_path / "nope.toml"))
    with pytest.raises(ValueError, match="does not import"):
        load_space("no_such_module_here:suggest")
    bad = tmp_path / "bad.toml"
    bad.write_text("lr = = 1")
    with pytest.raises(ValueError, match="does not parse"):
        load_space(str(bad))
    with pytest.raises(ValueError, match=r"expected a \.json/\.toml spec file"):
        load_space("just-a-name")
