"""torch tensors and objects, as the save and restore core sees them: its one adapter for torch (the other
modules that import torch are listed in ``_frameworks/__init__.py``).

Tensors on an accelerator are staged through host memory; reads into them go through a host buffer
and ``copy_``, so a restored tensor keeps its device. The object hooks tell restore how to treat an
``nn.Module`` and a ``DataLoader`` (see :class:`trainstate._frameworks.Adapter`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from trainstate._format import dtypes
from trainstate._optional import optional
from trainstate.errors import UnsupportedValueError

with optional("torch", extra="torch", needed_for="torch tensors (framework='torch')"):
    import torch

KIND = "torch"


def is_array(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _check_plain(t: torch.Tensor) -> None:
    # Quantized and nested tensors report the ordinary strided layout: ask about them first.
    if t.is_quantized:
        raise UnsupportedValueError(
            f"a quantized tensor ({t.dtype}, {t.qscheme()}) cannot be stored: store t.dequantize(), or "
            "t.int_repr() together with its scale and zero point (t.q_scale(), t.q_zero_point(); per channel: "
            "t.q_per_channel_scales(), t.q_per_channel_zero_points(), t.q_per_channel_axis())"
        )
    if t.is_nested:
        raise UnsupportedValueError(
            "a nested tensor cannot be stored: store t.unbind() (a list of tensors), or t.to_padded_tensor(0)"
        )
    if t.layout != torch.strided:
        raise UnsupportedValueError(f"a torch tensor with layout {t.layout} cannot be stored: store t.to_dense()")
    if t.device.type == "meta":
        raise UnsupportedValueError("a meta tensor has no data to store")
    if str(t.dtype).removeprefix("torch.") not in dtypes.BY_TORCH_NAME:
        raise UnsupportedValueError(f"torch dtype {t.dtype} cannot be stored")


def has_values(value: Any) -> bool:
    return True


def describe(value: torch.Tensor) -> tuple[str, tuple[int, ...], str]:
    _check_plain(value)
    if _is_dtensor(value):
        _check_one_box(value)
    return dtypes.BY_TORCH_NAME[str(value.dtype).removeprefix("torch.")].code, tuple(value.shape), KIND


def identity(value: torch.Tensor) -> tuple[object, ...] | None:
    if value.numel() == 0:
        return None
    storage = value.untyped_storage()
    return (
        "torch",
        str(value.device),
        storage.data_ptr(),
        value.storage_offset(),
        tuple(value.shape),
        value.stride(),
        str(value.dtype),
        value.is_conj(),  # a conjugate or negative view of the same memory holds other values
        value.is_neg(),
    )


def local_part(value: Any) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """A DTensor's local shard and its offset in the global tensor (uneven shards included)."""
    if not _is_dtensor(value):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local: torch.Tensor = value.to_local()
    shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    if tuple(local.shape) != tuple(shape):  # padded shards: keep the part that belongs to the tensor
        local = local[tuple(slice(0, n) for n in shape)]
    return local, tuple(int(o) for o in offset)


def _is_dtensor(value: Any) -> bool:
    cls = type(value)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


def _is_strided(placement: Any) -> bool:
    return type(placement).__name__ == "_StridedShard"


