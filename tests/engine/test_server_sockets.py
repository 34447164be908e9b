"""``listen_sockets``: the server binds every address its host resolves to, on one port, before the model loads;
a host that does not resolve or a port taken on any of its addresses is a ``ConfigError`` with nothing left open."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest
from aiohttp import web

from elastiserve.engine.server import listen_sockets, start_site
from elastiserve.platforms import ConfigError

pytestmark = [pytest.mark.cpu]


def _addresses(host: str) -> set[str]:
    return {info[4][0] for info in socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)}


async def _health_on_every_socket(socks: list[socket.socket]) -> list[str]:
    app = web.Application()
    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.router.add_get("/health", health)
    runner, port = await start_site(app, socks=socks)
    try:
        async with aiohttp.ClientSession() as session:
            bodies = []
            for sock in socks:
                host = sock.getsockname()[0]
                async with session.get(f"http://[{host}]:{port}/health" if ":" in host else
                                       f"http://{host}:{port}/health") as response:
                    bodies.append(await response.text())
            return bodies
    finally:
        await runner.cleanup()


def test_every_address_of_localhost_is_bound_on_one_port_and_served():
    socks = listen_sockets("localhost", 0)
    try:
        assert {sock.getsockname()[0] for sock in socks} == _addresses("localhost")
        assert len({sock.getsockname()[1] for sock in socks}) == 1
        assert asyncio.run(_health_on_every_socket(socks)) == ["ok"] * len(socks)
    finally:
        for sock in socks:
            sock.close()


def test_a_host_with_two_addresses_gets_two_sockets_on_one_port(monkeypatch):
    """Two loopback addresses (Linux routes all of 127/8 to lo), one of them listed twice by the resolver."""
    def resolve(host, port, *args, **kwargs):
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))
                for address in ("127.0.0.1", "127.0.0.2", "127.0.0.1")]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    socks = listen_sockets("twohomed", 0)
    monkeypatch.undo()
    try:
        assert [sock.getsockname()[0] for sock in socks] == ["127.0.0.1", "127.0.0.2"]
        assert socks[0].getsockname()[1] == socks[1].getsockname()[1] != 0
        assert asyncio.run(_health_on_every_socket(socks)) == ["ok", "ok"]
    finally:
        for sock in socks:
            sock.close()


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_ipv4_and_ipv6_addresses_share_the_port_and_a_lone_ipv6_keeps_dual_stack(monkeypatch):
    """127.0.0.1 and ::1 (localhost on most machines): the IPv6 socket is IPv6-only, so the two do not collide; a
    lone IPv6 address keeps the system's default. Where ::1 cannot be bound, the attempt is a ConfigError that closes
    the IPv4 socket bound before it."""
    def resolve(host, port, *args, **kwargs):
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port)),
                (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0))]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    if not _ipv6_loopback():
        with pytest.raises(ConfigError, match="cannot listen on dualhost:0"):
            listen_sockets("dualhost", 0)
        monkeypatch.undo()
        for sock in listen_sockets("127.0.0.1", 0):  # the port search is not left holding anything
            sock.close()
        return
    socks = listen_sockets("dualhost", 0)
    monkeypatch.undo()
    try:
        assert [sock.family for sock in socks] == [socket.AF_INET, socket.AF_INET6]
        assert socks[0].getsockname()[1] == socks[1].getsockname()[1]
        assert socks[1].getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1
        assert asyncio.run(_health_on_every_socket(socks)) == ["ok", "ok"]
    finally:
        for sock in socks:
            sock.close()
    (lone,) = listen_sockets("::", 0)  # every address: IPv4 too where the system is dual-stack by default
    with lone, socket.socket(socket.AF_INET6) as fresh:
        fresh.bind(("::", 0))
        assert lone.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == \
            fresh.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY)


def test_a_port_taken_or_a_host_that_does_not_resolve_is_a_config_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            listen_sockets("127.0.0.1", port)
        with pytest.raises(ConfigError, match=f"cannot listen on localhost:{port}"):
            listen_sockets("localhost", port)  # 127.0.0.1 is taken; any ::1 socket bound first is closed again
    with pytest.raises(ConfigError, match=r"cannot listen on no-such-host\.invalid"):
        listen_sockets("no-such-host.invalid", 0)
    socks = listen_sockets("localhost", port)  # nothing of the failed attempts holds the port
    for sock in socks:
        sock.close()
