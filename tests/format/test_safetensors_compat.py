"""Every data file of a single-process checkpoint opens with the safetensors library and matches."""

from __future__ import annotations

import pytest

import trainstate

torch = pytest.importorskip("torch")
safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402


def test_safe_open_reads_every_tensor_under_its_name(tmp_path, training_state):
    state = dict(
        training_state,
        extra={
            "bf16": torch.randn(3, 5).bfloat16(),
            "f8": torch.randn(4).to(torch.float8_e5m2),
            "i64": torch.arange(6).reshape(2, 3),
            "zero_d": torch.tensor(2.0),
        },
    )
    trainstate.save(tmp_path / "c", state)
    seen = {}
    for f in sorted((tmp_path / "c").glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            seen.update({k: s.get_tensor(k) for k in s.keys()})
    with trainstate.open(tmp_path / "c") as ck:
        assert sorted(seen) == sorted(ck.keys())
        for name, tensor in seen.items():
            assert torch.equal(tensor, ck.read(name, framework="torch")), name
    assert torch.equal(seen["model.0.weight"], training_state["model"][0].weight)
    assert torch.equal(seen["extra.bf16"], state["extra"]["bf16"])


def test_dtypes_safetensors_lacks_are_raw_bytes_there(tmp_path):
    t = torch.randn(3, dtype=torch.complex128)
    trainstate.save(tmp_path / "c", {"c": t}, threads=1)
    with safe_open(str(tmp_path / "c" / "data-00000.safetensors"), "pt") as s:
        raw = s.get_tensor("c")
    assert raw.dtype == torch.uint8 and torch.equal(raw.view(torch.complex128), t)


def test_a_tensor_named_like_the_header_metadata_key_keeps_the_file_readable(tmp_path):
    state = {"__metadata__": torch.arange(4, dtype=torch.float32), "__metadata__~": torch.ones(2, dtype=torch.int64)}
    trainstate.save(tmp_path / "c", state, threads=1)
    with safe_open(str(tmp_path / "c" / "data-00000.safetensors"), "pt") as s:
        assert s.metadata() == {"format": "trainstate"}
        assert sorted(s.keys()) == ["__metadata__~", "__metadata__~~"]  # docs/format.md §2
        assert torch.equal(s.get_tensor("__metadata__~"), state["__metadata__"])
        assert torch.equal(s.get_tensor("__metadata__~~"), state["__metadata__~"])
    back = trainstate.load(tmp_path / "c", framework="torch")
    assert list(back) == ["__metadata__", "__metadata__~"]
    assert torch.equal(back["__metadata__"], state["__metadata__"])
    assert torch.equal(back["__metadata__~"], state["__metadata__~"])
    target = {"__metadata__": torch.zeros(4), "__metadata__~": torch.zeros(2, dtype=torch.int64)}
    trainstate.load(tmp_path / "c", target)
    assert torch.equal(target["__metadata__"], state["__metadata__"])


@pytest.mark.parametrize("how", ["zstd", "encrypted"])
def test_safe_open_gives_a_transformed_tensors_stored_bytes_not_the_tensor(tmp_path, how):
    """What the README says safe_open returns for a compressed or encrypted checkpoint: each chunk's stored
    bytes as U8, under the tensor's name when it is one chunk, never the tensor."""
    t = torch.zeros(256, 64)  # compresses well
    options = {"compression": "zstd"} if how == "zstd" else {"key": bytes(range(32))}
    trainstate.save(tmp_path / "c", {"w": t}, threads=1, **options)
    with safe_open(str(tmp_path / "c" / "data-00000.safetensors"), "pt") as s:
        assert list(s.keys()) == ["w"]
        got = s.get_tensor("w")
    assert got.dtype == torch.uint8 and got.shape != t.shape
    assert got.numel() != t.numel() * t.element_size() or not torch.equal(got, t.view(-1).view(torch.uint8))
    with trainstate.open(tmp_path / "c", key=options.get("key")) as ck:
        assert torch.equal(ck.read("w", framework="torch"), t)