def _check_one_box(value: Any) -> None:
    """Refuse a DTensor whose local shard is not one box of the whole tensor.

    A ``_StridedShard`` (FSDP2 over tensor parallelism shards "right to left") can give a rank rows that are
    not contiguous, e.g. rows 0-1 and 4-5. The format stores one box per chunk, and torch's
    ``compute_local_shape_and_global_offset`` reports only the first offset of such a shard, so it is
    checked here, with the every-index form of the same computation, before any byte is written or read.
    FSDP2 over TP on evenly nested meshes gives one box per rank, and passes.
    """
    if not any(_is_strided(p) for p in value.placements):
        return  # Shard and Replicate placements always leave one box
    shape = tuple(int(n) for n in value.shape)
    try:
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor._utils import _get_shard_size_and_offsets

        mesh = value.device_mesh
        coordinate = mesh.get_coordinate()
        sizes: list[int] = list(shape)
        indices: dict[int, Any] = {}
        for mesh_dim, p in enumerate(value.placements):
            if isinstance(p, Shard) or _is_strided(p):
                d = p.dim
                sizes[d], indices[d] = _get_shard_size_and_offsets(
                    sizes[d], mesh.size(mesh_dim), coordinate[mesh_dim], p, indices.get(d), shape[d], False
                )
    except (ImportError, AttributeError, TypeError) as e:  # the private helper moved in another torch
        raise UnsupportedValueError(
            f"a DTensor placed as {tuple(value.placements)} on torch {torch.__version__}: trainstate cannot tell "
            f"whether this rank's shard is one box of the tensor ({e}); redistribute it to Shard / Replicate "
            "placements before saving or loading"
        ) from None
    for d, index in indices.items():
        n = sizes[d]
        if n and not torch.equal(index[:n].cpu(), torch.arange(int(index[0]), int(index[0]) + n)):
            rows = index[:n].tolist()
            raise UnsupportedValueError(
                f"a DTensor placed as {tuple(value.placements)}: this rank holds indices {rows[:8]}"
                f"{'...' if n > 8 else ''} of dimension {d} (of {shape[d]}), which are not one contiguous box; "
                "trainstate stores one box per chunk. Redistribute it (e.g. to Shard(dim) placements) before "
                "saving or loading"
            )


def byte_view(value: torch.Tensor) -> memoryview:
    t = value.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.numel() == 0:  # no bytes; an empty expanded view (stride 0) has no byte view either
        return memoryview(b"")
    t = t.resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().data


