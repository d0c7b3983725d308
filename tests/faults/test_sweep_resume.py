"""A sweep killed while an array trains leaves nothing RUNNING once the study resumes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import optuna
import pytest

from plait.fused.sweep import PrunerKind, SearchSpace, SweepConfig, digits_task, run_sweep, runner
from plait.fused.sweep.runner import (
    HEARTBEAT_ATTR,
    INTERRUPTED_ATTR,
    OWNER_ATTR,
    RETRY_ATTR,
    recover_interrupted,
)

TRIALS, EPOCHS, ARRAY = 6, 1, 2
RUNNING, COMPLETE = optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.COMPLETE

# The sweep of the test, run in a child: its second array blocks after its first epoch
# (once the first array's trials are told), and says so, so the test can kill it there.
CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from plait.fused.sweep import runner
    from plait.fused.sweep.runner import SweepConfig, PrunerKind, run_sweep
    from plait.fused.sweep.task import SearchSpace, digits_task

    storage, ready, trials, epochs, array = sys.argv[1], Path(sys.argv[2]), *map(int, sys.argv[3:])
    evaluate, calls = runner._evaluate, []

    def blocking(*args, **kwargs):
        calls.append(1)
        if len(calls) == epochs + 1:
            ready.touch()
            time.sleep(600)
        return evaluate(*args, **kwargs)

    runner._evaluate = blocking
    cfg = SweepConfig(trials=trials, epochs=epochs, storage=storage, study="s",
                      max_models=array, memory_budget=1 << 40, pruner=PrunerKind.NONE,
                      sampler="random", progress=False)
    run_sweep(digits_task("digits-mlp", SearchSpace(widths=(16,))), cfg)
    """
)


def config(storage: str) -> SweepConfig:
    return SweepConfig(
        trials=TRIALS,
        epochs=EPOCHS,
        storage=storage,
        study="s",
        max_models=ARRAY,
        memory_budget=1 << 40,
        pruner=PrunerKind.NONE,
        sampler="random",
        progress=False,
    )  # type: ignore[arg-type]


def kill_mid_array(tmp_path: Path, storage: str) -> None:
    ready = tmp_path / "ready"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    args = [storage, str(ready), str(TRIALS), str(EPOCHS), str(ARRAY)]
    child = subprocess.Popen([sys.executable, "-c", CHILD, *args], env=env)
    try:
        deadline = time.monotonic() + 45
        while not ready.exists():
            assert child.poll() is None, f"the sweep exited ({child.returncode}) before blocking"
            assert time.monotonic() < deadline, "the sweep never reached its second array"
            time.sleep(0.1)
        states = [t.state for t in optuna.load_study(study_name="s", storage=storage).trials]
        assert states == [COMPLETE] * ARRAY + [RUNNING] * ARRAY  # killed mid-array
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)


def test_resume_after_a_killed_sweep_fails_nothing_finished_and_reasks_the_array(
    tmp_path: Path,
) -> None:
    storage = f"sqlite:///{tmp_path / 'sweeps.db'}"
    kill_mid_array(tmp_path, storage)
    before = optuna.load_study(study_name="s", storage=storage).trials
    result = run_sweep(digits_task("digits-mlp", SearchSpace(widths=(16,))), config(storage))

    after = optuna.load_study(study_name="s", storage=storage).trials
    assert not [t.number for t in after if t.state == RUNNING]
    assert [t.value for t in after[:ARRAY]] == [t.value for t in before[:ARRAY]]  # kept
    interrupted = [t for t in after if t.system_attrs.get(INTERRUPTED_ATTR)]
    assert [t.number for t in interrupted] == [2, 3]
    assert all(t.state == optuna.trial.TrialState.FAIL for t in interrupted)
    retried = {t.user_attrs[RETRY_ATTR]: t for t in after if RETRY_ATTR in t.user_attrs}
    assert sorted(retried) == [2, 3]
    for old in interrupted:  # the interrupted array's configurations were trained again
        assert retried[old.number].params == old.params
        assert retried[old.number].state == COMPLETE
    assert sum(t.state == COMPLETE for t in after) == TRIALS
    assert len(result.records) == TRIALS - ARRAY


def test_running_trials_of_a_live_sweep_are_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = f"sqlite:///{tmp_path / 'db'}"
    study = optuna.create_study(study_name="s", storage=storage)
    here, elsewhere, stale, bare = (study.ask() for _ in range(4))
    attrs = study._storage.set_trial_system_attr
    # asked by this (live) process
    attrs(here._trial_id, OWNER_ATTR, {"host": socket.gethostname(), "pid": os.getpid()})
    # asked on another machine that beats on, and on one that stopped beating
    now = time.time()
    attrs(elsewhere._trial_id, OWNER_ATTR, {"host": "other-node", "pid": 1})
    attrs(elsewhere._trial_id, HEARTBEAT_ATTR, now)
    attrs(stale._trial_id, OWNER_ATTR, {"host": "other-node", "pid": 1})
    attrs(stale._trial_id, HEARTBEAT_ATTR, now - 2 * runner.STALE_AFTER_S)
    # `bare`: no owner (an older plait), started just now: may be alive
    assert recover_interrupted(study) == [stale.number]
    states = {t.number: t.state for t in study.get_trials()}
    assert states[here.number] == states[elsewhere.number] == states[bare.number] == RUNNING
    assert states[stale.number] == optuna.trial.TrialState.FAIL
    waiting = study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert [t.user_attrs[RETRY_ATTR] for t in waiting] == [stale.number]
    assert recover_interrupted(study) == []  # once only
