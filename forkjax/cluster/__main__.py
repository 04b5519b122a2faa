"""`python -m forkjax.cluster --replicas N --port P [any flag of python -m forkjax.serve]`.

Starts N workers with the given flags on free loopback ports and the gateway (SMG) on --host:P,
prints `worker URL` for each worker as it is ready and then `gateway URL` once the gateway routes
to all of them; runs until SIGTERM or Ctrl-C, which stop every process. A worker that dies is
left out by the gateway's health checks; the same worker command on its old port brings it back.

    python -m forkjax.serve [the flags] --host 127.0.0.1 --port PORT
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

from forkjax.cluster.launcher import LOOPBACK, Cluster

POLICIES = ("consistent_hashing", "cache_aware", "round_robin", "random", "power_of_two")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m forkjax.cluster", description=__doc__.split("\n\n")[1],
                                epilog="Every other flag goes to each `python -m forkjax.serve` worker; a dead "
                                       "worker comes back as `python -m forkjax.serve [those flags] --host "
                                       "127.0.0.1 --port PORT` (the port of its `worker` line).")
    p.add_argument("--replicas", type=int, default=2, help="workers (2)")
    p.add_argument("--port", type=int, default=8000, help="the gateway's port (8000)")
    p.add_argument("--host", default=LOOPBACK, help="the gateway's address (127.0.0.1); workers stay on loopback")
    p.add_argument("--policy", default="consistent_hashing", choices=POLICIES,
                   help="SMG's routing policy (consistent_hashing: by the X-SMG-Routing-Key header)")
    return p


def main(argv: list[str] | None = None):
    parser = build_parser()
    args, serve_args = parser.parse_known_args(argv)
    if args.replicas < 1:
        parser.error(f"--replicas={args.replicas}: expected >= 1")
    if not 0 < args.port < 65536:
        parser.error(f"--port={args.port}: expected a port in 1..65535 (the gateway's)")

    def stop(sig, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, stop)
    cluster = Cluster(args.replicas, args.port, serve_args, host=args.host, policy=args.policy)
    try:
        cluster.start(on_worker=lambda url: print(f"worker {url}", flush=True))
        print(f"gateway {cluster.gateway_url}", flush=True)
        while cluster.gateway.poll() is None:
            time.sleep(0.5)
        sys.exit(f"forkjax.cluster: the gateway exited with status {cluster.gateway.returncode}")
    except KeyboardInterrupt:
        pass
    except RuntimeError as e:
        sys.exit(f"forkjax.cluster: {e}")
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
