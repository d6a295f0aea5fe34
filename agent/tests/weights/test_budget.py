"""A node's weights budget: staging past it removes only what the control plane said may go, least recently
used first, as little as needed, and nothing at all when that would not be enough."""

import os

import pytest

from agent.tests.weights.cache import hold
from agent.weights.budget import make_room, parse_size
from agent.weights.transfer import TransferError
from nodewire.weights.staging_messages import Evictable

MB = 10**6


@pytest.mark.parametrize(
    ("text", "size"), [("500G", 500 * 10**9), ("1.5T", 1_500 * 10**9), ("800GiB", 800 * 2**30), ("4096", 4096)]
)
def test_sizes_are_read_in_decimal_and_binary_units(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "lots", "-3G", "0", "5X"])
def test_a_size_that_is_not_one_is_named(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def entry(root, name):
    return os.path.join(root, "hub", f"models--org--{name}")


def test_the_least_recently_used_evictable_weights_go_first_and_only_as_many_as_needed(tmp_path):
    for name, size in (("old", 2), ("older", 3), ("pinned", 3)):
        hold(tmp_path, f"org/{name}", {"model.safetensors": os.urandom(size * MB)})
    evictable = [Evictable(source="org/older", path=entry(tmp_path, "older")),
                 Evictable(source="org/old", path=entry(tmp_path, "old"))]  # fmt: skip
    # 8 MB held, 10 MB allowed, 4 MB needed: 2 MB must go, and the least recently used (first) frees 3.
    assert make_room(str(tmp_path), 10 * MB + 10_000, 4 * MB, evictable, keep="org/new") == ["org/older"]
    assert not os.path.exists(entry(tmp_path, "older"))
    assert os.path.exists(entry(tmp_path, "old")) and os.path.exists(entry(tmp_path, "pinned"))
    assert make_room(str(tmp_path), 10 * MB + 10_000, 1 * MB, evictable, keep="org/new") == []  # it fits


def test_when_the_evictable_weights_would_not_make_room_nothing_is_removed_and_the_stage_says_why(tmp_path):
    for name, size in (("old", 2), ("pinned", 6)):
        hold(tmp_path, f"org/{name}", {"model.safetensors": os.urandom(size * MB)})
    evictable = [Evictable(source="org/old", path=entry(tmp_path, "old"))]
    with pytest.raises(TransferError, match="in use or pinned"):
        make_room(str(tmp_path), 9 * MB, 4 * MB, evictable, keep="org/new")
    assert os.path.exists(entry(tmp_path, "old"))
    # The weights being staged are never evicted for themselves, even if listed.
    listed = [Evictable(source="org/pinned", path=entry(tmp_path, "pinned"))]
    with pytest.raises(TransferError):
        make_room(str(tmp_path), 7 * MB, 2 * MB, listed, keep="org/pinned")
    assert os.path.exists(entry(tmp_path, "pinned"))
