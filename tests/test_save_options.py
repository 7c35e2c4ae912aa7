"""save_options: every write option checked once, and the one table of which features combine."""

from __future__ import annotations

import pytest

import trainstate
from trainstate._save.options import SaveOptions, save_options

KEY = "00" * 32

REFUSED = "not supported"


@pytest.mark.parametrize(
    ("given", "refused"),
    [
        ({}, False),
        ({"compression": "zstd"}, False),  # each rank compresses its own chunks
        ({"key": KEY}, False),  # each rank encrypts its own chunks; rank 0 authenticates the manifest
        ({"key": KEY, "compression": "zstd"}, False),
        ({"incremental": True}, True),
        ({"compression": "zstd", "collective": False}, False),  # each rank saves its own
        ({"key": KEY, "read_only": True}, False),  # a reader writes nothing
        ({"incremental": True, "read_only": True}, False),
    ],
)
def test_what_a_collective_save_refuses(given: dict[str, object], refused: bool) -> None:
    if "compression" in given:
        pytest.importorskip("zstandard")
    if refused:
        with pytest.raises(trainstate.InvalidArgumentError, match=REFUSED):
            save_options(group_size=4, **given)  # type: ignore[arg-type]
        save_options(group_size=1, **given)  # type: ignore[arg-type]  # one process: all of it combines
    else:
        options = save_options(group_size=4, **given)  # type: ignore[arg-type]
        assert options.collective is (given.get("collective") is not False and not given.get("read_only"))


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
