"""One process of a multi-process test run (started by ``mp_harness``).

    python mp_worker.py OUT SCENARIOS [--plain] [--process-id I --processes N --port P]
                        [--fail-process I] [--sleep SECONDS]

``SCENARIOS`` is a comma-separated list of ``mp_programs.SCENARIOS`` (``""``:
none, the processes only join). With
``--processes N`` (N > 1) the process joins a ``jax.distributed`` cluster
on 127.0.0.1:P as process I; its devices (the environment sets how many)
and the other processes' make the global mesh.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("scenarios")
    parser.add_argument("--plain", action="store_true", help="also run the plain-JAX references")
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--port", type=int, default=0)
    # For the harness's own tests: this process fails at once / every
    # process sleeps this long, before JAX starts.
    parser.add_argument("--fail-process", type=int, default=None)
    parser.add_argument("--sleep", type=float, default=0.0)
    args = parser.parse_args()
    if args.process_id == args.fail_process:
        print(f"process {args.process_id} fails on purpose", flush=True)
        sys.exit(3)
    time.sleep(args.sleep)

    import jax

    # Keys bit for bit whatever the sharding: the random bits of an array do
    # not depend on how it is split over devices.
    jax.config.update("jax_threefry_partitionable", True)
    if args.processes > 1:
        try:  # CPU collectives across processes (the default in newer JAX)
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except (AttributeError, ValueError):  # pragma: no cover - no such option
            pass
        kwargs = {}
        if "cluster_detection_method" in inspect.signature(jax.distributed.initialize).parameters:
            kwargs["cluster_detection_method"] = "deactivate"  # no SLURM / MPI / cloud probing
        jax.distributed.initialize(f"127.0.0.1:{args.port}", num_processes=args.processes,
                                   process_id=args.process_id, **kwargs)

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import mp_programs

    mp_programs.run_scenarios(args.out, [s for s in args.scenarios.split(",") if s], args.plain)
    if args.processes > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("end")  # nobody leaves while others still need it
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
