"""The per-commit flags travel over the host beside an NCCL group: ``dist.flag_group()``.

Under an NCCL default group, ``commit()``'s flag all-reduce ran on the GPU and was read back on the
host: at every commit a wait for every kernel queued (``elastrun/train/dist.py``).  The flags now go
through a gloo group over the same ranks, made with the default group and again after a re-form.
Two real ranks on a gloo default group stand in for NCCL here (``_needs_flag_group`` says yes);
``tests/gpu/test_flags_cuda.py`` checks that the host does not wait for the GPU under NCCL itself.
"""

from __future__ import annotations

import multiprocessing
import os

import pytest

from tests.harness import free_port


def _rank(rank: int, ports: tuple[int, int], out) -> None:
    import torch.distributed as dist

    from elastrun.train import dist as edist

    edist._needs_flag_group = lambda: True  # the gloo default group stands in for an NCCL one
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")  # fmt: skip
    edist.init_distributed("gloo", timeout_s=60)
    made_at_init = bool(edist._flag_group)
    first = edist.flag_group()
    got = edist.maxima((rank, 1 - rank, 5), [])
    kept = edist.flag_group() is first
    backend = str(dist.get_backend(first))
    dist.destroy_process_group()  # what a re-form does; then a new default group
    os.environ["MASTER_PORT"] = str(ports[1])
    edist.init_distributed("gloo", timeout_s=60)
    second = edist.flag_group()
    again = edist.maxima((3 * rank,), [])
    out.put((rank, made_at_init, got, kept, backend, second is not first and second is not None, again))
    dist.destroy_process_group()


@pytest.mark.e2e
def test_flags_go_over_a_gloo_group_made_with_the_default_group_and_again_after_a_new_one():
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    ports = (free_port(), free_port())
    procs = [ctx.Process(target=_rank, args=(r, ports, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = sorted(out.get(timeout=90) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    for rank, made_at_init, got, kept, backend, remade, again in results:
        assert made_at_init, f"rank {rank}: no flag group made with the default group"
        assert got == (1, 1, 5) and again == (3,), f"rank {rank}: wrong maxima {got}, {again}"
        assert kept and backend == "gloo", f"rank {rank}: the flag group changed ({kept}) or is {backend}"
        assert remade, f"rank {rank}: the flag group of the destroyed default group was used again"
    assert [p.exitcode for p in procs] == [0, 0]


@pytest.mark.unit
def test_no_gloo_flag_group_where_the_host_name_resolves_to_loopback_on_several_hosts(monkeypatch):
    """Gloo binds to the address the host's name resolves to: Debian's 127.0.1.1 cannot reach another
    node, and the group's set-up would wait out its timeout.  Refused there (flags over NCCL, said
    once), unless GLOO_SOCKET_IFNAME names the interface; one host is fine either way."""
    import socket

    from elastrun.train import dist as edist

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    why = edist._gloo_unreachable(16)
    assert "127.0.1.1" in why and "GLOO_SOCKET_IFNAME" in why
    assert edist._gloo_unreachable(8) == ""  # every rank on this host
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert edist._gloo_unreachable(1) == ""  # one rank, whatever launched it
    assert "127.0.1.1" in edist._gloo_unreachable(2)  # not known to be one host
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "10.1.2.3")
    assert edist._gloo_unreachable(16) == ""
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    assert edist._gloo_unreachable(16) == ""
    # thousands of ranks: a socket to each of them in every process is not paid for a few integers
    assert "ranks: a gloo group would open a socket" in edist._gloo_unreachable(edist.FLAG_GROUP_MAX_WORLD + 1)
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda which: (256, 4096))
    assert "given up to 64 ranks" in edist._gloo_unreachable(65) and edist._gloo_unreachable(64) == ""
