"""The Ray cluster's addresses, checked without starting Ray (orchestrator/job/ray_cluster.py)."""

from __future__ import annotations

import ipaddress
import os

import psutil
import pytest

from orchestrator.errors import ConfigError, RayUnreachable
from orchestrator.job.config import Cluster
from orchestrator.job.job import RunConfig, rendezvous_store
from orchestrator.job.ray_cluster import LOOPBACK_FOR_RAY, _keep_loopback, address_problems, driver_ip


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


@pytest.mark.parametrize("address", ["10.0.0.5:6379", "127.0.0.1:41000", "[fd00::5]:6379", "head-node:6379"])
def test_a_gcs_address_is_accepted(address: str) -> None:
    assert address_problems(address) == []
    assert RunConfig(cluster=Cluster(ray_address=address)).cluster.ray_address == address


@pytest.mark.parametrize(
    ("address", "words"),
    [
        ("head-node", "expected HOST:PORT"),
        (":6379", "expected HOST:PORT"),
        ("10.0.0.5:0", "expected HOST:PORT"),
        ("10.0.0.5:70000", "expected HOST:PORT"),
        ("10.0.0.5:http", "expected HOST:PORT"),
        ("ray://10.0.0.5:10001", "Ray Client (ray://) is not supported"),
    ],
)
def test_a_bad_address_is_a_config_error_naming_it(address: str, words: str) -> None:
    with pytest.raises(ConfigError) as refused:
        RunConfig(cluster=Cluster(ray_address=address))
    assert words in str(refused.value) and address in str(refused.value)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "127.0.0.5"])
def test_a_loopback_address_stays_loopback(host: str) -> None:
    # ray.init would rewrite 127.0.0.1 and localhost to the host's outward IP.
    assert _keep_loopback(f"{host}:6379") == f"{LOOPBACK_FOR_RAY}:6379"
    assert driver_ip(f"{host}:6379") == "127.0.0.1"


def test_other_addresses_are_left_as_given() -> None:
    assert _keep_loopback("10.0.0.5:6379") == "10.0.0.5:6379"
    assert _keep_loopback("head-node:6379") == "head-node:6379"


def test_the_driver_is_reached_on_loopback_by_a_private_cluster() -> None:
    assert driver_ip(None) == "127.0.0.1"


def test_an_unresolvable_host_is_unreachable_by_name() -> None:
    with pytest.raises(RayUnreachable) as unreachable:
        driver_ip("no-such-host.invalid:6379")
    assert "no-such-host.invalid:6379" in str(unreachable.value)


def test_the_rendezvous_store_listens_on_loopback_only() -> None:
    # torch's own store server would listen on every interface, whatever host it is given.
    store = rendezvous_store()
    listening = [
        c.laddr
        for c in psutil.Process(os.getpid()).net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port
    ]
    assert listening, "the store's port is not listening in this process"
    assert all(is_loopback(addr.ip) for addr in listening), listening
