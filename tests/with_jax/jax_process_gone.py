"""One process of a two-process JAX job in which process 1 is gone before process 0's save.

    python jax_process_gone.py before|after PROCESS PORT DIR

``before``: process 1 exits right after joining the job, before any trainstate call; ``after``: once it took
part in one save. Process 0 then saves alone; it prints ``RESULT <json>``: the error and how long it took.
Both leave with ``os._exit``: JAX's own exit would wait for the gone process at its shutdown barrier.
"""

from __future__ import annotations

import json
import os
import sys
import time

if __name__ == "__main__":
    os.environ.pop("TRAINSTATE_DIST_TIMEOUT", None)  # the default timeout: the liveness check must beat it
    os.environ["TRAINSTATE_DIST_ARRIVAL_TIMEOUT"] = "5"  # 60 s by default

import jax  # noqa: E402
import numpy as np  # noqa: E402

import trainstate  # noqa: E402


def main() -> None:
    how, process, port, directory = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process)
    if how == "after":
        trainstate.save(f"{directory}/together", {"a": np.zeros(3)})
    if process == 1:
        print("RESULT " + json.dumps({"gone": True}), flush=True)
        os._exit(0)
    start = time.monotonic()
    try:
        trainstate.save(f"{directory}/alone", {"a": np.zeros(3)})
        result = {"error": None}
    except trainstate.CheckpointError as e:
        result = {"error": type(e).__name__, "message": str(e)}
    result["seconds"] = time.monotonic() - start
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
