"""A TCP proxy on loopback that hands every reply on ``delay_s`` late (requests go straight
through): Redis as a gateway sees it when its answers come after the placement bound — on a
busy machine they do."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def late_proxy(port: int, delay_s: float) -> Iterator[int]:
    """Proxy to ``127.0.0.1:port`` in a thread of its own; yields the proxy's port."""
    loop = asyncio.new_event_loop()
    ready: list[asyncio.Server] = []

    async def serve(client: asyncio.StreamReader, to_client: asyncio.StreamWriter) -> None:
        server, to_server = await asyncio.open_connection("127.0.0.1", port)
        try:
            await asyncio.gather(_pipe(client, to_server, 0.0), _pipe(server, to_client, delay_s))
        except OSError:
            pass  # a side went away: so does the other
        finally:
            to_server.close()
            to_client.close()

    async def stop() -> None:
        ready[0].close()
        tasks = asyncio.all_tasks() - {asyncio.current_task()}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def start() -> None:
        ready.append(await asyncio.start_server(serve, "127.0.0.1", 0))

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(5)
    try:
        yield ready[0].sockets[0].getsockname()[1]
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Copy ``reader`` to ``writer``, each chunk ``delay_s`` after it came (in order)."""
    loop = asyncio.get_running_loop()
    chunks: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def forward() -> None:
        while True:
            due, data = await chunks.get()
            await asyncio.sleep(max(0.0, due - loop.time()))
            if not data:
                writer.close()
                return
            writer.write(data)
            await writer.drain()

    forwarding = asyncio.ensure_future(forward())
    while data := await reader.read(1 << 16):
        chunks.put_nowait((loop.time() + delay_s, data))
    chunks.put_nowait((loop.time() + delay_s, b""))
    await forwarding
