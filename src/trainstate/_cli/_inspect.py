"""``trainstate inspect``: a checkpoint's metadata, plain values and tensor table; manifests only, no tensor byte is read."""

from __future__ import annotations

import argparse
import fnmatch
from typing import Any

from trainstate._cli._args import Subparsers, command
from trainstate._cli._open import manifest_size, open_ckpt, shared_size
from trainstate._cli._output import Printer, Table, local_time, short, size
from trainstate._cli._values import leaves
from trainstate._format.manifest import TensorEntry


def add_parser(sub: Subparsers) -> None:
    p = command(sub, "inspect", "show a checkpoint's metadata, plain values and tensors")
    p.add_argument("path", metavar="CKPT")
    p.add_argument("--filter", metavar="GLOB", help="only names matching this glob, e.g. 'model.*'")
    p.add_argument("--chunks", action="store_true", help="each tensor's chunks: box offset and shape, data file")


def run(args: argparse.Namespace) -> int:
    return inspect(Printer(args.json), args.path, args.filter, chunks=args.chunks, key_env=args.key_env)


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _boxes(t: TensorEntry) -> list[dict[str, Any]]:
    return [
        {
            "offset": list(c.offset),
            "shape": list(c.shape),
            "file": c.file,
            "byte_range": list(c.byte_range),
            **({"transforms": [str(x.get("name")) for x in c.transforms]} if c.transforms else {}),
        }
        for c in t.chunks
    ]


def _stored(t: TensorEntry) -> tuple[int, list[str]]:
    """A tensor's stored bytes (after compression, encryption) and the transforms its chunks use."""
    names = dict.fromkeys(str(x.get("name")) for c in t.chunks for x in c.transforms)  # in the order applied
    return sum(c.byte_range[1] - c.byte_range[0] for c in t.chunks), list(names)


def inspect(out: Printer, path: str, pattern: str | None, *, chunks: bool = False, key_env: str | None = None) -> int:
    """The manifest's contents; ``chunks``: each tensor's chunks too (box and data file: who wrote what)."""
    with open_ckpt(path, key_env) as ck:

        def wanted(name: str) -> bool:
            return pattern is None or fnmatch.fnmatchcase(name, pattern)

        infos = [ck.info(n) for n in ck if wanted(n)]
        boxes = {i.name: _boxes(ck.manifest.tensors[i.name]) for i in infos} if chunks else {}
        stored = {i.name: _stored(ck.manifest.tensors[i.name]) for i in infos}
        transforms = list(dict.fromkeys(n for _, names in stored.values() for n in names))  # in the order applied
        values = [(p, v) for p, v in leaves(ck.manifest.tree) if wanted(p)]
        metadata = ck.metadata
        metadata_values = leaves(ck.manifest.metadata)
        shared, manifest_nbytes = shared_size(ck), manifest_size(ck.storage, ck.path)
        positions = _positions(leaves(ck.manifest.tree))
        head = {
            "path": path,
            "format_version": ck.manifest.format_version,
            "writer": ck.manifest.writer,
            "created": ck.created,
            "created_iso": local_time(ck.created),
            "world_size": ck.world_size,
            "encrypted": ck.encrypted,
            "files": len(ck.manifest.files),
            "size_nbytes": ck.nbytes + manifest_nbytes,  # as ls counts a checkpoint's sizes (see _ls._row)
            "written_nbytes": ck.nbytes - shared + manifest_nbytes,
            "nbytes": ck.nbytes,
            "shared_nbytes": shared,
            "manifest_nbytes": manifest_nbytes,
            "tensor_count": len(ck.keys()),
            "transforms": transforms,
            "data_positions": positions,
        }
    tensor_bytes = sum(i.nbytes for i in infos)
    stored_bytes = sum(n for n, _ in stored.values())
    if out.json_mode:
        out.json(
            {
                **head,
                "filter": pattern,
                "metadata": metadata,
                "values": [{"path": p, "value": v} for p, v in values],
                "tensors": [
                    {
                        "name": i.name,
                        "dtype": i.dtype,
                        "shape": list(i.shape),
                        "nbytes": i.nbytes,
                        "kind": i.kind,
                        "chunks": i.chunks,
                        "stored_nbytes": stored[i.name][0],
                        "transforms": stored[i.name][1],
                        **({"boxes": boxes[i.name]} if chunks else {}),
                    }
                    for i in infos
                ],
                "tensor_bytes": tensor_bytes,
                "tensor_stored_bytes": stored_bytes,
            }
        )
        return 0
    out.pairs(
        [
            ("checkpoint", path),
            ("format", f"trainstate {head['format_version']}"),
            ("writer", str(head["writer"])),
            ("created", str(head["created_iso"])),
            ("saved by", f"{ck.world_size} ranks" if ck.world_size > 1 else "1 process"),
            *([("encrypted", "yes: AES-256-GCM, manifest authenticated")] if ck.encrypted else []),
            (
                "size",
                f"{size(ck.nbytes + manifest_nbytes)}: the manifest and {head['files']} data file(s)"
                + _shared_text(head),
            ),
            ("tensors", str(head["tensor_count"])),
            *((f"data position ({p['path']})", str(p["text"])) for p in positions),
            *(
                [
                    (
                        "transforms",
                        f"{', '.join(transforms)}: tensors of {size(tensor_bytes)} stored in {_ratio(tensor_bytes, stored_bytes)}",
                    )
                ]
                if transforms
                else []
            ),
        ]
    )
    if metadata is not None:
        meta = Table(["metadata", "value"])
        for p, v in metadata_values:
            meta.add(p, short(v, 80))
        out.line()
        out.table(meta)
    if values:
        vt = Table(["value", "type", "repr"])
        for p, v in values:
            vt.add(p, type(v).__name__, short(v, 80))
        out.line()
        out.table(vt)
    sharded = any(i.chunks > 1 for i in infos)  # the chunk count only where some tensor has several
    t = Table(
        ["tensor", "dtype", "shape", "bytes", *(["stored"] if transforms else []), *(["chunks"] if sharded else [])],
        right=frozenset({"bytes", "stored", "chunks"}),
    )
    for i in infos:
        extra = [size(stored[i.name][0])] if transforms else []
        t.add(i.name, i.dtype, _shape(i.shape), size(i.nbytes), *extra, *([i.chunks] if sharded else []))
    out.line()
    if infos:
        out.table(t)
    if boxes:
        ct = Table(
            ["tensor", "offset", "shape", "file", "bytes", *(["transforms"] if transforms else [])],
            right=frozenset({"bytes"}),
        )
        for name, found in boxes.items():
            for b in found:
                ct.add(
                    name,
                    _shape(b["offset"]),
                    _shape(b["shape"]),
                    b["file"],
                    size(b["byte_range"][1] - b["byte_range"][0]),
                    *([", ".join(b.get("transforms", []))] if transforms else []),
                )
        out.line()
        out.table(ct)
    shown = f"{len(infos)} of {head['tensor_count']} tensors match {pattern!r}" if pattern else f"{len(infos)} tensors"
    on_disk = f", stored in {_ratio(tensor_bytes, stored_bytes)}" if transforms else ""
    out.line(f"{shown}, {size(tensor_bytes)} ({tensor_bytes} bytes){on_disk}")
    return 0


