"""Starting ranks: join an external launcher's job (env) or fork a local one (local).

``disagmoe_ds.launch.testing`` (pytest helpers) is not imported here so that runtime code does not need pytest.
"""

from disagmoe_ds.launch.env import detect_launcher, disable_shm_op, init_from_env
from disagmoe_ds.launch.local import RankFailedError, spawn_local

__all__ = ["RankFailedError", "detect_launcher", "disable_shm_op", "init_from_env", "spawn_local"]
