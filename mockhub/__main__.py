"""`python -m mockhub --root DIR [--port N] [--bytes-per-second B] [--token T]`: the mock hub in a process of its
own (benchmarks), printing its URL once it listens; faults change through POST /_faults."""

import argparse
import asyncio

from mockhub.server import Faults, MockHub


async def serve(args: argparse.Namespace) -> None:
    hub = MockHub(args.root, Faults(bytes_per_second=args.bytes_per_second, token=args.token), port=args.port)
    print(await hub.start(), flush=True)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m mockhub", description=__doc__)
    parser.add_argument("--root", required=True, help="folder of ORG/NAME repositories")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--bytes-per-second", type=float, default=None, help="the whole hub's rate")
    parser.add_argument("--token", default=None, help="the bearer token every request must carry")
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
