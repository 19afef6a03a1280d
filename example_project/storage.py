"""A local stand-in for an object store bucket (S3, GCS): put/get by key, plus an access log.

``put`` replaces the object atomically, as an object store does; the access log (one JSON line per
write, with who wrote it) is how the demo shows that a re-run replaced the same object.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from . import settings

LOG = "_writes.log"


def root() -> Path:
    return Path(settings.OBJECTS_DIR)


def put(object_key: str, data: bytes, **writer: Any) -> None:
    path = root() / object_key
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".upload-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)  # readers see the old object or the new one, never half of one
    with open(root() / LOG, "a") as log:
        log.write(json.dumps({"object_key": object_key, "bytes": len(data), **writer}) + "\n")


def get(object_key: str) -> bytes:
    return (root() / object_key).read_bytes()


def keys() -> list[str]:
    base = root()
    return sorted(
        str(p.relative_to(base))
        for p in base.rglob("*")
        if p.is_file() and p.name != LOG and not p.name.startswith(".upload-")
    )


def writes() -> list[dict[str, Any]]:
    try:
        lines = (root() / LOG).read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.strip()]
