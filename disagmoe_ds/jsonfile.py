"""Reading a JSON file that must hold an object, with one error that names the file, what is wrong and the fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from disagmoe_ds.errors import ConfigError, DisagMoEError

# A JSON object as ``json.loads`` makes it (a ds_config, say): its values are whatever JSON holds, read by key.
JsonObject = dict[str, Any]


def read_json_object(path: str | Path, *, what: str, fix: str, error: type[DisagMoEError] = ConfigError) -> JsonObject:
    """The JSON object in ``path``.

    Raises ``error`` when the file is missing, is not valid JSON or holds something other than an object; the
    message names ``what`` the file is (e.g. "DeepSpeed config"), the problem and then ``fix``.
    """
    path = Path(path)
    if not path.is_file():
        raise error(f"{what} {path} does not exist; {fix}")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        where = f"line {err.lineno}: {err.msg}" if isinstance(err, json.JSONDecodeError) else "not UTF-8 text"
        raise error(f"{what} {path} is not valid JSON ({where}); {fix}") from err
    if not isinstance(value, dict):
        raise error(f"{what} {path} must hold a JSON object, got {type(value).__name__}; {fix}")
    return value
