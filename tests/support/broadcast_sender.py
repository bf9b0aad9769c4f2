"""The trainer's end of a broadcast weight sync, in a process of its own (a group has one rank per process).

    python -m tests.support.broadcast_sender URL [URL ...] --port P --versions 2

Pushes `tests.contracts.test_sglang_engine.tensors(seed=version)` for each version, in buckets,
over gloo, and prints one JSON line per version: the transfer report.
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import ExitStack

from orchestrator.adapters.engines.sglang import SGLangEngine, WeightBroadcaster
from orchestrator.adapters.transport.bucketed import push_in_buckets
from tests.support.sglang_weights import tensors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("urls", nargs="+")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--versions", type=int, default=2)
    parser.add_argument("--group", default="colocate_weights")
    parser.add_argument("--timeout", type=float, default=30.0, help="the group's timeout, seconds")
    args = parser.parse_args(argv)
    engines = [SGLangEngine(url) for url in args.urls]
    broadcaster = WeightBroadcaster(
        engines, master_port=args.port, backend="gloo", group_name=args.group, timeout_s=args.timeout
    )
    for version in range(1, args.versions + 1):
        with ExitStack() as sessions:  # every server's weight-update session around the version's buckets
            for engine in engines:
                sessions.enter_context(engine.weight_update_session())
            report = push_in_buckets(tensors(seed=version), broadcaster, version, bucket_bytes=600)
        print(json.dumps({"version": version, "buckets": report.buckets, "bytes": report.bytes}), flush=True)
    broadcaster.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
