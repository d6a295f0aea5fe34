"""The agent's state directory: what a node agent must remember across restarts.

Two facts live in `state.json` there:

* the node name the directory belongs to, so one directory cannot serve two
  nodes (an agent started with another `--node` refuses to run);
* the highest lease epoch the agent has seen (DESIGN invariant 1, fencing): a
  restarted agent must still refuse commands from a leader older than one it
  obeyed before the restart.

The file is replaced atomically (temp file, fsync, rename, fsync of the
directory) *before* the agent acts on a command with a higher epoch, so a
crash at any point leaves either the old or the new epoch, never a torn file,
and never an action whose epoch was not recorded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

STATE_FILE = "state.json"
STATE_VERSION = 1
STATE_DIR_ENV = "LLMGW_AGENT_STATE_DIR"
SYSTEM_STATE_DIR = "/var/lib/llmgw-agent"


class StateError(Exception):
    """The state directory cannot be used; the text names the file and the problem."""


def default_state_dir(environ: Mapping[str, str] = os.environ, is_root: bool | None = None) -> str:
    """Where an agent keeps its state when neither --state-dir nor LLMGW_AGENT_STATE_DIR says.

    /var/lib/llmgw-agent for root (a system service), else the user's XDG state
    directory ($XDG_STATE_HOME, default ~/.local/state) under llmgw-agent.
    """
    if is_root is None:
        is_root = os.geteuid() == 0
    if is_root:
        return SYSTEM_STATE_DIR
    base = environ.get("XDG_STATE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "llmgw-agent")


class AgentState:
    """The state directory of one node's agent; `open()` it, then `record_epoch()` before obeying a newer leader."""

    def __init__(self, directory: Path, node: str, highest_epoch: int | None):
        self.directory = directory
        self.node = node
        self.highest_epoch = highest_epoch

    @property
    def path(self) -> Path:
        return self.directory / STATE_FILE

    @classmethod
    def open(cls, directory: str | os.PathLike, node: str) -> AgentState:
        """Load (or create) the state of `node` in `directory`; StateError if it is unusable or another node's."""
        directory = Path(directory)
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise StateError(f"cannot create the agent state directory {directory}: {exc.strerror or exc}") from None
        path = directory / STATE_FILE
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            state = cls(directory, node, None)
            state._write()
            return state
        except OSError as exc:
            raise StateError(f"cannot read the agent state file {path}: {exc.strerror or exc}") from None
        owner, epoch = _parse(text, path)
        if owner != node:
            raise StateError(
                f"the agent state directory {directory} belongs to node “{owner}”, not “{node}”; "
                "give this node its own --state-dir"
            )
        return cls(directory, node, epoch)

    def record_epoch(self, epoch: int) -> None:
        """Remember `epoch` as the highest seen, durably, before the caller acts on it; StateError if it cannot."""
        previous = self.highest_epoch
        self.highest_epoch = epoch
        try:
            self._write()
        except StateError:
            self.highest_epoch = previous
            raise

    def _write(self) -> None:
        data = {"version": STATE_VERSION, "node": self.node, "highest_epoch": self.highest_epoch}
        try:
            fd, tmp = tempfile.mkstemp(prefix=".state-", suffix=".tmp", dir=self.directory)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as handle:
                    json.dump(data, handle)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            # The rename is durable only once the directory entry is on disk too.
            dir_fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            raise StateError(f"cannot write the agent state file {self.path}: {exc.strerror or exc}") from None


def _parse(text: str, path: Path) -> tuple[str, int | None]:
    """The node name and highest epoch in a state file's text; StateError names what is wrong."""
    hint = "fix or remove it (removing it forgets the highest epoch seen)"
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise StateError(f"the agent state file {path} is not valid JSON ({exc}); {hint}") from None
    if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
        raise StateError(f"the agent state file {path} is not a version {STATE_VERSION} agent state; {hint}")
    node, epoch = data.get("node"), data.get("highest_epoch")
    if not isinstance(node, str) or not node:
        raise StateError(f"the agent state file {path} names no node; {hint}")
    if epoch is not None and (type(epoch) is not int or epoch < 0):
        raise StateError(f"the agent state file {path} has a bad highest_epoch {epoch!r}; {hint}")
    return node, epoch


class Fence:
    """Which leaders' commands the agent obeys: none older than the newest epoch seen (DESIGN invariant 1).

    A leader older than one the agent has heard from may act on stale beliefs.
    With an AgentState the newest epoch is recorded before a command carrying
    it is obeyed, so a restart does not forget it; without one (tests, the
    embedded demo's agents) it is kept in memory only.
    """

    def __init__(self, state: AgentState | None):
        self.state = state
        self.highest_epoch: int | None = state.highest_epoch if state is not None else None

    def admits(self, kind: str, epoch: int, subject: int | str) -> bool:
        """Whether `kind` (for shard or weights `subject`) stamped with `epoch` may be obeyed; logs a refusal."""
        state, highest = self.state, self.highest_epoch
        if highest is not None and epoch < highest:
            # A control plane started on a new database counts epochs from 1 again: say where the memory is.
            remembered = (
                f" (remembered in {state.path}; remove it if the control plane's database was replaced)"
                if state is not None
                else ""
            )
            log.warning(
                "%s for %s refused: epoch %s is older than epoch %s already seen%s",
                kind, _subject(subject), epoch, highest, remembered,
            )  # fmt: skip
            return False
        if state is not None and (highest is None or epoch > highest):
            # Recorded before acting: a restart must not forget a leader this agent already obeyed.
            try:
                state.record_epoch(epoch)
            except StateError as exc:
                log.error("%s for %s refused: epoch %s cannot be recorded: %s", kind, _subject(subject), epoch, exc)
                return False
        self.highest_epoch = epoch
        return True


def _subject(subject: int | str) -> str:
    return f"shard {subject}" if isinstance(subject, int) else str(subject)
