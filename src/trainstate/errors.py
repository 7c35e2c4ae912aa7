"""trainstate's error tree.

Every failure a user can cause or meet — a bad path, a damaged checkpoint, a state that does not
fit — comes out as one of these, never as a traceback from deep inside a dependency::

    CheckpointError
    ├── CheckpointNotFoundError      (also FileNotFoundError)
    ├── CheckpointExistsError        (also FileExistsError)
    ├── IncompleteCheckpointError    no manifest: the save never committed
    ├── CorruptCheckpointError       checksum mismatch, malformed or lying manifest / data file
    │   └── TamperedCheckpointError  an encrypted checkpoint's manifest MAC or a chunk's tag does not verify
    ├── EncryptionKeyError           the key given (or not given) does not fit the checkpoint: nothing was read
    │   ├── KeyRequiredError         it is encrypted and no key was given
    │   ├── WrongKeyError            it is encrypted with another key
    │   └── NotEncryptedError        a key was given, but it is a plain (unauthenticated) checkpoint
    ├── FormatVersionError           written by a newer trainstate: not damage, upgrade to read it
    ├── StateMismatchError           restore target does not fit (missing / unexpected / shape / dtype)
    ├── UnsupportedValueError        (also TypeError) a value the format cannot hold
    ├── StorageError                 (also OSError) disk full, I/O error, permission denied
    ├── MissingDependencyError       (also ImportError) an optional extra is not installed
    ├── DistributedError             a collective save / load failed on another rank, or a rank fell silent
    ├── OnnxExportError              torch.onnx failed, or onnxruntime's outputs differ from torch's
    └── InvalidArgumentError         (also ValueError and TypeError) a call's argument is wrong
        └── UnknownKeyError          (also KeyError) no tensor of that name in the checkpoint
"""

from __future__ import annotations

import re

__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "DistributedError",
    "EncryptionKeyError",
    "FormatVersionError",
    "IncompleteCheckpointError",
    "InvalidArgumentError",
    "KeyRequiredError",
    "MissingDependencyError",
    "NotEncryptedError",
    "OnnxExportError",
    "StateMismatchError",
    "StorageError",
    "TamperedCheckpointError",
    "UnknownKeyError",
    "UnsupportedValueError",
    "WrongKeyError",
]


class CheckpointError(Exception):
    """Base class of every error trainstate raises on purpose.

    Example:
        >>> try:
        ...     trainstate.load("ckpt/step_1200", state)
        ... except trainstate.CheckpointError as e:   # anything trainstate raises on purpose
        ...     print(f"cannot resume: {e}")
    """


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint exists at the given location.

    Example:
        >>> try:
        ...     trainstate.open("ckpt/no_such_step")
        ... except trainstate.CheckpointNotFoundError:   # also a FileNotFoundError
        ...     print("start from scratch")
    """


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A checkpoint already exists where a save was asked to write (pass ``overwrite=True``).

    Example:
        >>> trainstate.save("ckpt/step_5", state)
        >>> trainstate.save("ckpt/step_5", state)                   # raises CheckpointExistsError
        >>> trainstate.save("ckpt/step_5", state, overwrite=True)   # replaces it atomically
    """


class IncompleteCheckpointError(CheckpointError):
    """The location holds data but no manifest: the save that made it never committed.

    Example:
        >>> try:
        ...     trainstate.load("ckpt/step_5", state)   # a save killed before its commit left this behind
        ... except trainstate.IncompleteCheckpointError:
        ...     trainstate.load("ckpt/step_4", state)
    """


class CorruptCheckpointError(CheckpointError):
    """The checkpoint's bytes do not match what its manifest promises, or the manifest is malformed.

    Example:
        >>> try:
        ...     trainstate.open("ckpt/step_5").verify()
        ... except trainstate.CorruptCheckpointError as e:
        ...     print(e)   # names the tensor or file whose checksum does not match
    """


class TamperedCheckpointError(CorruptCheckpointError):
    """An encrypted checkpoint failed authentication with the right key: its manifest's MAC does not match
    its bytes, or a chunk's AES-GCM tag does not verify (its bytes, its nonce or its place were changed, or
    it was moved from another tensor). Damage and forgery look the same; either way nothing from it is used.

    Example:
        >>> try:
        ...     trainstate.load("secret/step_5", state, key_env="TRAINSTATE_KEY")
        ... except trainstate.TamperedCheckpointError:   # also a CorruptCheckpointError
        ...     print("changed since it was saved: not used")
    """


