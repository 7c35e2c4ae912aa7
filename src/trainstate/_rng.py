"""RNGState: every random number generator a training step draws from, as one stateful.

Captures Python's ``random``, NumPy's global generator and any NumPy ``Generator`` handed to it, torch's
CPU generator and any ``torch.Generator`` handed to it, and every CUDA device's generator when CUDA is
initialized. Restoring it makes the next draws identical to the ones after the save.
"""

from __future__ import annotations

import hashlib
import random
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from trainstate.errors import StateMismatchError


class RNGState:
    """A stateful over the process's random generators.

    Args:
        numpy_generators: named ``numpy.random.Generator`` objects to capture as well.
        torch_generators: named ``torch.Generator`` objects to capture as well.

    Example:
        >>> state = {"model": model, "rng": trainstate.RNGState()}
        >>> trainstate.save("ckpt", state)   # ... later, in a new process:
        >>> trainstate.load("ckpt", state)   # the next random draws match the uninterrupted run

    Under torch.distributed each rank saves and restores its own generators (a per-rank value). Restored
    on another number of ranks, where no saved rank is this one, the generators are re-derived instead
    (:meth:`rederive`): seeded from (``seed``, the checkpoint's step, the new rank), the same in every run
    that resumes that checkpoint on that many ranks.

    Args (besides the generators):
        seed: the run's seed, for :meth:`rederive` (default 0).
    """

    __trainstate_per_rank__ = True

    def __init__(
        self,
        numpy_generators: Mapping[str, np.random.Generator] | None = None,
        torch_generators: Mapping[str, Any] | None = None,
        seed: int = 0,
    ) -> None:
        self.seed = int(seed)
        self.numpy_generators = dict(numpy_generators or {})
        self.torch_generators = dict(torch_generators or {})
        self.restored_torch_state: tuple[Any, list[Any]] | None = None

    def state_dict(self) -> dict[str, Any]:
        """The generators' states now: Python's ``random``, NumPy's global one, torch's CPU (and CUDA) one,
        and the named generators, as plain values and arrays (what ``save`` stores).

        Example:
            >>> sorted(trainstate.RNGState().state_dict())
            ['numpy', 'numpy_generators', 'python', 'torch', 'torch_generators']
        """
        version, internal, gauss = random.getstate()
        np_state = np.random.get_state(legacy=False)
        state: dict[str, Any] = {
            "python": {"version": version, "state": np.asarray(internal, dtype=np.uint64), "gauss": gauss},
            "numpy": _numpy_state(np_state),
            "numpy_generators": {k: g.bit_generator.state for k, g in self.numpy_generators.items()},
        }
        torch = _torch()
        if torch is not None:
            state["torch"] = torch.get_rng_state()
            state["torch_generators"] = {k: g.get_state() for k, g in self.torch_generators.items()}
            if torch.cuda.is_available() and torch.cuda.is_initialized():  # pragma: no cover - needs a GPU
                state["cuda"] = list(torch.cuda.get_rng_state_all())
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Set the generators to ``state`` (from :meth:`state_dict`): the next draws repeat those after it.

        Raises:
            StateMismatchError: a named generator of this RNGState is not in ``state``.

        Example:
            >>> rng = trainstate.RNGState()
            >>> saved = rng.state_dict()
            >>> a = random.random()
            >>> rng.load_state_dict(saved)
            >>> random.random() == a
            True
        """
        py = state["python"]
        random.setstate((py["version"], tuple(int(x) for x in py["state"]), py["gauss"]))
        np.random.set_state(_numpy_tuple(state["numpy"]))
        missing = [k for k in self.numpy_generators if k not in state.get("numpy_generators", {})]
        missing += [k for k in self.torch_generators if k not in state.get("torch_generators", {})]
        if missing:
            raise StateMismatchError(missing, [], [], hint="these generators were not in the checkpoint")
        for k, g in self.numpy_generators.items():
            g.bit_generator.state = state["numpy_generators"][k]
        torch = _torch()
        if torch is not None and "torch" in state:
            for k, g in self.torch_generators.items():
                g.set_state(_as_byte_tensor(torch, state["torch_generators"][k]))
            cuda = [_as_byte_tensor(torch, s) for s in state.get("cuda", [])]
            self.restored_torch_state = (_as_byte_tensor(torch, state["torch"]).clone(), cuda)
            self.reapply_torch()

    def rederive(self, rank: int, step: int) -> None:
        """Seed every generator from (:attr:`seed`, ``step``, ``rank``): what a restore does on another number
        of ranks than saved the checkpoint (no saved rank's generators are this rank's own).

        The rule (docs/distributed.md, "Changing the world size"): ``k = SHA-256("trainstate rng v1", seed,
        step, rank)``'s first 8 bytes as an integer; Python's ``random`` is seeded with ``k``, NumPy's global
        generator with ``k >> 32``, torch's CPU (and every CUDA) generator with ``k & 0xFFFFFFFF``, and each
        named generator with ``SHA-256(k, its name)`` likewise.

        Example:
            >>> rng = trainstate.RNGState(seed=1234)
            >>> rng.rederive(rank=2, step=800)    # what a restore on 3 ranks of a 4-rank checkpoint does
        """
        k = _derived(self.seed, step, rank)
        random.seed(k)
        np.random.seed(k >> 32)
        for name, g in self.numpy_generators.items():
            g.bit_generator.state = type(g.bit_generator)(_derived(k, 0, 0, name)).state
        torch = _torch()
        if torch is not None:
            torch.manual_seed(k & 0xFFFFFFFF)  # CUDA's generators too, where CUDA is up
            for name, g in self.torch_generators.items():
                g.manual_seed(_derived(k, 0, 0, name) & 0xFFFFFFFF)
            cuda = (
                list(torch.cuda.get_rng_state_all())
                if torch.cuda.is_available() and torch.cuda.is_initialized()
                else []
            )
            self.restored_torch_state = (torch.get_rng_state().clone(), cuda)

    def reapply_torch(self) -> None:
        """Set torch's global generators (CPU, and CUDA where present) to the last restored state again.

        trainstate calls this right after a restored data loader starts its first iterator, whose
        base-seed draw would otherwise shift every random draw after a resume (see data.py).

        Example:
            >>> trainstate.load("ckpt", state)      # state["rng"] is an RNGState
            >>> it = iter(plain_loader)             # a loader trainstate does not hook draws a base seed
            >>> state["rng"].reapply_torch()        # torch's generator as restored, again
        """
        torch = _torch()
        if torch is None or self.restored_torch_state is None:
            return
        cpu, cuda = self.restored_torch_state
        torch.set_rng_state(cpu)
        if cuda and torch.cuda.is_available():  # pragma: no cover - needs a GPU
            torch.cuda.set_rng_state_all(cuda)


def _derived(seed: int, step: int, rank: int, name: str = "") -> int:
    """64 bits from (seed, step, rank, name): the first 8 bytes of their SHA-256, little-endian."""
    text = f"trainstate rng v1\0{seed}\0{step}\0{rank}\0{name}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little")


def _torch() -> Any:
    return sys.modules.get("torch")  # a process that never imported torch has no torch RNG to keep


def _as_byte_tensor(torch: Any, value: Any) -> Any:
    return value if isinstance(value, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(value))


def _numpy_state(s: Any) -> dict[str, Any]:
    if isinstance(s, dict):  # legacy=False gives the bit generator's dict
        return s
    return {"bit_generator": s[0], "state": {"key": s[1], "pos": s[2]}, "has_gauss": s[3], "gauss": s[4]}


def _numpy_tuple(d: Mapping[str, Any]) -> tuple[Any, ...]:
    return (
        "MT19937",
        np.asarray(d["state"]["key"], dtype=np.uint32),
        int(d["state"]["pos"]),
        int(d.get("has_gauss", 0)),
        float(d.get("gauss", 0.0)),
    )