def _positions(values: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    """Every global sample stream's position in the state (a ResumableSampler with global_batch_size, a
    GlobalBatches): where it holds ``global_batch_size``, ``epoch``, ``batches`` and ``samples`` side by side."""
    plain = dict(values)
    out = []
    for path, value in values:
        if not path.endswith(".global_batch_size") and path != "global_batch_size":
            continue
        at = path[: -len("global_batch_size")]
        epoch, batches, samples = (plain.get(at + k) for k in ("epoch", "batches", "samples"))
        if not all(type(v) is int for v in (value, epoch, batches, samples)):
            continue
        world = plain.get(at + "world_size")
        text = (
            f"epoch {epoch}, {samples} samples consumed ({batches} global batches of {value})"
            + (f", by {world} ranks" if type(world) is int and world > 1 else ", by 1 process" if world == 1 else "")
            + ": restores on any number of ranks"
        )
        out.append(
            {
                "world_size": world if type(world) is int else None,
                "path": at.rstrip(".") or "<root>",
                "epoch": epoch,
                "samples": samples,
                "batches": batches,
                "global_batch_size": value,
                "text": text,
            }
        )
    return out


def _shared_text(head: dict[str, Any]) -> str:
    """For an incremental checkpoint: what its save wrote, and what it shares with earlier ones."""
    shared = int(head["shared_nbytes"])
    if not shared:
        return ""
    return (
        f"; this save wrote {size(int(head['written_nbytes']))} (its new data files and the manifest), the rest is "
        "shared with earlier checkpoints"
    )


def _ratio(raw: int, stored: int) -> str:
    """``stored`` bytes and how many times smaller than ``raw`` that is."""
    if not stored or stored >= raw:  # nothing compressed (encryption alone adds a 16-byte tag per chunk)
        return size(stored)
    return f"{size(stored)} ({raw / stored:.2f}x smaller)"
