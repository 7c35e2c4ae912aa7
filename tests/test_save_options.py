"""save_options: every write option checked once, and the one table of which features combine."""

from __future__ import annotations

import pytest

import trainstate
from trainstate._save.options import SaveOptions, save_options

KEY = "00" * 32


@pytest.mark.parametrize(
    "given",
    [
        {},
        {"compression": "zstd"},  # each rank compresses its own chunks
        {"key": KEY},  # each rank encrypts its own chunks; rank 0 authenticates the manifest
        {"key": KEY, "compression": "zstd"},
        {"incremental": True},  # each rank shares its own unchanged boxes through the run's pool
        {"incremental": True, "key": KEY, "compression": "zstd"},
        {"compression": "zstd", "collective": False},  # each rank saves its own
        {"key": KEY, "read_only": True},  # a reader writes nothing
        {"incremental": True, "read_only": True},
    ],
)
def test_every_feature_combines_under_a_process_group_as_in_one_process(given: dict[str, object]) -> None:
    if "compression" in given:
        pytest.importorskip("zstandard")
    for size in (1, 4):
        options = save_options(group_size=size, **given)  # type: ignore[arg-type]
        assert options.collective is (size > 1 and given.get("collective") is not False and not given.get("read_only"))
        assert options.incremental is bool(given.get("incremental"))
        assert (options.key is not None) is ("key" in given)


@pytest.mark.parametrize(
    "given",
    [{"threads": 0}, {"workers": 0}, {"fsync": "yes"}, {"overwrite": 1}, {"collective": "no"}, {"compression": "lz4"}],
)
def test_a_bad_write_option_is_an_invalid_argument(given: dict[str, object]) -> None:
    with pytest.raises(trainstate.InvalidArgumentError):
        save_options(**given)  # type: ignore[arg-type]


def test_the_options_are_resolved_and_frozen() -> None:
    options = save_options(threads=3, key=KEY)
    assert isinstance(options, SaveOptions) and options.threads == 3 and options.key is not None
    assert options.encoding is not None and "aes-256-gcm" in options.encoding.names  # a key always encrypts
    assert KEY not in repr(options)
    with pytest.raises(AttributeError):
        options.threads = 4  # type: ignore[misc]


def test_the_front_doors_refuse_a_bad_option_alike(tmp_path) -> None:
    for call in (
        lambda: trainstate.save(tmp_path / "c", {}, threads=0),
        lambda: trainstate.CheckpointManager(tmp_path / "run", threads=0),
        lambda: trainstate.consolidate(tmp_path / "c", tmp_path / "d", threads=0),
    ):
        with pytest.raises(trainstate.InvalidArgumentError, match="threads"):
            call()
