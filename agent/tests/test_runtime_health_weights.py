"""The agent reports live GPU health and its weights, and carries out remove_weights (fenced, inside its root only)."""

import asyncio
import os

from agent.tests.stand_ins import ControlPlane, checked, command, fresh_heartbeat, make_agent, run, start_ready
from nodewire import protocol
from nodewire.tests.test_weights_disk import make_hf_cache


def test_a_gpu_set_unhealthy_is_reported_with_its_reason_by_the_next_heartbeat():
    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url])
            task = asyncio.create_task(agent.run())
            hello = checked(await cp.next(protocol.HELLO))
            assert [(g["healthy"], g["reason"]) for g in hello["gpus"]] == [(True, ""), (True, "")]
            assert hello["weights"] is None  # no weights root: nothing known
            agent.set_gpu_health(1, False, "XID 79 (simulated)")
            heartbeat = await fresh_heartbeat(cp)
            assert heartbeat["gpus"] == [
                {"index": 0, "healthy": True, "reason": ""},
                {"index": 1, "healthy": False, "reason": "XID 79 (simulated)"},
            ]
            agent.set_gpu_health(1, True)
            heartbeat = await fresh_heartbeat(cp)
            assert heartbeat["gpus"][1] == {"index": 1, "healthy": True, "reason": ""}
            await agent.shutdown()
            await task

    run(scenario())


def test_hello_carries_the_weights_and_remove_weights_deletes_inside_the_root_only(tmp_path):
    root, outside = tmp_path / "weights", tmp_path / "precious"
    root.mkdir()
    outside.mkdir()
    entry = make_hf_cache(root, "org/m")
    os.symlink(outside, root / "escape")

    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url], weights_root=str(root), weights_scan_every=1)
            task = asyncio.create_task(agent.run())
            hello = checked(await cp.next(protocol.HELLO))
            assert hello["weights"] == [{"source": "org/m", "path": str(entry), "size_bytes": 1004}]

            await cp.send(command(protocol.REMOVE_WEIGHTS, 5, source="evil", path=str(root / "escape")))
            refused = checked(await cp.next(protocol.WEIGHTS_STATUS))
            assert (refused["source"], refused["removed"]) == ("evil", False)
            assert "outside the weights root" in refused["message"]

            # Acknowledged as soon as received (the control plane stops sending it again), then answered.
            await cp.send(command(protocol.REMOVE_WEIGHTS, 5, cid="c1", source="org/m", path=str(entry)))
            ack = checked(await cp.next(protocol.ACK))
            assert (ack["cid"], ack["refused"]) == ("c1", False)
            removed = checked(await cp.next(protocol.WEIGHTS_STATUS))
            assert (removed["source"], removed["removed"], removed["message"]) == ("org/m", True, f"removed {entry}")
            # A later heartbeat reports the disk as it is now (a scan that began while the files were being deleted
            # may report what it saw first: the removal asks for another scan, whose result follows).
            reported = []
            while len(reported) < 5 and reported[-1:] != [[]]:
                heartbeat = checked(await cp.next(protocol.HEARTBEAT))
                if heartbeat["weights"] is not None:
                    reported.append(heartbeat["weights"])
            assert reported[-1] == []

            # A deposed leader's removal is refused without an answer but its acknowledgement (fencing).
            make_hf_cache(root, "org/again")
            await cp.send(command(protocol.REMOVE_WEIGHTS, 4, cid="c2", source="org/again", path=str(root / "hub")))
            refusal = checked(await cp.next(protocol.ACK))
            assert (refusal["cid"], refusal["refused"]) == ("c2", True)
            await asyncio.sleep(0.3)
            await agent.shutdown()
            await task
            return cp

    cp = run(scenario())
    assert (root / "hub" / "models--org--again").is_dir() and outside.is_dir()
    assert all(m["type"] != protocol.WEIGHTS_STATUS for m in _drain(cp.messages))


def _drain(queue: asyncio.Queue) -> list[dict]:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def test_engines_are_given_the_weights_root_as_their_hugging_face_home(tmp_path):
    async def scenario():
        async with ControlPlane() as cp:
            agent = make_agent([cp.url], weights_root=str(tmp_path))
            task = asyncio.create_task(agent.run())
            await cp.next(protocol.HELLO)
            await start_ready(cp, shard_id=3)
            with open(f"/proc/{agent.engine_pid(3)}/environ", "rb") as environ:
                variables = dict(item.split(b"=", 1) for item in environ.read().split(b"\0") if b"=" in item)
            await agent.shutdown()
            await task
            return variables

    assert run(scenario())[b"HF_HOME"] == str(tmp_path).encode()