def empty(code: str, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.empty(shape, dtype=getattr(torch, dtypes.from_code(code).torch_name))


def writable_view(target: Any) -> memoryview | None:
    if (
        isinstance(target, torch.Tensor)
        and target.device.type == "cpu"
        and target.is_contiguous()
        and target.layout == torch.strided
        and not target.is_conj()
        and not target.is_neg()
    ):
        return target.detach().reshape(-1).view(torch.uint8).numpy().data
    return None


def on_accelerator(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type not in ("cpu", "meta")


def staging(nbytes: int, like: Any) -> np.ndarray:
    """Page-locked for CUDA: a host-to-device copy from it ran 7x faster than from ordinary memory (H100,
    bench/bench_gpu.py), and it is allocated once per restore, reused round after round."""
    pinned = like.device.type == "cuda" and torch.cuda.is_available()
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned).numpy()  # the array keeps the tensor


def cuttable(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_contiguous()


def copy_in_async(pairs: list[tuple[Any, int | None, np.ndarray]]) -> Callable[[], list[Any]]:
    """CUDA targets: copies from (pinned) host memory queued on a stream of trainstate's own per device, after
    the work already queued on the device's current stream; the wait returned synchronizes on an event of
    each stream used. Other devices copy before this returns."""
    events = []
    streams: dict[torch.device, Any] = {}
    with torch.no_grad():
        for target, offset, host in pairs:
            source = torch.from_numpy(host)
            if target.device.type != "cuda":
                _copy_into(target, offset, source, non_blocking=False)
                continue
            stream = streams.get(target.device)
            if stream is None:
                stream = streams[target.device] = _copy_stream(target.device)
                stream.wait_stream(torch.cuda.current_stream(target.device))  # after what the loop queued
            with torch.cuda.stream(stream):
                _copy_into(target, offset, source, non_blocking=True)
        for stream in streams.values():
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
            events.append(event)

    def wait() -> list[Any]:
        for event in events:
            event.synchronize()
        return [target for target, _, _ in pairs]

    return wait


def _copy_into(target: torch.Tensor, offset: int | None, source: torch.Tensor, *, non_blocking: bool) -> None:
    if offset is None:
        target.copy_(source.view(target.dtype).view(target.shape), non_blocking=non_blocking)
    else:
        flat = target.view(-1).view(torch.uint8) if target.dim() else target.view(1).view(torch.uint8)
        flat[offset : offset + source.numel()].copy_(source, non_blocking=non_blocking)


_streams: dict[torch.device, Any] = {}


def _copy_stream(device: torch.device) -> Any:
    """The CUDA stream restores copy on, one per device, made once."""
    stream = _streams.get(device)
    if stream is None:
        stream = _streams[device] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
    return stream


def copy_out(pairs: list[tuple[Any, np.ndarray]]) -> None:
    cuda = False
    with torch.no_grad():
        for value, host in pairs:
            if not on_accelerator(value):
                np.copyto(host, np.frombuffer(byte_view(value), dtype=np.uint8))
                continue
            source = value.detach().contiguous().reshape(-1).view(torch.uint8)
            torch.from_numpy(host).copy_(source, non_blocking=True)  # async into pinned memory: one wait below
            cuda = True
    if cuda:
        torch.cuda.synchronize()


def copy_range_out(value: Any, offset: int, host: np.ndarray) -> None:
    with torch.no_grad():
        flat = value.detach().reshape(-1).view(torch.uint8) if value.dim() else value.detach().view(1).view(torch.uint8)
        torch.from_numpy(host).copy_(flat[offset : offset + host.nbytes])  # a device's copy is waited for


def finish(array: torch.Tensor, kind: str) -> Any:
    return array


def assign(target: Any, source: torch.Tensor) -> Any:
    """Copy ``source`` (host) into a live tensor, keeping its device; else return ``source``."""
    if isinstance(target, torch.Tensor):
        with torch.no_grad():
            target.copy_(source)
        return target
    return source


def from_numpy(array: np.ndarray) -> torch.Tensor:
    """A torch tensor sharing ``array``'s memory (bfloat16 / float8 go through a byte view)."""
    code = dtypes.from_numpy(array.dtype).code
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    dtype = getattr(torch, dtypes.from_code(code).torch_name)
    return torch.from_numpy(flat).view(dtype).reshape(array.shape)


def unwrap(obj: Any) -> Any:
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    while True:
        if isinstance(obj, wrappers):
            obj = obj.module
        elif type(obj).__name__ == "OptimizedModule" and isinstance(getattr(obj, "_orig_mod", None), torch.nn.Module):
            obj = obj._orig_mod
        else:
            return obj


def load_takes_strict(obj: Any) -> bool:
    return isinstance(obj, torch.nn.Module)


def ignored_on_load(module: Any) -> tuple[list[str], list[str]]:
    """The key patterns (regexes, searched in each name) ``from_pretrained`` lets a model's checkpoint lack
    (missing) or hold beyond the model's own (unexpected): for a transformers ``PreTrainedModel``, its class's
    ``_keys_to_ignore_on_load_missing`` / ``_keys_to_ignore_on_load_unexpected`` (collected from its
    submodels), and, as transformers adds them, ``position_ids`` and ``rotary_emb.inv_freq`` when the model
    has such a buffer (older checkpoints persisted buffers the class no longer does). Nothing for other
    modules."""
    transformers = sys.modules.get("transformers")
    base = getattr(transformers, "PreTrainedModel", None) if transformers is not None else None
    if not isinstance(base, type) or not isinstance(module, base) or not isinstance(module, torch.nn.Module):
        return [], []
    missing = [str(p) for p in getattr(module, "_keys_to_ignore_on_load_missing", None) or ()]
    unexpected = [str(p) for p in getattr(module, "_keys_to_ignore_on_load_unexpected", None) or ()]
    buffers = [name for name, _ in module.named_buffers()]
    if any(name.endswith("rotary_emb.inv_freq") for name in buffers):
        unexpected.append(r"rotary_emb\.inv_freq")
    if any(name.endswith("position_ids") for name in buffers):
        unexpected.append(r"(^|\.)position_ids$")
    return missing, unexpected


def rebuilt_from_checkpoint(obj: Any) -> bool:
    return isinstance(obj, torch.utils.data.DataLoader)


def after_restore(restored: Any) -> None:
    from trainstate._data import arm_exact_resume  # imports torch.utils.data, as this module's callers have

    arm_exact_resume(restored)
