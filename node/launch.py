"""`gonka-node start --nproc-per-node N`: one host, N ranks under torch.distributed.run.

This process becomes the host's elastic agent (``torch.distributed.launcher``, what
``torchrun --standalone`` runs): it rendezvouses the ranks on loopback, starts them, watches
them, and stops them all when one dies. Every rank runs ``gonka-node start`` again with the
same arguments; rank 0 is the node (node/daemon.py), the others follow it (node/follower.py)
over a socket in a private directory made here. Each rank asks the kernel to kill it when the
agent dies, so nothing outlives the host, also after SIGKILL.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import uuid

from node.config import Config, setting_errors
from node.errors import EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, ConfigError
from node.ranks import SOCKET_ENV

log = logging.getLogger("gonka.node")


def check_host(config: Config) -> None:
    """Bad host settings, found before any rank starts: ConfigError naming the key (exit code 2)."""
    import torch

    n = config.host.nproc_per_node
    device = config.node.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if ":" in device:
            raise ConfigError(f"node.device: {device} names one GPU; with host.nproc_per_node = {n} every rank "
                              f"takes its own (use cuda or auto)", "node.device")
        gpus = torch.cuda.device_count()
        if n > gpus:
            raise ConfigError(f"host.nproc_per_node: {n} ranks, but this host has {gpus} CUDA device"
                              f"{'' if gpus == 1 else 's'} (one rank per GPU)", "host.nproc_per_node")
    elif n > (os.cpu_count() or 1):
        raise ConfigError(f"host.nproc_per_node: {n} CPU ranks, but this host has {os.cpu_count()} cores",
                          "host.nproc_per_node")
    if config.node.checkpoint_dir:  # a part missing, or another layout's checkpoint: before any rank loads one
        from trainer.checkpoint import host_checkpoint

        with setting_errors():  # "node.checkpoint_dir: ..."
            host_checkpoint(config.node.checkpoint_dir, n)


def launch_host(config: Config, argv: list[str]) -> int:
    """Run the host's ranks until they stop; the node's exit code (2 for bad input)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from p2p.p2pd import dying_with_us

    n = config.host.nproc_per_node
    # The agent's own log lines would repeat each rank's error and a page of context.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    private = tempfile.mkdtemp(prefix="gonka-host-")  # 0700: only this user reaches the ranks' socket
    os.environ[SOCKET_ENV] = os.path.join(private, "ranks.sock")
    # Cores shared among CPU ranks; a GPU rank needs a few for its input and the swarm.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    launch = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=f"gonka-{uuid.uuid4().hex[:12]}",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.2)
    rank_cmd = dying_with_us(sys.executable, "-m", "node.cli", *argv)
    try:
        elastic_launch(launch, entrypoint=rank_cmd[0])(*rank_cmd[1:])
        return EXIT_OK
    except ChildFailedError as e:
        codes = {rank: f.exitcode for rank, f in e.failures.items()}
        if codes.get(0) == EXIT_USAGE:
            return EXIT_USAGE  # rank 0 said why, in one line
        # Name the rank that failed first: one killed by a signal (the launcher stops the others
        # with SIGTERM), else rank 0 (the others exit when it is gone; it exits when one of them
        # is, saying which), else the lowest.
        killed = [r for r, c in sorted(codes.items()) if c < 0 and c != -signal.SIGTERM]
        failed = killed or ([0] if codes.get(0) else []) or sorted(codes)
        code = codes[failed[0]]
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        print(f"gonka-node: error: rank {failed[0]} of this host {how}; the host's ranks were stopped",
              file=sys.stderr, flush=True)
        return EXIT_RUNTIME
    except SignalException:
        return EXIT_OK  # stopped by SIGTERM/SIGINT: rank 0 took its final checkpoint
    finally:
        shutil.rmtree(private, ignore_errors=True)
