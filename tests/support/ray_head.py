"""A user's own Ray cluster for tests: `ray start --head` on 127.0.0.1 with token authentication,
started and stopped by the test itself (by its processes, found by its folder: never `ray stop`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.support.spawn import free_port


def ray_command(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ray.scripts.scripts", *args], env=env, capture_output=True, text=True)


@dataclass
class UsersCluster:
    address: str
    folder: Path
    env: dict[str, str]  # what a driver of it needs: token mode

    def ask(self, code: str) -> object:
        """Run `code` in a driver of the cluster (its own process); returns what it prints as JSON."""
        import json

        script = f"import json, ray\nray.init(address='[::ffff:127.0.0.1]:{self.address.rpartition(':')[2]}')\n{code}"
        done = subprocess.run([sys.executable, "-c", script], env=self.env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def users_cluster(prefix: str, *, cpus: int = 4, gpus: int = 0) -> Iterator[UsersCluster]:
    """A head of `cpus` CPUs and `gpus` logical GPUs, in a folder of its own (short: Ray's socket
    paths must fit in 107 bytes); on the way out, each of its processes is killed and the folder
    removed."""
    import psutil

    from orchestrator.job.ray_reaper import head_processes

    folder = Path(tempfile.mkdtemp(prefix=prefix))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env |= {"RAY_AUTH_MODE": "token", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    try:
        assert ray_command("get-auth-token", "--generate", env=env).returncode == 0
        started = ray_command(
            "start", "--head", "--node-ip-address=127.0.0.1", "--port=0", f"--num-cpus={cpus}", f"--num-gpus={gpus}",
            "--include-dashboard=false", "--dashboard-agent-listen-port=0", "--metrics-export-port=0",
            f"--ray-client-server-port={free_port()}", "--disable-usage-stats", f"--temp-dir={folder}",
            env=env,
        )  # fmt: skip
        assert started.returncode == 0, started.stderr
        port = (folder / "ray_current_cluster").read_text().strip().rpartition(":")[2]
        yield UsersCluster(f"127.0.0.1:{port}", folder, {k: v for k, v in env.items() if "WINDOWS" not in k})
    finally:
        procs = head_processes(folder)  # Ray Client's server too, found by the GCS address
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(procs, timeout=10)
        shutil.rmtree(folder, ignore_errors=True)
