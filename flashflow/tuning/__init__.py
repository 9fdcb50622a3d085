"""Kernel configs and the launch rules beside them: ``<op>.py`` holds an op's frozen config
dataclass, its lookup and the rules that turn a call's shape into launch parameters; the numbers
are in ``<op>.json`` beside it (one list of entries per GPU family). This module reads them all
the same way (:class:`ConfigTable`).

The match rule, written once: an entry holds for a lookup when every match key the entry names
holds: ``<key>_max`` is an upper bound (the input ≤ it; an input of None passes no bound), a
plain ``<key>`` equals the input or is null (either); a key the entry leaves out matches
anything. The first entry that holds wins, so a table lists its special cases first and ends
with a catch-all. Keys starting with ``_`` are notes: ``_why`` (what was measured, where, and
the result file in bench/results/), ``_rejected`` (option -> why it lost, citing its file).
"""
from __future__ import annotations

import functools
import json
import typing
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Optional

_HERE = Path(__file__).parent


@functools.lru_cache(maxsize=None)
def table(name: str) -> dict:
    """The config table ``name``.json of this folder, parsed once (do not mutate it)."""
    with open(_HERE / f"{name}.json") as f:
        return json.load(f)


def families(name: str, kind: Optional[str] = None) -> list[str]:
    """The GPU families of table ``name`` (of its sub-table ``kind``, e.g. mlp.json's ``"splitk"``):
    its keys that hold a list of entries (not the notes or a table's shared rule parameters)."""
    t = table(name) if kind is None else table(name)[kind]
    return [f for f, entries in t.items() if isinstance(entries, list)]


class NoConfigError(ValueError, LookupError):
    """No entry of a config table holds for a lookup (or the family has no table)."""


class Config:
    """What every config dataclass has: a copy with some fields changed (autotune candidates,
    sweeps) and its fields as a dict."""

    def replace(self, **kw):
        return replace(self, **kw)

    def as_dict(self) -> dict:
        return asdict(self)


def holds(entry: dict, inputs: dict) -> bool:
    """Whether ``entry`` holds for the lookup ``inputs`` (the match rule of this module's docstring)."""
    for key, value in inputs.items():
        bound = entry.get(f"{key}_max")
        if bound is not None and (value is None or value > bound):
            return False
        want = entry.get(key)
        if want is not None and want != value:
            return False
    return True


def _type_ok(value, hint) -> bool:
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if hint is type(None):
        return value is None
    args = typing.get_args(hint)   # Optional[X]
    return any(_type_ok(value, a) for a in args) if args else True


@dataclass(frozen=True)
class ConfigTable:
    """One config table: entries of ``name``.json (its sub-table ``kind``) per GPU family, matched
    on ``keys``, each building a ``cls``. ``what`` names the op in error messages."""
    name: str
    cls: type
    keys: tuple
    what: str
    kind: Optional[str] = None
    # fields the lookup fills in where an entry leaves them out, each with a sample value to check
    # the entries with (mlp's BLOCK_I: the split-K slice width)
    supplied: tuple = ()

    def families(self) -> list[str]:
        return families(self.name, self.kind)

    def entries(self, family: str) -> list[dict]:
        """The entries of ``family`` in table order (checked once: :meth:`check`)."""
        known = self.families()
        if family not in known:
            raise NoConfigError(f"no {self.what} configs for GPU family {family!r}; family must be one of "
                                f"{', '.join(known)}")
        return _checked(self)[family]

    def shipped_entries(self, family: Optional[str] = None) -> list[dict]:
        """The entries in table order, each with its ``family``; every family's if ``family`` is None."""
        known = self.families()
        if family is not None and family not in known:
            raise ValueError(f"family must be one of {', '.join(known)}, got {family!r}")
        return [{"family": f, **e} for f in ([family] if family else known) for e in self.entries(f)]

    def match(self, family: str, **inputs) -> dict:
        """The first entry of ``family`` that holds for ``inputs`` (one value per match key)."""
        if set(inputs) != set(self.keys):
            raise TypeError(f"{self.what} lookups take {', '.join(self.keys)}, got {', '.join(inputs)}")
        for entry in self.entries(family):
            if holds(entry, inputs):
                return entry
        shown = ", ".join(f"{k} {v}" for k, v in inputs.items())
        raise NoConfigError(f"no {self.what} config for {shown} on {family}")

    def from_entry(self, entry: dict, **defaults):
        """The config an entry builds: its fields, ``defaults`` for fields it leaves out; match
        keys, notes and other keys are ignored."""
        names = [f.name for f in fields(self.cls)]
        return self.cls(**{**{k: v for k, v in defaults.items() if k in names},
                           **{k: entry[k] for k in names if k in entry}})

    def config(self, family: str, defaults: Optional[dict] = None, **inputs):
        """The shipped config of ``family`` for ``inputs``: :meth:`match`, then :meth:`from_entry`."""
        return self.from_entry(self.match(family, **inputs), **(defaults or {}))

    def problems(self) -> list[str]:
        """What is wrong with the table's entries: unknown keys, fields of the wrong type, notes
        that are not text; empty when every entry parses."""
        hints = typing.get_type_hints(self.cls)
        names = {f.name for f in fields(self.cls)}
        match = set(self.keys) | {f"{k}_max" for k in self.keys}
        out = []
        for family in self.families():
            t = table(self.name) if self.kind is None else table(self.name)[self.kind]
            for i, entry in enumerate(t[family]):
                where = f"{self.name}.json {self.kind + ' ' if self.kind else ''}{family}[{i}]"
                for key, value in entry.items():
                    if key == "_rejected":
                        if not (isinstance(value, dict) and all(isinstance(v, str) for v in value.values())):
                            out.append(f"{where}: _rejected must map each option to a reason")
                    elif key.startswith("_"):
                        if not isinstance(value, str):
                            out.append(f"{where}: note {key} must be text")
                    elif key in names:
                        if not _type_ok(value, hints[key]):
                            out.append(f"{where}: {key}={value!r} is not {hints[key]}")
                    elif key not in match:
                        out.append(f"{where}: unknown key {key!r} (fields: {', '.join(sorted(names))}; "
                                   f"match keys: {', '.join(sorted(match))})")
                for key in match & set(entry):
                    value = entry[key]
                    if value is not None and not isinstance(value, (int, str)):
                        out.append(f"{where}: match key {key}={value!r} must be a number, a bool, a name or null")
                try:
                    self.from_entry(entry, **dict(self.supplied))
                except (TypeError, ValueError) as e:
                    out.append(f"{where}: {e}")
        return out

    def check(self) -> None:
        """Raise ValueError listing :meth:`problems`, if any."""
        found = self.problems()
        if found:
            raise ValueError("config table problems:\n" + "\n".join(found))


@functools.lru_cache(maxsize=None)
def _checked(t: ConfigTable) -> dict:
    t.check()
    data = table(t.name) if t.kind is None else table(t.name)[t.kind]
    return {f: data[f] for f in t.families()}