class EncryptionKeyError(CheckpointError):
    """The encryption key given (or not given) does not fit the checkpoint. Nothing was read from it; the
    checkpoint is not damaged. The subclasses say which way it does not fit.

    Example:
        >>> try:
        ...     trainstate.load("secret/step_5", state, key_env="TRAINSTATE_KEY")
        ... except trainstate.EncryptionKeyError as e:   # missing, wrong or unneeded key: nothing was read
        ...     print(e)
    """


class KeyRequiredError(EncryptionKeyError):
    """The checkpoint is encrypted and no key was given: pass ``key=`` or ``key_env=`` (CLI: ``--key-env``).

    Example:
        >>> trainstate.load("secret/step_5", state)   # raises KeyRequiredError: it is encrypted
        >>> trainstate.load("secret/step_5", state, key_env="TRAINSTATE_KEY")
    """


class WrongKeyError(EncryptionKeyError):
    """The checkpoint is encrypted with another key (its manifest's key check does not match the key given).

    Example:
        >>> trainstate.load("secret/step_5", state, key=trainstate.generate_key())   # raises WrongKeyError
    """


class NotEncryptedError(EncryptionKeyError):
    """A key was given, but the checkpoint is a plain one. A plain checkpoint is not authenticated, so
    where a key was expected one may have been put in place by someone without the key: trainstate does
    not open it with a key. Open it without one to read it as a plain checkpoint.

    Example:
        >>> trainstate.save("plain/step_5", state)
        >>> trainstate.load("plain/step_5", state, key=key)   # raises NotEncryptedError
        >>> trainstate.load("plain/step_5", state)            # read it as the plain checkpoint it is
    """


class FormatVersionError(CheckpointError):
    """The checkpoint was written by a newer trainstate (a newer major format version, or a byte
    transform this version does not know). It is not damaged: upgrade trainstate to read it. A manager
    refuses to start beside one rather than skip it and later save over it.

    Example:
        >>> try:
        ...     trainstate.load("ckpt/from_a_newer_version", state)
        ... except trainstate.FormatVersionError:
        ...     print("pip install -U trainstate")
    """


class StateMismatchError(CheckpointError):
    """The restore target does not fit the checkpoint.

    Attributes:
        missing: keys the target has and the checkpoint lacks.
        unexpected: keys the checkpoint has and the target lacks.
        mismatched: ``(key, expected, found)`` triples for shape, dtype or kind differences.
        hint: what to do about it (the message's last line; empty: the default advice).

    Example:
        >>> trainstate.save("ckpt", {"w": np.zeros(3), "step": 1})
        >>> try:
        ...     trainstate.load("ckpt", {"w": np.zeros(4), "lr": 0.1})
        ... except trainstate.StateMismatchError as e:
        ...     e.missing, e.unexpected, e.mismatched
        (['lr'], ['step'], [('w', 'tensor F64[4]', 'tensor F64[3]')])
    """

    def __init__(
        self,
        missing: list[str],
        unexpected: list[str],
        mismatched: list[tuple[str, str, str]],
        hint: str = "",
    ) -> None:
        self.missing = missing
        self.unexpected = unexpected
        self.mismatched = mismatched
        self.hint = hint
        lines = ["the restore target does not match the checkpoint:"]
        if missing:
            lines.append(f"  missing in checkpoint ({len(missing)}): {_short(missing)}")
        if unexpected:
            lines.append(f"  unexpected in checkpoint ({len(unexpected)}): {_short(unexpected)}")
        for key, want, got in mismatched[:20]:
            lines.append(f"  {key}: target has {want}, checkpoint has {got}")
        if len(mismatched) > 20:
            lines.append(f"  ... and {len(mismatched) - 20} more mismatches")
        lines.append(hint or _mismatch_hint(missing, unexpected, mismatched))
        super().__init__("\n".join(lines))


class UnsupportedValueError(CheckpointError, TypeError):
    """A value in the state cannot be stored without pickle.

    Example:
        >>> trainstate.save("ckpt", {"fn": lambda x: x})   # raises UnsupportedValueError: not without pickle
    """


class StorageError(CheckpointError, OSError):
    """The storage failed: disk full, an I/O error, a permission problem.

    Example:
        >>> try:
        ...     trainstate.save("/mnt/full_disk/step_5", state)
        ... except trainstate.StorageError as e:   # also an OSError, with its errno
        ...     print(e.errno, e)
    """


