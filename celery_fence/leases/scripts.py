"""The Lua scripts celery-fence runs on Redis (``celery_fence/leases/lua/*.lua``), called by SHA."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from importlib import resources
from typing import Any

import redis
from redis.exceptions import NoScriptError

#: A line of a script that stands for another file's text (shared parts: ``_claim_parts.lua``).
INCLUDE = "-- include: "


def _script_source(name: str) -> str:
    """The text Redis runs: ``lua/<name>.lua`` with each ``-- include: <part>`` line replaced
    by ``lua/<part>.lua`` (one level: a part includes nothing)."""
    text = _read(name)
    return "".join(
        _read(line[len(INCLUDE) :].strip()) if line.startswith(INCLUDE) else line
        for line in text.splitlines(keepends=True)
    )


def _read(name: str) -> str:
    return resources.files("celery_fence.leases").joinpath(f"lua/{name}.lua").read_text("utf-8")


class LuaScript:
    """A Lua script called by SHA, re-loaded once on ``NOSCRIPT`` (restart, failover, new node)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.source = _script_source(name)
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    def __call__(self, client: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            self.load(client)
            return client.evalsha(self.sha, len(keys), *keys, *args)

    def load(self, client: Any) -> None:
        """``SCRIPT LOAD`` where ``client`` runs scripts (on a Redis Cluster: every primary)."""
        client.script_load(self.source)

    def call_once(self, client: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Like calling the script, but one send on one pooled connection, never re-sent.

        redis-py re-sends a command after a timeout or connection error (its ``Retry``). For a
        claim that is wrong: the lost reply may have been a granted lease, which the re-sent
        claim then meets and reports as busy — another INCR, and a task that believes some
        other attempt holds its key. Here the error is raised as what it is, and the caller
        re-sends the message with backoff. It also skips redis-py's per-command machinery,
        which costs more CPU than the round trip. Used for single Redis / Sentinel /
        unix-socket clients; a Redis Cluster client, a single-connection client or any other
        client takes the ordinary path.
        """
        pool = getattr(client, "connection_pool", None)
        if (
            not isinstance(client, redis.Redis)
            or getattr(client, "connection", None) is not None
            or pool is None
        ):
            return self(client, keys, args)
        try:
            conn = pool.get_connection()
        except TypeError:  # redis-py < 5.3 wants the command name
            conn = pool.get_connection("EVALSHA")
        try:
            conn.send_command("EVALSHA", self.sha, len(keys), *keys, *args)
            return conn.read_response()
        except NoScriptError:
            pass  # a complete reply: the connection is fine; load the script below
        except BaseException:
            conn.disconnect()  # a reply may still be in flight: never reuse this connection
            raise
        finally:
            pool.release(conn)
        self.load(client)
        return self(client, keys, args)


__all__ = ["LuaScript"]
