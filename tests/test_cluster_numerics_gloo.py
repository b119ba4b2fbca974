"""FSDP2's checkpoint side group and a CPU rank's training group are gloo groups (issue 74 item 7, N10): on a GPU
node with several networks, gloo left to itself takes the address the host name resolves to, which the other nodes
may not reach. Every gloo group compass opens uses GLOO_SOCKET_IFNAME where the cluster sets it, else the interface
this node reaches the launcher's rendezvous (MASTER_ADDR) through."""

from __future__ import annotations

import psutil
import pytest

from compass.model.training import collectives


def own_addresses() -> dict[str, str]:
    """This machine's IPv4 address of each interface that has one."""
    return {name: a.address for name, addresses in psutil.net_if_addrs().items() for a in addresses
            if a.family.name == "AF_INET"}


@pytest.fixture
def rendezvous(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    return lambda address: monkeypatch.setenv("MASTER_ADDR", address)


def test_the_interface_is_the_one_that_reaches_the_rendezvous(rendezvous):
    addresses = own_addresses()
    loopback = next(name for name, address in addresses.items() if address.startswith("127."))
    for name, address in addresses.items():  # each of this machine's networks, as if the rendezvous were there
        rendezvous(address)
        assert collectives.gloo_interface() == name, (name, address)
    rendezvous("localhost")
    assert collectives.gloo_interface() == loopback


def test_the_clusters_own_choice_is_kept_and_an_unknown_rendezvous_chooses_nothing(rendezvous, monkeypatch):
    rendezvous("127.0.0.1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")
    assert collectives.gloo_interface() == "ib0"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    rendezvous("no-such-host.invalid")
    assert collectives.gloo_interface() is None
    monkeypatch.delenv("MASTER_ADDR")
    assert collectives.gloo_interface() is None


def test_a_side_group_names_its_interface_before_gloo_reads_it(rendezvous, monkeypatch):
    """A real gloo group (of this process alone, through the launcher's rendezvous variables): the choice is in the
    environment before the side group is made (gloo reads it then), and the side group reduces over it."""
    import torch
    import torch.distributed as dist

    from compass.infra.net import free_port

    rendezvous("127.0.0.1")
    ours = not dist.is_initialized()  # an in-process engine test before this one may have left its group open
    if ours:
        for name, value in (("MASTER_PORT", str(free_port())), ("RANK", "0"), ("WORLD_SIZE", "1")):
            monkeypatch.setenv(name, value)
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        group = collectives.side_group()
        assert collectives.os.environ["GLOO_SOCKET_IFNAME"] == collectives.gloo_interface() is not None
        summed = torch.ones(3)
        dist.all_reduce(summed, group=group)
        assert summed.tolist() == [1.0, 1.0, 1.0]
    finally:
        if ours:
            dist.destroy_process_group()
        collectives.os.environ.pop("GLOO_SOCKET_IFNAME", None)
