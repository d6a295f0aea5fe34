"""The protocol's GPU health reasons, weights reports, remove_weights and weights_status, and their compatibility."""

import json

import pytest

from nodewire import protocol
from nodewire.parts import GPUHealth
from nodewire.protocol import Heartbeat, Hello, ProtocolError, RemoveWeights, WeightsStatus
from nodewire.weights.messages import WeightsReport


def test_messages_of_agents_without_health_reasons_or_weights_are_still_accepted():
    old_heartbeat = {"type": "heartbeat", "v": 1, "gpus": [{"index": 0, "healthy": False}], "shards": []}
    heartbeat = protocol.decode_agent_message(json.dumps(old_heartbeat))
    assert heartbeat.gpus == [GPUHealth(index=0, healthy=False, reason="")]
    assert heartbeat.weights is None  # unknown, not "no weights"
    old_hello = {"type": "hello", "v": 1, "node": "n", "version": "0.0.9", "address": "a", "gpus": []}
    assert protocol.decode_agent_message(json.dumps(old_hello)).weights is None


def test_new_messages_round_trip():
    weights = [WeightsReport(source="org/m", path="/w/hub/models--org--m", size_bytes=5)]
    for message in (
        Heartbeat(gpus=[GPUHealth(index=0, healthy=False, reason="XID 79")], weights=weights),
        Hello(node="n", version="v", address="a", gpus=[], weights=weights),
        WeightsStatus(source="org/m", path="/w/x", removed=False, message="refused: outside"),
    ):
        assert protocol.decode_agent_message(protocol.encode(message)) == message
    remove = RemoveWeights(epoch=4, source="org/m", path="/w/hub/models--org--m")
    assert protocol.decode_command(protocol.encode(remove)) == remove


@pytest.mark.parametrize(
    ("weights", "problem"),
    [
        ([{"source": "a", "path": "/p", "size_bytes": -1}], r"Expected `int` >= 0 - at `\$.weights\[0\].size_bytes`"),
        ([{"source": "", "path": "/p", "size_bytes": 1}], r"at `\$.weights\[0\].source`"),
        (
            [{"source": "a", "path": "/p", "size_bytes": 1}, {"source": "a", "path": "/q", "size_bytes": 1}],
            "weights source 'a' is repeated",
        ),
    ],
)
def test_a_bad_weights_report_is_refused_naming_the_field(weights, problem):
    raw = json.dumps({"type": "heartbeat", "v": 1, "gpus": [], "weights": weights})
    with pytest.raises(ProtocolError, match=problem):
        protocol.decode_agent_message(raw)


def test_remove_weights_without_a_path_is_refused():
    with pytest.raises(ProtocolError, match=r"remove_weights: .*path"):
        protocol.decode_command(json.dumps({"type": "remove_weights", "v": 1, "epoch": 1, "source": "a"}))
