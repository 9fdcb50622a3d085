"""Kernel configs: ``<op>.py`` holds an op's frozen config dataclass and its lookup, the numbers
are in ``<op>.json`` beside it (one list of entries per GPU family); this module reads them."""
from __future__ import annotations

import functools
import json
from pathlib import Path

_HERE = Path(__file__).parent


@functools.lru_cache(maxsize=None)
def table(name: str) -> dict:
    """The config table ``name``.json of this folder, parsed once (do not mutate it)."""
    with open(_HERE / f"{name}.json") as f:
        return json.load(f)


def families(name: str) -> list[str]:
    """The GPU families of table ``name``: its keys that hold a list of entries (not the
    ``_doc`` note or a table's shared rule parameters)."""
    return [f for f, entries in table(name).items() if isinstance(entries, list)]

