"""Exact resume for JAX: a Flax NNX + Optax run SIGKILLed mid-epoch and resumed ends bit-identical.

The training program is resume_recipe_jax.py (dropout from an ``nnx.Rngs`` stream inside the model, a
shuffled data order whose key, epoch and position are saved). It runs as a child process that the test
kills between two checkpoints and starts again; the uninterrupted reference runs in this process, from the
same functions. The controls show the comparison can fail: a resume that forgets the dropout stream or the
data order ends elsewhere.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("flax.nnx")
pytest.importorskip("optax")
import jax  # noqa: E402 - after the skip
from flax import nnx  # noqa: E402
from resume_recipe_jax import build, train  # noqa: E402

import trainstate  # noqa: E402

RECIPE = Path(__file__).with_name("resume_recipe_jax.py")
STEPS, EVERY, PAUSE = 30, 4, 18  # 12 steps an epoch: killed at epoch 1, position 7, after the save of step 16


def leaves(state: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every array and number the run's outcome depends on, by path, on the host (typed keys as key data)."""
    tree = {"model": nnx.state(state["model"]), "optimizer": nnx.state(state["optimizer"]), "order": state["order"]}
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, jax.Array) and jax.numpy.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out[jax.tree_util.keystr(path)] = np.asarray(leaf)
    return out


def assert_bit_identical(expected: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> None:
    assert expected.keys() == got.keys()
    differ = [p for p, value in expected.items() if value.dtype != got[p].dtype or not np.array_equal(value, got[p])]
    assert not differ, f"not bit-identical: {differ}"


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    """The run that never stopped, in this process."""
    state = build()
    train(state, 0, STEPS)
    return leaves(state)


@pytest.fixture(scope="module")
def child_env(tmp_path_factory) -> dict[str, str]:
    """The children share a persistent compilation cache: the first compiles, the others load (seconds each)."""
    return {
        **os.environ,
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax-cache")),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


@pytest.mark.parametrize(
    "async_save",
    [
        pytest.param(False, marks=pytest.mark.slow),  # CI: the synchronous manager resumes in the control below
        True,  # killed with a background save possibly in flight
    ],
)
def test_sigkill_mid_epoch_and_resume_in_a_new_process_is_bit_identical(tmp_path, reference, child_env, async_save):
    flags = ["--steps", str(STEPS), "--every", str(EVERY)] + (["--async"] if async_save else [])
    run = [sys.executable, str(RECIPE), str(tmp_path), *flags]
    proc = subprocess.Popen(
        [*run, "--pause-at", str(PAUSE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env
    )
    watchdog = threading.Timer(300, proc.kill)  # a child that hangs before its line fails the test, not CI
    watchdog.start()
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(2)]  # "start 0", then "paused 18", waiting on stdin
    finally:
        watchdog.cancel()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert lines == ["start 0\n", f"paused {PAUSE}\n"]
    assert proc.returncode == -signal.SIGKILL
    assert not (tmp_path / "final").exists()

    resumed = subprocess.run(run, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300, env=child_env)
    assert resumed.returncode == 0, resumed.stderr
    start = int(resumed.stdout.split("start ")[1].split()[0])
    # the newest committed checkpoint: step 16's; an async one may still have been writing (step 12's then)
    assert start in ((13, 17) if async_save else (17,))

    final = build(seed=99)  # other initial values: a restore that missed something would show
    trainstate.load(tmp_path / "final", final)
    assert_bit_identical(reference, leaves(final))


@pytest.mark.parametrize("forget", [None, "dropout", "order"])
def test_resume_that_forgets_the_dropout_stream_or_the_data_order_diverges(tmp_path, reference, forget):
    """The control, in this process with a synchronous manager: abandoned after step 18 and resumed from the
    checkpoint of step 16, the run ends bit-identical only when the dropout stream and the data order were
    restored with the rest."""
    state = build()
    with trainstate.CheckpointManager(tmp_path, every_steps=EVERY) as manager:
        train(state, 0, PAUSE + 1, lambda step: manager.save(step, state))
    resumed, fresh = build(seed=99), build()  # fresh: what a resume that restores nothing would train with
    with trainstate.CheckpointManager(tmp_path, every_steps=EVERY) as manager:
        start = manager.restore_latest(resumed)
        assert start == 17
        if forget == "dropout":
            nnx.update(resumed["model"], nnx.state(fresh["model"], nnx.RngState))
        elif forget == "order":
            resumed["order"] = fresh["order"]  # the epoch starts over, as a loader without state would
        train(resumed, start, STEPS, lambda step: manager.save(step, resumed))
    got = leaves(resumed)
    if forget is None:
        assert_bit_identical(reference, got)
    else:
        for path in (
            "['model']['hidden']['kernel'].value",
            "['optimizer']['opt_state'][0]['mu']['hidden']['kernel'].value",
        ):
            assert not np.array_equal(reference[path], got[path]), path
