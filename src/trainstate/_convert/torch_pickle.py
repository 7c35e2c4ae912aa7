"""The pickle of a torch.save file, read by trainstate's own restricted unpickler, never by torch's.

torch.save pickles the object and has each tensor's storage named by a persistent id; torch.load unpickles it
with its weights-only unpickler, which builds dicts as it goes (hashing keys a file chooses), calls torch's
rebuild functions on whatever arguments the file gives, and trusts each storage's declared size. Here the
pickle is run by :class:`trainstate._convert.unpickle.Restricted`, which bounds what building costs, allowed
what torch.save writes of a state:

- containers and plain values: dicts, ``OrderedDict``s (their ``_metadata`` attribute too), lists, tuples,
  sets, numbers, strings, bytes, ``torch.Size``, ``torch.device``, dtypes;
- dense tensors (``_rebuild_tensor``, ``_v2``, ``_v3``; parameters, and tensors with attributes, as their
  data), each checked to lie inside its storage before it is made, as a view of that storage.

A quantized, sparse or nested tensor, a tensor subclass, and any other class or function are refused by name;
nothing the file names is ever called with the file's arguments except the constructors above. The storages
come from the caller (``storage(key, dtype, numel, location)``): mapped from the file, already checked.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from typing import Any, NamedTuple

from trainstate._convert import unpickle
from trainstate._format import dtypes, manifest
from trainstate.errors import UnsupportedValueError


class Storage(NamedTuple):
    """A storage the pickle names: a CPU ``torch.UntypedStorage`` of its bytes, and its element dtype."""

    data: Any
    dtype: Any


class _StorageType(NamedTuple):
    """A legacy typed storage class (``torch.FloatStorage``): only a persistent id names it."""

    dtype: Any


_REFUSED_REBUILDS = {
    "_rebuild_qtensor": "a quantized tensor",
    "_rebuild_sparse_tensor": "a sparse tensor",
    "_rebuild_nested_tensor": "a nested tensor",
    "_rebuild_wrapper_subclass": "a tensor subclass",
    "_rebuild_meta_tensor_no_storage": "a tensor without storage (on the meta device)",
    "_rebuild_device_tensor_from_numpy": "a tensor pickled through numpy",
    "_rebuild_device_tensor_from_cpu_tensor": "a tensor pickled through the CPU",
    "_rebuild_xla_tensor": "an XLA tensor",
    "_rebuild_mtia_tensor": "an MTIA tensor",
}


class _Rebuild(NamedTuple):
    """A rebuild function of ``torch._utils`` the pickle names, by name: trainstate builds the tensor itself."""

    name: str


class Unpickler(unpickle.Restricted):
    """The restricted unpickler allowed what torch.save writes (the module docstring); ``storage`` turns a
    persistent id's key, dtype, element count and location into a :class:`Storage`."""

    dispatch: dict[int, Any] = dict(unpickle.Restricted.dispatch)
    dicts = (dict, collections.OrderedDict, collections.Counter)

    def __init__(
        self, file: Any, size: int, storage: Callable[[str, Any, int, str], Storage], *, legacy: bool = False
    ) -> None:
        super().__init__(file, size)
        self.legacy = legacy  # the legacy format's storage ids have a sixth element: a view, or None
        import torch

        self.torch: Any = torch
        self._storage = storage
        self._storages: dict[str, Storage] = {}  # key -> its storage (torch makes one per key, the first)
        self._globals: dict[tuple[str, str], Any] = {
            ("collections", "OrderedDict"): collections.OrderedDict,
            ("collections", "Counter"): collections.Counter,
            ("builtins", "set"): set,
            ("builtins", "complex"): complex,
            ("builtins", "bytearray"): bytearray,
            ("_codecs", "encode"): _encode,
            ("torch", "Size"): torch.Size,
            ("torch", "device"): torch.device,
            ("torch", "Tensor"): torch.Tensor,
            ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
            ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
            ("torch", "UntypedStorage"): _StorageType(torch.uint8),
            ("torch.storage", "UntypedStorage"): _StorageType(torch.uint8),
            ("torch._tensor", "_rebuild_from_type_v2"): _Rebuild("_rebuild_from_type_v2"),
        }
        for dtype, name in torch.storage._dtype_to_storage_type_map().items():
            self._globals["torch", name] = _StorageType(dtype)

    def find_class(self, module: str, name: str) -> Any:
        module = "builtins" if module == "__builtin__" else module  # protocol 2 of Python 2's pickles
        found = self._globals.get((module, name))
        if found is not None:
            return found
        if module == "torch._utils" and name.startswith("_rebuild_"):
            return _Rebuild(name)
        if module == "torch" and isinstance(getattr(self.torch, name, None), (self.torch.dtype, self.torch.qscheme)):
            return getattr(self.torch, name)  # a dtype (torch.float32) or a quantization scheme, as a value
        what = " (a NumPy array or scalar)" if module.split(".")[0] == "numpy" else ""
        raise UnsupportedValueError(
            f"it holds a pickled object other than tensors, containers and plain values (a {module}.{name}"
            f"{what}); trainstate never unpickles code. Turn NumPy arrays into tensors (torch.from_numpy) and "
            "objects into plain values before torch.save, or import a file of the weights alone "
            "(torch.save(model.state_dict(), ...), or safetensors)"
        )

    def persistent_load(self, pid: Any) -> Any:
        if type(pid) is not tuple or len(pid) != (6 if self.legacy else 5) or pid[0] != "storage":
            raise unpickle.Refused(f"it names a storage as {pid!r:.80}")
        _, kind, key, location, numel = pid[:5]
        if type(kind) is not _StorageType or type(key) is not str or type(numel) is not int or numel < 0:
            raise unpickle.Refused(f"it names a storage as {pid!r:.80}")
        if type(location) is not str:
            raise unpickle.Refused(f"storage {key!r:.40} is on a device named by a {unpickle.type_name(location)}")
        held = self._storages.get(key)
        if held is None:
            held = self._storages[key] = self._storage(key, kind.dtype, numel, location)
        elif held.data.nbytes() == 0:  # an empty storage takes the dtype it is named with (as torch's does)
            held = Storage(held.data, kind.dtype)
        view = pid[5] if self.legacy else None
        if view is None:
            return held
        # the legacy format's view (its own key, offset and size in elements of this id's dtype), kept in the
        # same table as storages, by its key, as torch's legacy loader keeps it: the first one made is reused
        if type(view) is not tuple or len(view) != 3 or type(view[0]) is not str:
            raise unpickle.Refused(f"it names a view of storage {key!r:.40} as {view!r:.80}")
        view_key, offset, size = view
        if not all(type(v) is int and v >= 0 for v in (offset, size)):
            raise unpickle.Refused(f"it names a view of storage {key!r:.40} as {view!r:.80}")
        made = self._storages.get(view_key)
        if made is None:
            itemsize = self.torch._utils._element_size(kind.dtype)
            if (offset + size) * itemsize > held.data.nbytes():
                raise unpickle.Refused(f"a view of storage {key!r:.40} reaches past its end")
            data = held.data[offset * itemsize : (offset + size) * itemsize]
            made = self._storages[view_key] = Storage(data, kind.dtype)
        return made

    def call(self, func: Any, args: tuple[Any, ...]) -> Any:
        torch = self.torch
        if type(func) is _Rebuild:
            return self._rebuild(func.name, args)
        if func is torch.Size:
            items = args[0] if len(args) == 1 and type(args[0]) in (tuple, list) else None
            if items is None or not all(type(n) is int for n in items):
                raise unpickle.Refused(f"it makes a torch.Size of {args!r:.80}")
            self.charge(len(items))
            return self.tuple_of(list(items), torch.Size)
        if func in (collections.OrderedDict, collections.Counter):
            if args != ():  # torch.save fills them item by item, each key checked as it goes in
                raise unpickle.Refused(f"it builds a {func.__name__} from arguments, not item by item")
            return func()
        if func is set:
            items = args[0] if len(args) == 1 and type(args[0]) is list else [] if args == () else None
            if items is None:
                raise unpickle.Refused("it builds a set from something other than a list")
            made: set[Any] = set()
            self.keys(made, items)
            self.charge(len(items))
            made.update(items)
            return made
        if func is complex:
            if not 1 <= len(args) <= 2 or not all(type(a) in (int, float) for a in args):
                raise unpickle.Refused(f"it makes a complex number of {args!r:.80}")
            return complex(*args)
        if func is bytearray:
            if len(args) > 1 or (args and type(args[0]) is not bytes):  # bytearray(N): N bytes of nothing
                raise unpickle.Refused("it makes a bytearray of a given length (memory out of proportion to the file)")
            self.charge(len(args[0]) if args else 0)
            return bytearray(*args)
        if func is _encode:
            if len(args) != 2 or type(args[0]) is not str or args[1] != "latin1":
                raise unpickle.Refused(f"it encodes {args!r:.80}")
            self.charge(len(args[0]))
            return _encode(*args)
        if func is torch.device or func is torch.serialization._get_layout:
            if not 1 <= len(args) <= 2 or type(args[0]) is not str or len(args[0]) > 64:
                raise unpickle.Refused(f"it calls {func.__name__} with {args!r:.80}")
            try:
                return func(*args)
            except (RuntimeError, TypeError, ValueError, KeyError) as e:
                raise unpickle.Refused(f"{func.__name__}{args!r:.80}: {e!s:.80}") from None
        raise unpickle.Refused(f"it calls {unpickle.type_name(func)} (a class torch.save pickles only as a value)")

    def build(self, inst: Any, state: Any) -> None:
        # An OrderedDict's attributes (a state_dict's _metadata); nothing else is ever given a state.
        if type(inst) is not collections.OrderedDict or type(state) is not dict:
            raise unpickle.Refused(f"it sets attributes of {unpickle.type_name(inst)}")
        if any(k != "_metadata" for k in state):  # anything else could stand in for a method (.values)
            raise unpickle.Refused("it gives an OrderedDict attributes other than a state_dict's _metadata")
        inst.__dict__.update(state)

    def check_key(self, key: Any) -> None:
        if not _plain(key):
            raise UnsupportedValueError(
                f"its pickle fills a dict with a key that is not a string, a number or a tuple of them "
                f"({unpickle.type_name(key)}); trainstate stores no such key"
            )

    # -- tensors --------------------------------------------------------------------------------------------

    def _rebuild(self, name: str, args: tuple[Any, ...]) -> Any:
        torch = self.torch
        if name in ("_rebuild_tensor", "_rebuild_tensor_v2") and len(args) in (4, 6, 7):
            storage = args[0]
            dtype = storage.dtype if type(storage) is Storage else None
            return self._tensor(name, storage, dtype, args[1], args[2], args[3], args[6] if len(args) == 7 else None)
        if name == "_rebuild_tensor_v3" and len(args) in (7, 8):
            return self._tensor(name, args[0], args[6], args[1], args[2], args[3], args[7] if len(args) == 8 else None)
        if name in ("_rebuild_parameter", "_rebuild_parameter_with_state") and len(args) in (3, 4):
            if not isinstance(args[0], torch.Tensor):
                raise unpickle.Refused(f"it makes a parameter of a {unpickle.type_name(args[0])}")
            return args[0]  # the import keeps the data; whether it was a Parameter does not matter
        if name == "_rebuild_from_type_v2" and len(args) == 4:
            func, kind, inner, _ = args  # the state: a tensor's Python attributes, which the import drops
            if type(func) is not _Rebuild or kind not in (torch.Tensor, torch.nn.Parameter) or type(inner) is not tuple:
                raise unpickle.Refused(f"it rebuilds a {unpickle.type_name(kind)}, a tensor subclass")
            return self._rebuild(func.name, inner)
        what = _REFUSED_REBUILDS.get(name)
        if what is not None:
            raise UnsupportedValueError(f"it holds {what}, which trainstate does not store")
        raise unpickle.Refused(f"it calls torch._utils.{name:.60} with {len(args)} arguments")

    def _tensor(self, how: str, storage: Any, dtype: Any, offset: Any, size: Any, stride: Any, meta: Any) -> Any:
        """A view of ``storage`` (checked to lie inside it), as torch's rebuild functions make."""
        torch = self.torch
        if type(storage) is not Storage or not isinstance(dtype, torch.dtype):
            raise unpickle.Refused(f"{how} is given a {unpickle.type_name(storage)} for its storage")
        if (
            type(offset) is not int
            or not isinstance(size, tuple)
            or not isinstance(stride, tuple)
            or len(size) != len(stride)
            or not all(type(n) is int and n >= 0 for n in (offset, *size, *stride))
        ):
            raise unpickle.Refused(
                f"a tensor is given offset {offset!r:.40}, sizes {size!r:.80} and strides {stride!r:.80}"
            )
        if len(size) > manifest.MAX_RANK:  # before the sizes are multiplied: no reader would load it
            raise UnsupportedValueError(
                f"it holds a tensor of {len(size)} dimensions (a manifest holds at most {manifest.MAX_RANK})"
            )
        itemsize = torch._utils._element_size(dtype)
        numel = math.prod(size)
        end = (offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1) if numel else offset
        if end * itemsize > storage.data.nbytes():
            raise unpickle.Refused(
                f"a tensor of sizes {list(size)!r:.80}, strides {list(stride)!r:.80} and offset {offset} reaches "
                f"past its storage ({storage.data.nbytes()} bytes)"
            )
        if str(dtype).removeprefix("torch.") not in dtypes.BY_TORCH_NAME:
            raise UnsupportedValueError(f"it holds a tensor of {dtype}, a dtype trainstate does not store")
        tensor = torch.empty(0, dtype=dtype).set_(storage.data, offset, size, stride)
        if meta is not None and meta != {}:
            if type(meta) is not dict or not all(k in ("conj", "neg") and type(v) is bool for k, v in meta.items()):
                raise unpickle.Refused(f"a tensor is given metadata {meta!r:.80}")
            try:  # a bit its dtype has no meaning for (neg on bool, conj on a real dtype) fails here, not later
                probe = torch.zeros(1, dtype=dtype)
                torch._utils.set_tensor_metadata(probe, meta)
                probe.resolve_neg().resolve_conj()
            except (RuntimeError, NotImplementedError, TypeError) as e:
                raise unpickle.Refused(f"a {dtype} tensor is given metadata {meta!r:.40} ({e!s:.60})") from None
            torch._utils.set_tensor_metadata(tensor, meta)
        return tensor


def _encode(text: str, encoding: str) -> bytes:
    """``_codecs.encode``, as protocol 2 pickles bytes: a latin-1 string back to its bytes."""
    return text.encode(encoding)


def _plain(key: Any) -> bool:
    """Whether a dict or set key is a string, bytes, a number, None or a tuple of them: keys a state holds."""
    if type(key) in (str, bytes, int, float, bool, complex) or key is None:
        return True
    return type(key) is tuple and all(_plain(item) for item in key)
