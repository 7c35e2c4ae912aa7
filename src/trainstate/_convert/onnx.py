"""ONNX export: a checkpoint's weights in the user's model, exported by torch.onnx, checked in onnxruntime.

An ONNX file is only worth shipping if it computes what the trained model computes. So the export is
checked before it is committed: the file is written to a hidden staging directory beside ``out``, run in
onnxruntime on the example inputs, compared with the torch model's outputs, and only then renamed into
place. A file that disagrees never appears at ``out``.

Exporter: ``torch.onnx.export(..., dynamo=True)`` (torch.export + onnxscript). It is torch's default and
only maintained exporter since 2.9; the TorchScript exporter (``dynamo=False``) is deprecated, warns on
every call, and cannot trace current Hugging Face models (transformers 5's ``BertModel`` fails with
"got multiple values for argument 'use_cache'"). The dynamo exporter runs offline: onnxscript is pure
Python and downloads nothing. Its first call in a process costs a few seconds of set-up.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainstate import _keys
from trainstate._convert.select import weights
from trainstate._format.run_dir import staging_name
from trainstate._optional import optional
from trainstate._restore.checkpoint import Checkpoint
from trainstate._storage import Source
from trainstate._storage.local import fsync_path
from trainstate.errors import (
    CheckpointExistsError,
    InvalidArgumentError,
    OnnxExportError,
    StateMismatchError,
    StorageError,
)

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = ["export_onnx"]

_NEEDED_FOR = "trainstate.export_onnx"


def export_onnx(
    ckpt: Source | Checkpoint,
    model_factory: Callable[[], torch.nn.Module],
    example_inputs: Any,
    out: str | os.PathLike[str],
    *,
    select: str | list[str] | None = None,
    strip_prefix: str | None = None,
    opset: int | None = None,
    rtol: float = 1e-3,
    atol: float = 1e-4,
    dynamic_shapes: Any = None,
    external_data: bool = False,
    overwrite: bool = False,
    key: _keys.KeyLike | None = None,
    key_env: str | None = None,
) -> Path:
    """Export a checkpoint's model to an ONNX file, checked in onnxruntime against torch.

    Builds the model with ``model_factory()``, copies the checkpoint's weights into it (every tensor of
    the model must be in the checkpoint, with its shape), switches it to eval mode, exports it with
    ``torch.onnx.export(dynamo=True)``, runs the file in onnxruntime on ``example_inputs`` and compares
    each output with the torch model's (``|onnx - torch| <= atol + rtol * |torch|``). Only a file that
    passes is renamed to ``out``.

    Args:
        ckpt: a checkpoint path, or an opened :class:`trainstate.Checkpoint`.
        model_factory: builds the untrained model, e.g. ``lambda: Net(**config)``; its ``state_dict()``
            names are what the checkpoint's (stripped) names must match.
        example_inputs: the forward's inputs: a tensor, a tuple of positional arguments, or a dict of
            keyword arguments. Their shapes are fixed in the exported graph unless ``dynamic_shapes``
            says otherwise.
        out: the ``.onnx`` file to write.
        select: glob patterns over the checkpoint's dotted keys naming the model's tensors
            (default: the first module in the saved state).
        strip_prefix: removed from each selected key to give the model's names (default: the module's
            prefix when ``select`` is not given, else nothing).
        opset: the ONNX opset to target (default: torch's recommended one).
        rtol: the relative tolerance of the onnxruntime check.
        atol: its absolute tolerance.
        dynamic_shapes: which input dimensions stay variable in the graph, as ``torch.onnx.export`` takes
            them (``({0: "batch"},)``: the first argument's first dimension); the check runs at the
            example's sizes.
        external_data: write the weights to ``<out>.data`` beside the graph (models over 2 GB always do).
        overwrite: replace an existing ``out``.
        key: the key of an encrypted checkpoint (given as a path). The ONNX file is not encrypted.
        key_env: the name of an environment variable that holds the key, instead of ``key``.

    Returns:
        The path of the written file.

    Raises:
        StateMismatchError: the model from ``model_factory`` does not fit the checkpoint's tensors.
        OnnxExportError: torch.onnx could not export the model, or onnxruntime's outputs differ from
            torch's beyond the tolerances (the message and ``max_abs_diff`` say by how much).
        MissingDependencyError: torch, onnx, onnxscript or onnxruntime is not installed.

    Example:
        >>> trainstate.save("ckpt", {"model": model, "optim": opt, "step": 100})
        >>> trainstate.export_onnx("ckpt", lambda: Net(), torch.randn(1, 4), "net.onnx")
    """
    with optional("torch", extra="onnx", needed_for=_NEEDED_FOR):
        import torch
    with optional("onnx", extra="onnx", needed_for=_NEEDED_FOR):
        import onnx  # noqa: F401  (the exporter needs it; fail here with the extra's name, not deep in torch)
    with optional("onnxscript", extra="onnx", needed_for=_NEEDED_FOR):
        import onnxscript  # noqa: F401
    with optional("onnxruntime", extra="onnx", needed_for=_NEEDED_FOR):
        import onnxruntime  # type: ignore[import-untyped]  # noqa: F401
    for name, value in (("rtol", rtol), ("atol", atol)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise InvalidArgumentError(f"{name} must be a non-negative number, got {value!r:.40}")
    if opset is not None and (isinstance(opset, bool) or not isinstance(opset, int) or opset < 1):
        raise InvalidArgumentError(f"opset must be a positive int or None, got {opset!r:.40}")
    target = Path(out)
    if target.exists() and not overwrite:
        raise CheckpointExistsError(f"{target} already exists: pass overwrite=True to replace it")
    args, kwargs = _inputs(example_inputs)

    ck = ckpt if isinstance(ckpt, Checkpoint) else Checkpoint(ckpt, key=key, key_env=key_env)
    try:
        names = {w.name: w.stored for w in weights(ck, select, strip_prefix)}
        try:
            model = model_factory()
        except Exception as e:  # the user's code: said as such, with its cause, not as a trainstate bug
            raise OnnxExportError(f"model_factory() raised {type(e).__name__}: {e}") from e
        if not isinstance(model, torch.nn.Module):
            raise InvalidArgumentError(f"model_factory() must return a torch.nn.Module, got {type(model).__name__}")
        _load_weights(ck, model, names)
    finally:
        if ck is not ckpt:
            ck.close()
    model.eval()
    try:
        with torch.no_grad():
            expected = _tensors(model(*args, **kwargs))
    except Exception as e:  # wrong example inputs, most often
        raise OnnxExportError(
            f"the model's forward on example_inputs raised {type(e).__name__}: {e} (do the inputs fit the model?)"
        ) from e
    with _folding_failures_held():
        try:
            program = torch.onnx.export(
                model,
                args,
                kwargs=kwargs,
                dynamo=True,
                opset_version=opset,
                dynamic_shapes=dynamic_shapes,
                verbose=False,
            )
        except Exception as e:  # torch.export / onnxscript raise many kinds; the user gets one, with the cause
            raise OnnxExportError(f"torch.onnx.export could not export {type(model).__name__}: {e}") from e
        if program is None:  # only the TorchScript exporter returns None
            raise OnnxExportError("torch.onnx.export returned no ONNX program")

        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.parent / staging_name(target.name, "tmp")
        staging.mkdir()
        try:
            staged = staging / target.name
            program.save(staged, external_data=external_data)
            _check_opset(staged, opset)
            _check(staged, args, kwargs, expected, rtol=rtol, atol=atol)
            _commit(staging, target, overwrite=overwrite)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


_FOLDING_LOGGER = "onnxscript.optimizer._constant_folding"


class _Held(logging.Filter):
    """Keeps back the constant folder's "Evaluation failed: ..." warnings (see _folding_failures_held)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and str(record.msg).startswith("Evaluation failed"):
            self.records.append(record)
            return False
        return True


@contextlib.contextmanager
def _folding_failures_held() -> Iterator[None]:
    """Hold onnxscript's "Evaluation failed: ..." warnings until the export is known to have worked.

    The exporter's optimizer tries to fold constant subexpressions with ONNX's reference evaluator and logs
    that at WARNING whenever the evaluator cannot run a node; the node stays unfolded and the export goes
    on. After an export that onnxruntime then checked, the warning is noise that reads like a failure, so
    it is dropped; when the export or its check fails it is logged after all, as a possible clue.
    """
    logger = logging.getLogger(_FOLDING_LOGGER)
    held = _Held()
    logger.addFilter(held)
    try:
        yield
    except BaseException:
        logger.removeFilter(held)
        for record in held.records:
            logger.handle(record)
        raise
    finally:
        logger.removeFilter(held)


def _inputs(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` for the forward: a tensor is one argument, a tuple or list the positional ones,
    a mapping the keyword ones."""
    if isinstance(example_inputs, Mapping):
        if not all(isinstance(k, str) for k in example_inputs):
            raise InvalidArgumentError("example_inputs given as a mapping must have str keys (keyword arguments)")
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def _load_weights(ck: Checkpoint, model: torch.nn.Module, names: dict[str, str]) -> None:
    """Copy each checkpoint tensor into the model's own, after checking that every name and shape fits."""
    import torch

    own = model.state_dict()
    missing = [k for k in own if k not in names]
    unexpected = [k for k in names if k not in own]
    mismatched = [
        (k, f"tensor {list(own[k].shape)}", f"tensor {list(ck.info(n).shape)}")
        for k, n in names.items()
        if k in own and tuple(own[k].shape) != ck.info(n).shape
    ]
    if missing or unexpected or mismatched:
        raise StateMismatchError(
            missing,
            unexpected,
            mismatched,
            hint="model_factory() must build the architecture that was trained (same layers and sizes); "
            "select= / strip_prefix= choose which of the checkpoint's tensors are the model's and how their "
            "names map to its state_dict() names",
        )
    with torch.no_grad():
        for key, name in names.items():
            own[key].copy_(ck.read(name, framework="torch"))  # casts a bf16 / fp16 checkpoint to the model's dtype


def _tensors(outputs: Any) -> list[torch.Tensor]:
    """The tensors of a forward's result in the order the exporter flattens it (tuples, dicts, HF outputs)."""
    import torch
    from torch.utils import _pytree  # the flattening torch.onnx itself applies to outputs

    return [leaf for leaf in _pytree.tree_leaves(outputs) if isinstance(leaf, torch.Tensor)]


def _numpy(t: torch.Tensor) -> np.ndarray[Any, Any]:
    import torch

    t = t.detach().cpu()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def _check_opset(path: Path, opset: int | None) -> None:
    """torch.onnx may write another opset than the one asked for (when it cannot convert down, it says so in
    a log and keeps its own): a file an older runtime cannot load must not pass as the one requested."""
    if opset is None:
        return
    import onnx

    got = {o.domain: o.version for o in onnx.load(str(path), load_external_data=False).opset_import}
    if got.get("", got.get("ai.onnx")) != opset:
        raise OnnxExportError(
            f"asked for opset {opset}, but torch.onnx wrote opset {got.get('', got.get('ai.onnx'))}: it could not "
            "convert this model to that opset; pick another (or leave opset=None for torch's own)"
        )


def _check(
    path: Path,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    expected: list[torch.Tensor],
    *,
    rtol: float,
    atol: float,
) -> None:
    """Run the file in onnxruntime and compare every output with torch's; raise on the first that differs."""
    import numpy as np
    import onnxruntime as ort

    feeds = _tensors((args, kwargs))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inputs = [i.name for i in session.get_inputs()]
    if len(inputs) != len(feeds):
        raise OnnxExportError(
            f"the exported graph takes {len(inputs)} inputs {inputs}, the example inputs hold {len(feeds)} tensors"
        )
    got = session.run(None, {n: _numpy(t) for n, t in zip(inputs, feeds)})
    outputs = [o.name for o in session.get_outputs()]
    if len(got) != len(expected):
        raise OnnxExportError(
            f"the ONNX model returns {len(got)} outputs {outputs}, the torch model {len(expected)} tensors"
        )
    for i, (name, g, e) in enumerate(zip(outputs, got, expected)):
        want = _numpy(e)
        have = np.asarray(g)
        if have.shape != want.shape:
            raise OnnxExportError(
                f"output {i} ({name}) has shape {list(have.shape)} in onnxruntime, {list(want.shape)} in torch"
            )
        a, b = have.astype(np.float64), want.astype(np.float64)
        close = np.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
        if not close.all():
            diff = np.abs(a - b)
            worst = float(np.nanmax(np.where(np.isnan(diff), np.inf, diff)))
            raise OnnxExportError(
                f"output {i} ({name}) differs between onnxruntime and torch: max |difference| {worst:.3g} "
                f"({int((~close).sum())} of {close.size} values outside atol={atol:g} + rtol={rtol:g} * |torch|). "
                "A forward that depends on Python-side state, training mode or randomness exports a different "
                "graph than it runs; if the difference is float rounding, loosen rtol / atol",
                max_abs_diff=worst,
                output=name,
            )


def _commit(staging: Path, target: Path, *, overwrite: bool) -> None:
    """Move the staged files into place: weights first, the graph last (its appearance is the commit)."""
    files = sorted(staging.iterdir(), key=lambda p: p.name == target.name)
    if target.exists() and not overwrite:
        raise CheckpointExistsError(f"{target} appeared while it was exported: pass overwrite=True to replace it")
    try:
        for f in files:
            fsync_path(f)
        for f in files:
            os.replace(f, target.parent / f.name)
        fsync_path(target.parent)
    except OSError as e:
        raise StorageError(e.errno, f"cannot write {target}: {e.strerror}") from e
