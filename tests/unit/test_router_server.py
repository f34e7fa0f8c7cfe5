"""The peer ROUTER's requests live in its one task group: cancelling ``serve`` cancels the
requests in flight and leaves no task behind (nothing outlives its nursery)."""

from __future__ import annotations

import asyncio
import uuid

import zmq
import zmq.asyncio

from elasticd.control.server import RouterServer, Zap
from elasticd.wire import protocol


def test_cancelling_serve_cancels_the_requests_in_flight(tmp_path):
    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        started, cancelled = asyncio.Event(), asyncio.Event()

        async def handler(caller, request, reply) -> None:
            started.set()
            try:
                await asyncio.Event().wait()  # a request that never ends by itself
            except asyncio.CancelledError:
                cancelled.set()
                raise

        server = RouterServer(
            ctx,
            f"ipc://{tmp_path}/peer.sock",
            handler,
            domain=b"test",
            identify=lambda user_id: user_id,
        )
        zap = Zap(ctx)
        zap.add(b"test", lambda mechanism, address, credentials: b"tester")
        endpoint = server.bind()
        answering = asyncio.create_task(zap.serve())
        serving = asyncio.create_task(server.serve())
        client = ctx.socket(zmq.DEALER)
        client.connect(endpoint)
        try:
            for _ in range(3):
                request = protocol.Request(uuid.uuid4().hex, "version", {})
                await client.send(protocol.encode_request(request))
            async with asyncio.timeout(30):
                await started.wait()
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
            assert cancelled.is_set()
            answering.cancel()
            await asyncio.gather(answering, return_exceptions=True)
            assert asyncio.all_tasks() == {asyncio.current_task()}
        finally:
            client.close(linger=0)
            server.close()
            zap.close()
            ctx.term()

    asyncio.run(scenario())
