"""tests/support/app.py with the fence Redis moved to a server a topology test started itself.

The ledger (what the workload really did) stays on the suite's Redis (``FENCE_T_REDIS``), so a
test can kill, fail over or restart the fence Redis without losing its evidence:
``FENCE_T_FENCE_REDIS``          fence_redis_url (redis://, rediss://, sentinel://...)
``FENCE_T_FENCE_MASTER``         Sentinel master name (fence_redis_transport_options)
``FENCE_T_FENCE_CLUSTER=1``      fence_redis_cluster=True
"""

from __future__ import annotations

import os

from tests.support.app import app, work

E = os.environ
app.conf.fence_redis_url = E["FENCE_T_FENCE_REDIS"]
if E.get("FENCE_T_FENCE_MASTER"):
    app.conf.fence_redis_transport_options = {"master_name": E["FENCE_T_FENCE_MASTER"]}
app.conf.fence_redis_cluster = E.get("FENCE_T_FENCE_CLUSTER", "0") == "1"

__all__ = ["app", "work"]
