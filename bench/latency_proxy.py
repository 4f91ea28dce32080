"""A loopback TCP proxy that delivers every byte sent to the endpoint ``delay`` seconds late: a
distant object store's round trip (AWS S3 answers a PUT in 20-50 ms), in front of the loopback
one, for bench/s3_write.py ``--latency-ms``.

It works below HTTP (bytes are timestamped when they arrive and forwarded once their delay is
up; answers come back at once), so it costs one copy of the request bytes and no parsing. Kernel
emulation (``tc netem``) is not available in this machine's containers.

    python -m bench.latency_proxy UPSTREAM_PORT DELAY_MS   # prints its own port, serves until killed
"""

from __future__ import annotations

import asyncio
import sys
import time


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        writer.close()

    sender = asyncio.create_task(deliver())
    try:
        while data := await reader.read(1 << 18):
            queue.put_nowait((time.monotonic() + delay, data))
    except ConnectionError:
        pass
    queue.put_nowait((0.0, b""))
    try:
        await sender
    except ConnectionError:
        pass


async def serve(upstream_port: int, delay: float) -> None:
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", upstream_port)
        await asyncio.gather(_pipe(client_r, server_w, delay), _pipe(server_r, client_w, 0.0))

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1]), float(sys.argv[2]) / 1000))
