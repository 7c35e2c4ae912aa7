"""The checkpoint in tests/fixtures/v1.0/positional-optimizer: an optimizer keyed by position.

trainstate before optimizer state was keyed by parameter name (commit 822966c and earlier) saved a torch
optimizer as its own ``state_dict()``: state and param groups keyed by each parameter's position. Such
checkpoints must keep loading. The fixture was written by that trainstate with this script::

    git archive 822966c src | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old/src python tests/distributed/make_positional_optimizer.py
"""

from __future__ import annotations

from pathlib import Path

FIXTURE = Path(__file__).parent.parent / "fixtures" / "v1.0" / "positional-optimizer"


def main() -> None:
    import torch

    import trainstate

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 5))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(8, 16)).sum().backward()
        optim.step()
        optim.zero_grad()
    trainstate.save(FIXTURE, {"model": model, "optim": optim, "step": 2}, overwrite=True)


if __name__ == "__main__":
    main()