class MissingDependencyError(CheckpointError, ImportError):
    """An optional dependency is needed; the message names the extra to install.

    Example:
        >>> try:
        ...     trainstate.save("ckpt", state, compression="zstd")
        ... except trainstate.MissingDependencyError as e:   # also an ImportError
        ...     print(e)   # names the extra: pip install "trainstate[zstd]"
    """


class DistributedError(CheckpointError):
    """A collective save or load did not complete on every rank: another rank failed (its message is
    included) or did not answer within the timeout. A save that raises this committed nothing.

    Example:
        >>> try:
        ...     trainstate.save("ckpt/step_5", state, timeout=60)   # collective, under torchrun
        ... except trainstate.DistributedError as e:
        ...     print(e)   # which rank failed and why; nothing was committed
    """


class OnnxExportError(CheckpointError):
    """``export_onnx`` could not produce a faithful ONNX file: torch.onnx failed to export the model, or
    the file run in onnxruntime gives outputs that differ from the torch model's beyond the tolerances.
    Nothing was written to the output path.

    Attributes:
        max_abs_diff: the largest absolute difference of the output that differs (None if the export
            itself failed or the outputs do not even have the same count or shape).
        output: the ONNX name of that output (None likewise).

    Example:
        >>> try:
        ...     trainstate.export_onnx("ckpt", lambda: Net(), torch.randn(1, 4), "net.onnx", atol=1e-6)
        ... except trainstate.OnnxExportError as e:
        ...     print(e.output, e.max_abs_diff)
    """

    def __init__(self, message: str, *, max_abs_diff: float | None = None, output: str | None = None) -> None:
        super().__init__(message)
        self.max_abs_diff = max_abs_diff
        self.output = output


class InvalidArgumentError(CheckpointError, ValueError, TypeError):
    """An argument to a trainstate call is wrong (``every_steps=0``, ``save("10", ...)``, a NaN metric).

    Also a ``ValueError`` and a ``TypeError``, so code written against the built-in errors still catches it.

    Example:
        >>> trainstate.CheckpointManager("runs/exp1", every_steps=0)   # raises InvalidArgumentError
        >>> try:
        ...     mgr.save("10", state)
        ... except ValueError:   # InvalidArgumentError is also a ValueError and a TypeError
        ...     pass
    """


class UnknownKeyError(InvalidArgumentError, KeyError):
    """``ck.read(name)`` or ``ck.info(name)`` for a name the checkpoint does not hold (also a ``KeyError``).

    Example:
        >>> with trainstate.open("ckpt") as ck:
        ...     ck.read("model.fc.wieght")   # raises UnknownKeyError: ...; did you mean model.fc.weight?
    """

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


_TENSOR = re.compile(r"^tensor (\w+)(\[.*\])$")  # how restore describes a tensor: "tensor F32[3, 4]"


def _dtype_only(want: str, got: str) -> bool:
    """Whether a mismatch is two tensors of one shape that differ only in dtype (strict=False casts)."""
    a, b = _TENSOR.match(want), _TENSOR.match(got)
    return a is not None and b is not None and a.group(2) == b.group(2)


def _mismatch_hint(missing: list[str], unexpected: list[str], mismatched: list[tuple[str, str, str]]) -> str:
    """What would make this restore go through. strict=False relaxes only missing / unexpected keys and
    dtypes; a different shape or kind fits under no option, so for those it names the keys to exclude."""
    relaxed = [
        what
        for what, present in (
            ("accepts the missing / unexpected keys", bool(missing or unexpected)),
            ("casts the differing dtypes", any(_dtype_only(w, g) for _, w, g in mismatched)),
        )
        if present
    ]
    rigid = [key for key, want, got in mismatched if not _dtype_only(want, got)]
    parts = [f"strict=False {' and '.join(relaxed)}"] if relaxed else []
    if rigid:
        keys = [k for k in rigid if k != "<root>"]
        skip = f", or skip those keys with exclude={keys[:5]!r}" if keys else ""
        more = f" (and {len(keys) - 5} more)" if len(keys) > 5 else ""
        parts.append(f"shapes and kinds must always match: build the target like the saved state{skip}{more}")
    else:
        parts.append("include= / exclude= patterns restore only part of the state")
    return "; ".join(parts)


def _short(keys: list[str], limit: int = 10) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... (+{len(keys) - limit})" if len(keys) > limit else "")
