"""Exact resume for JAX as a small training program: Flax NNX + Optax, dropout, a shuffled data order.

Everything that decides the next step is in the saved state: the parameters, the optimizer's moments and
step count, the dropout stream (an ``nnx.Rngs`` stream inside the model: its key and how many keys it has
drawn) and the data order (the key of this epoch's permutation, the epoch, the position in it). Run as a
script it trains with a CheckpointManager and resumes from the newest checkpoint it finds:

    python tests/with_jax/resume_recipe_jax.py DIR [--steps N] [--every K] [--async] [--pause-at P]

and writes the whole final state to DIR/final. ``--pause-at P`` prints ``paused P`` after step P and waits
on stdin, so a test can SIGKILL it at a known point between two checkpoints. docs/jax.md shows this loop.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

import trainstate

SAMPLES, BATCH = 96, 8  # 12 steps an epoch


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(8, 32, rngs=rngs)
        self.dropout = nnx.Dropout(0.3, rngs=rngs)  # keeps its own stream, forked from rngs' "dropout"
        self.out = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.dropout(nnx.relu(self.hidden(x))))


def dataset() -> tuple[np.ndarray, np.ndarray]:
    data = np.random.default_rng(42)
    return data.standard_normal((SAMPLES, 8)).astype(np.float32), data.integers(0, 4, SAMPLES)


@nnx.jit
def create(params: jax.Array, dropout: jax.Array) -> tuple[MLP, nnx.Optimizer[MLP]]:
    """The model and its optimizer, initialized in one compiled computation (not one per initializer)."""
    model = MLP(nnx.Rngs(params=params, dropout=dropout))
    return model, nnx.Optimizer(model, optax.adamw(3e-3, weight_decay=0.01), wrt=nnx.Param)


def build(seed: int = 0) -> dict[str, Any]:
    """A fresh training state; a resumed run builds it the same way, then restores into it."""
    model, optimizer = create(jax.random.key(seed), jax.random.key(seed + 1))
    order = {"key": jax.random.key(seed + 2), "epoch": 0, "position": 0}  # position: batches done this epoch
    return {"model": model, "optimizer": optimizer, "order": order}


@nnx.jit
def train_step(model: MLP, optimizer: nnx.Optimizer[MLP], x: jax.Array, y: jax.Array) -> jax.Array:
    def loss_fn(model: MLP) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)  # updates the model's parameters and the optimizer's state in place
    return loss


def train(state: dict[str, Any], start: int, stop: int, on_step: Any = None) -> None:
    """Optimizer steps ``start``..``stop-1``, the batches taken where ``state["order"]`` says; ``on_step(step)``
    runs after each one (saves go there)."""
    x, y = dataset()
    model, optimizer, order = state["model"], state["optimizer"], state["order"]
    per_epoch = SAMPLES // BATCH
    permutation = np.asarray(jax.random.permutation(order["key"], SAMPLES))
    for step in range(start, stop):
        batch = permutation[order["position"] * BATCH : (order["position"] + 1) * BATCH]
        train_step(model, optimizer, x[batch], y[batch])
        order["position"] += 1
        if order["position"] == per_epoch:  # the next epoch: a new key, a new permutation
            order["key"] = jax.random.split(order["key"])[0]
            order["epoch"] += 1
            order["position"] = 0
            permutation = np.asarray(jax.random.permutation(order["key"], SAMPLES))
        if on_step is not None:
            on_step(step)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--async", dest="async_save", action="store_true")
    ap.add_argument("--pause-at", type=int, default=-1)
    args = ap.parse_args()
    state = build()
    manager = trainstate.CheckpointManager(
        os.path.join(args.dir, "ckpt"), every_steps=args.every, keep_last=2, async_save=args.async_save
    )
    start = manager.restore_latest(state) or 0
    print(f"start {start}", flush=True)

    def on_step(step: int) -> None:
        manager.save(step, state)
        if step == args.pause_at:
            print(f"paused {step}", flush=True)
            sys.stdin.readline()  # the test kills us here

    train(state, start, args.steps, on_step)
    manager.close()
    trainstate.save(os.path.join(args.dir, "final"), state, overwrite=True)


if __name__ == "__main__":
    main()
