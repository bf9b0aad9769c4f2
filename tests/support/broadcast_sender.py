"""The trainer's end of a broadcast weight sync, in a process of its own (a group has one rank per process).

    python -m tests.support.broadcast_sender URL [URL ...] --port P --versions 2

Pushes `tests.support.sglang_weights.tensors(seed=version)` for each version, in buckets, over
gloo, inside each server's weight-update session (which serves `version` once it closed), and
prints one JSON line per version: the transfer report. Closes the broadcaster at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from contextlib import ExitStack

from orchestrator.adapters.engines.sglang import SGLangEngine, WeightBroadcaster
from orchestrator.adapters.transport.bucketed import push_in_buckets
from tests.support.sglang_weights import tensors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("urls", nargs="+")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--versions", type=int, default=2)
    parser.add_argument("--first", type=int, default=1, help="the first version pushed")
    parser.add_argument("--group", default="colocate_weights")
    parser.add_argument("--timeout", type=float, default=30.0, help="the group's timeout, seconds")
    parser.add_argument("--hold", action="store_true", help="after the last version, wait to be killed; never close")
    args = parser.parse_args(argv)
    engines = [SGLangEngine(url) for url in args.urls]
    broadcaster = WeightBroadcaster(
        engines, master_port=args.port, backend="gloo", group_name=args.group, timeout_s=args.timeout
    )
    for version in range(args.first, args.first + args.versions):
        with ExitStack() as sessions:  # every server's weight-update session around the version's buckets
            for engine in engines:
                sessions.enter_context(engine.weight_update_session(version))
            report = push_in_buckets(tensors(seed=version), broadcaster, version, bucket_bytes=600)
        print(json.dumps({"version": version, "buckets": report.buckets, "bytes": report.bytes}), flush=True)
    if args.hold:  # a trainer killed between updates: its group stays on the servers
        threading.Event().wait()
    broadcaster.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
