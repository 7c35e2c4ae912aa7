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
    """Base class of every error trainstate raises on purpose."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint exists at the given location."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A checkpoint already exists where a save was asked to write (pass ``overwrite=True``)."""


class IncompleteCheckpointError(CheckpointError):
    """The location holds data but no manifest: the save that made it never committed."""


class CorruptCheckpointError(CheckpointError):
    """The checkpoint's bytes do not match what its manifest promises, or the manifest is malformed."""


class TamperedCheckpointError(CorruptCheckpointError):
    """An encrypted checkpoint failed authentication with the right key: its manifest's MAC does not match
    its bytes, or a chunk's AES-GCM tag does not verify (its bytes, its nonce or its place were changed, or
    it was moved from another tensor). Damage and forgery look the same; either way nothing from it is used."""


class EncryptionKeyError(CheckpointError):
    """The encryption key given (or not given) does not fit the checkpoint. Nothing was read from it; the
    checkpoint is not damaged. The subclasses say which way it does not fit."""


class KeyRequiredError(EncryptionKeyError):
    """The checkpoint is encrypted and no key was given: pass ``key=`` or ``key_env=`` (CLI: ``--key-env``)."""


class WrongKeyError(EncryptionKeyError):
    """The checkpoint is encrypted with another key (its manifest's key check does not match the key given)."""


class NotEncryptedError(EncryptionKeyError):
    """A key was given, but the checkpoint is a plain one. A plain checkpoint is not authenticated, so
    where a key was expected one may have been put in place by someone without the key: trainstate does
    not open it with a key. Open it without one to read it as a plain checkpoint."""


class FormatVersionError(CheckpointError):
    """The checkpoint was written by a newer trainstate (a newer major format version, or a byte
    transform this version does not know). It is not damaged: upgrade trainstate to read it. A manager
    refuses to start beside one rather than skip it and later save over it."""


class StateMismatchError(CheckpointError):
    """The restore target does not fit the checkpoint.

    Attributes:
        missing: keys the target has and the checkpoint lacks.
        unexpected: keys the checkpoint has and the target lacks.
        mismatched: ``(key, expected, found)`` triples for shape, dtype or kind differences.
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
    """A value in the state cannot be stored without pickle."""


class StorageError(CheckpointError, OSError):
    """The storage failed: disk full, an I/O error, a permission problem."""


class MissingDependencyError(CheckpointError, ImportError):
    """An optional dependency is needed; the message names the extra to install."""


class DistributedError(CheckpointError):
    """A collective save or load did not complete on every rank: another rank failed (its message is
    included) or did not answer within the timeout. A save that raises this committed nothing."""


class OnnxExportError(CheckpointError):
    """``export_onnx`` could not produce a faithful ONNX file: torch.onnx failed to export the model, or
    the file run in onnxruntime gives outputs that differ from the torch model's beyond the tolerances.
    Nothing was written to the output path.

    Attributes:
        max_abs_diff: the largest absolute difference of the output that differs (None if the export
            itself failed or the outputs do not even have the same count or shape).
        output: the ONNX name of that output (None likewise).
    """

    def __init__(self, message: str, *, max_abs_diff: float | None = None, output: str | None = None) -> None:
        super().__init__(message)
        self.max_abs_diff = max_abs_diff
        self.output = output


class InvalidArgumentError(CheckpointError, ValueError, TypeError):
    """An argument to a trainstate call is wrong (``every_steps=0``, ``save("10", ...)``, a NaN metric).

    Also a ``ValueError`` and a ``TypeError``, so code written against the built-in errors still catches it.
    """


class UnknownKeyError(InvalidArgumentError, KeyError):
    """``ck.read(name)`` or ``ck.info(name)`` for a name the checkpoint does not hold (also a ``KeyError``)."""

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
