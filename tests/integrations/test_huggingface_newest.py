"""restore_latest and TrainstateCallback.resume_point choose alike: one rule (trainstate/_manager/newest.py).

The same damaged run directory, read through CheckpointManager.restore_latest and through the callback's
resume_point, gives the same checkpoint, or the same error: damage moves on to the checkpoint before it, a key
that does not fit is raised at once.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("torch")

import hf_trainer_run as run  # noqa: E402

import trainstate  # noqa: E402
from trainstate._storage.local import LocalStorage  # noqa: E402
from trainstate.integrations.huggingface import TrainstateCallback  # noqa: E402

KEY = "00" * 32


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with run.one_thread():
        yield


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One epoch (5 updates), saved at 3 and at the end."""
    out = tmp_path_factory.mktemp("saved")
    cb = TrainstateCallback(out / "ckpt")
    trainer = run.trainer(str(out), [cb], num_train_epochs=1, eval_strategy="no")
    with run.one_thread():
        trainer.train()
    return out / "ckpt"


def flip_a_bit(ckpt: Path) -> None:
    data = max((ckpt / "step_00000005").glob("*.safetensors"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0xFF
    data.write_bytes(bytes(raw))


def cut_manifest(ckpt: Path) -> None:
    manifest = ckpt / "step_00000005" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:40])


def lose_a_data_file(ckpt: Path) -> None:
    max((ckpt / "step_00000005").glob("*.safetensors"), key=lambda p: p.stat().st_size).unlink()


def cut_every_manifest(ckpt: Path) -> None:
    for manifest in ckpt.glob("step_*/manifest.json"):
        manifest.write_bytes(manifest.read_bytes()[:40])


def nothing(ckpt: Path) -> None:
    pass


def only_the_newest(ckpt: Path) -> None:
    shutil.rmtree(ckpt / "step_00000003")


class DeletedWhileRead(LocalStorage):
    """A local disk where a job's retention deletes step 5 the moment a reader first reads one of its data files."""

    def __init__(self) -> None:
        self.deleted = False

    def _gone(self, path: str) -> None:
        if not self.deleted and "step_00000005" in path and path.endswith(".safetensors"):
            self.deleted = True
            shutil.rmtree(path.split("step_00000005")[0] + "step_00000005")

    def read_into(self, path: str, offset: int, out: memoryview) -> int:
        self._gone(path)
        return super().read_into(path, offset, out)

    def map(self, path: str) -> Any:
        self._gone(path)
        return super().map(path)


def through_restore_latest(ckpt: Path, key: str | None, storage: Any, target: Path) -> Any:
    """The step restore_latest resumes from (the one saved), or the error it raises."""
    with trainstate.open(str(target)) as ck:
        state = ck.load()  # a state of the run's shape to restore into (what grows, the log, left out)
    del state["trainer_state"]
    manager = trainstate.CheckpointManager(ckpt, read_only=True, capture_rng=False, key=key, storage=storage)
    try:
        resumed = manager.restore_latest(state, exclude=["trainer_state.*"])
        return None if resumed is None else resumed - 1
    except trainstate.CheckpointError as e:
        return e
    finally:
        manager.close()


def through_resume_point(ckpt: Path, key: str | None, storage: Any) -> Any:
    """The step resume_point picks, or the error it raises."""
    options = {"key": key} if key else {}
    cb = TrainstateCallback(ckpt, **options, **({"storage": storage} if storage else {}))
    trainer = run.trainer(str(ckpt.parent), [cb], num_train_epochs=1, eval_strategy="no")
    try:
        cb.resume_point(trainer)
        return cb.resumed_from
    except trainstate.CheckpointError as e:
        return e
    finally:
        cb.manager.close()


@pytest.mark.parametrize(
    ("damage", "key", "storage", "expected"),
    [
        (nothing, None, None, 5),
        (flip_a_bit, None, None, 3),  # a checksum fails: the one before
        (cut_manifest, None, None, 3),  # an unreadable manifest: the one before
        (lose_a_data_file, None, None, 3),  # incomplete: the one before
        (cut_every_manifest, None, None, trainstate.CorruptCheckpointError),  # none restores
        (flip_a_bit, KEY, None, trainstate.EncryptionKeyError),  # a key for a plain run: fatal, never an older one
        (nothing, None, DeletedWhileRead, 3),  # deleted while read: listed again, not damage
        (only_the_newest, None, DeletedWhileRead, None),  # ... and then there is nothing: a fresh start
    ],
    ids=[
        "intact",
        "flipped-bit",
        "cut-manifest",
        "lost-data-file",
        "all-cut",
        "key-for-a-plain-run",
        "deleted-while-read",
        "the-only-one-deleted-while-read",
    ],
)
def test_restore_latest_and_resume_point_choose_alike(
    saved: Path,
    tmp_path: Path,
    damage: Callable[[Path], None],
    key: str | None,
    storage: type[LocalStorage] | None,
    expected: Any,
) -> None:
    run_dirs = []
    for caller in ("manager", "callback"):  # each its own copy: a storage here deletes what it reads
        ckpt = tmp_path / caller / "ckpt"
        shutil.copytree(saved, ckpt)
        damage(ckpt)
        run_dirs.append(ckpt)
    target = saved / "step_00000003"
    by_manager = through_restore_latest(run_dirs[0], key, storage and storage(), target)
    by_callback = through_resume_point(run_dirs[1], key, storage and storage())
    if expected is None or isinstance(expected, int):
        assert by_manager == by_callback == expected
        return
    assert isinstance(by_manager, expected), by_manager
    assert type(by_manager) is type(by_callback), (by_manager, by_callback)
    if expected is trainstate.CorruptCheckpointError:  # the same checkpoints listed, for the same reasons
        names = [line.split(":")[0] for line in str(by_manager).splitlines()[1:3]]
        assert names == ["  step_00000003", "  step_00000005"] or names == ["  step_00000005", "  step_00000003"]
        listed = [str(e).replace(str(d), "RUN").splitlines()[1:3] for e, d in zip((by_manager, by_callback), run_dirs)]
        assert listed[0] == listed[1]
