"""The example closing docs/format.md is what trainstate writes and reads today.

test_spec_reader.py reads the spec-example fixture without trainstate and checks that the document shows its
bytes; these tests tie the same fixture to the library: it loads, and a fresh save of the same state writes
the same data file and the same manifest (apart from the time, the writer's version and the checksum).
"""

from __future__ import annotations

import json

from make_spec_example import FIXTURE, METADATA, example_state
from test_spec_reader import example_values

import trainstate
from helpers import assert_same


def test_the_spec_example_loads():
    state = trainstate.load(FIXTURE)
    assert_same(example_values(), state)
    assert state["ema"]["weight"] is state["model"]["weight"]
    with trainstate.open(FIXTURE) as ck:
        ck.verify()
        assert ck.metadata == METADATA


def _comparable(raw: bytes) -> dict:
    body = json.loads(raw)
    for volatile in ("created", "writer", "checksum"):
        body.pop(volatile)
    return body


def test_a_fresh_save_writes_the_spec_example(tmp_path):
    trainstate.save(tmp_path / "c", example_state(), metadata=METADATA, threads=1)
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == sorted(p.name for p in FIXTURE.iterdir())
    data = "data-00000.safetensors"
    assert (tmp_path / "c" / data).read_bytes() == (FIXTURE / data).read_bytes()
    fresh = (tmp_path / "c" / "manifest.json").read_bytes()
    assert _comparable(fresh) == _comparable((FIXTURE / "manifest.json").read_bytes())
