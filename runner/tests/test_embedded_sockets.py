"""The sockets `up` listens on: connections accepted on them send small writes at once (TCP_NODELAY)."""

import asyncio
import socket

from conftest import free_port
from runner.embedded import bind


def test_connections_accepted_on_a_bound_socket_have_nodelay():
    # asyncio sets TCP_NODELAY only when the listening socket names IPPROTO_TCP; without it a keep-alive
    # client waited ~40 ms for every response after its first (Nagle against the client's delayed ACK).
    async def accepted_nodelay() -> int:
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Record(asyncio.Protocol):
            def connection_made(self, transport):
                seen.set_result(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        sock = bind("127.0.0.1", free_port())
        server = await asyncio.get_running_loop().create_server(Record, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname())
        try:
            return await asyncio.wait_for(seen, 5)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(accepted_nodelay()) == 1
