"""Settings declared by the part that reads them.

A part of a run that has settings (the run's core, a training mode, a ZeRO stage, the
gradient buckets, ...) declares them as the fields of one small dataclass next to its
code, each field made by ``setting``: its default, its flag, what it means, the values it
takes, and whether it makes the run this run (``identity``). A part that contains other
parts says so with ``part`` (always there: the sync mode's buckets) or ``choice`` (one of
a registry, chosen by a setting: ``--mode`` chooses the mode's part, ``--zero`` the
stage's). The tree of a run's chosen parts is its configuration.

From the declarations come, with nothing written twice:
- ``build``: settings given by name (``zero=2``, ``bucket_mb=5``, the words of the flags)
  routed to the chosen part that declares them. A name no chosen part declares is
  refused, naming the flag and the parts that read it: a setting is honoured or refused,
  never ignored, whatever a job's defaults held (a new choice starts from its own
  defaults, so another mode's settings do not travel with it);
- ``arguments``: the ``elastic-dp train`` flags (``cli``);
- ``api_names``: each flag's name in the Python API, for errors (``errors.API_NAMES``);
- ``identity``: the settings that make a run this run (``config.run_settings``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from elastic_dp.errors import ConfigError

OMIT = object()
"""What an ``identity`` rule returns for a setting that, as set, does not name the run."""


@dataclass(frozen=True, slots=True)
class Declared:
    """One setting's declaration (the metadata of its field)."""

    flag: str | None
    """The flag that sets it (a value flag, or ``store_true`` for a boolean)."""
    off: str | None
    """A boolean's flag that sets it False (``--no-reduce-fp32``)."""
    help: str
    kind: Callable[[str], Any] | None
    choices: tuple | None
    const: Any
    """With a value: the flag's value when it is given alone (``--resume``)."""
    metavar: str | None
    identity: Any
    """None: not part of the run's identity; True: always; else ``rule(value, train) -> value | OMIT``."""


@dataclass(frozen=True, slots=True)
class Choice:
    """A part chosen from ``registry`` by the setting of the field's name."""

    registry: dict
    default: Any
    declared: Declared


def setting(default: Any, flag: str | None = None, help: str = "", *, off: str | None = None,
            kind: Callable[[str], Any] | None = None, choices: tuple | None = None, const: Any = None,
            metavar: str | None = None, identity: Any = None) -> Any:
    """A field that is a setting (see the module's docstring)."""
    if kind is None and flag is not None and off is None and not isinstance(default, bool):
        kind = type(default) if default is not None else str
    declared = Declared(flag, off, help, kind, choices, const, metavar, identity)
    return dataclasses.field(default=default, metadata={"setting": declared})


def part(cls: type) -> Any:
    """A field that is a part always present (its settings are declared by ``cls``)."""
    return dataclasses.field(default_factory=cls, metadata={"part": cls})


def choice(registry: dict, default: Any, flag: str, help: str, *, kind: Callable[[str], Any] = str,
           identity: Any = None) -> Any:
    """A field that is a part chosen from ``registry`` (key -> part class) by this setting."""
    declared = Declared(flag, None, help, kind, tuple(registry), None, None, identity)
    return dataclasses.field(default_factory=registry[default],
                             metadata={"choice": Choice(registry, default, declared)})


def _fields(cls: type) -> Iterator[tuple[dataclasses.Field, Declared | None, Choice | None, type | None]]:
    for f in dataclasses.fields(cls):
        yield f, f.metadata.get("setting"), f.metadata.get("choice"), f.metadata.get("part")


def key_of(registry: dict, section: Any) -> Any:
    """The registry key a chosen part was chosen by."""
    return next(k for k, cls in registry.items() if type(section) is cls)


def build(cls: type, given: dict[str, Any], base: Any = None) -> dict[str, Any]:
    """The field values of part ``cls``, its own and its parts' settings taken (popped) from
    ``given``, the rest from ``base`` (a ``cls`` to change) or the declared defaults."""
    values = {}
    for f, declared, chosen, fixed in _fields(cls):
        old = getattr(base, f.name) if base is not None else None
        if chosen is not None:
            key = given.pop(f.name, dataclasses.MISSING)
            if key is dataclasses.MISSING:
                sub, sub_base = (type(old), old) if old is not None else (chosen.registry[chosen.default], None)
            elif type(key) in chosen.registry.values():
                sub, sub_base = type(key), key
            else:
                if key not in chosen.registry:
                    raise ConfigError(f"{f.name} must be one of {', '.join(map(str, chosen.registry))}, got {key!r} "
                                      f"({chosen.declared.flag})")
                sub = chosen.registry[key]
                sub_base = old if type(old) is sub else None
            values[f.name] = sub(**build(sub, given, sub_base))
        elif fixed is not None:
            sub_base = given.pop(f.name, old)
            values[f.name] = fixed(**build(fixed, given, sub_base))
        elif f.name in given:
            values[f.name] = value = given.pop(f.name)
            if declared is not None and declared.choices and value not in declared.choices:
                raise ConfigError(f"{f.name} must be one of {', '.join(map(str, declared.choices))}, got {value!r} "
                                  f"({declared.flag})")
        elif base is not None:
            values[f.name] = old
        elif f.default is not dataclasses.MISSING:
            values[f.name] = f.default
    return values


def refuse_unplaced(root: Any, given: dict[str, Any]) -> None:
    """Refuse the settings ``build`` left in ``given``: no part of ``root``'s run reads them."""
    for name in given:
        readers = [when for when, cls in _parts(type(root)) if name in {f.name for f in dataclasses.fields(cls)}]
        if not readers:
            raise ConfigError(f"{type(root).__name__} has no setting {name!r}: the settings are the flags of "
                              "elastic-dp train (README), by their names")
        flag = _flag_of(type(root), name)
        raise ConfigError(f"{flag} is read only with {_one_of(readers)}, and this run is {describe(root)}: drop "
                          f"{flag}, or run with {readers[0]}")


def _one_of(whens: list[str]) -> str:
    """``["--mode sync --zero 1", "--mode sync --zero 2", "--mode async"]`` read as
    "--mode sync --zero 1 or 2, or --mode async"."""
    groups: dict[str, list[str]] = {}
    for when in whens:
        prefix, _, key = when.rpartition(" ")
        groups.setdefault(prefix, []).append(key)
    said = [f"{prefix} {', '.join(keys[:-1])} or {keys[-1]}" if len(keys) > 1 else f"{prefix} {keys[0]}"
            for prefix, keys in groups.items()]
    return ", or ".join(said)


def _parts(cls: type, when: str = "") -> Iterator[tuple[str, type]]:
    """Every part class reachable from ``cls``, with the flags that choose it."""
    yield when or "any settings", cls
    for f, _, chosen, fixed in _fields(cls):
        if fixed is not None:
            yield from _parts(fixed, when)
        if chosen is not None:
            for key, sub in chosen.registry.items():
                yield from _parts(sub, f"{when} {chosen.declared.flag} {key}".strip())


def parts_of(section: Any) -> list[Any]:
    """``section`` and every chosen part under it (a run's mode, its stage, its buckets)."""
    out = [section]
    for f, _, chosen, fixed in _fields(type(section)):
        if chosen is not None or fixed is not None:
            out += parts_of(getattr(section, f.name))
    return out


def describe(section: Any) -> str:
    """The choices that made ``section``'s tree of parts, in flags (``--mode sync --zero 0``)."""
    words = []
    for f, _, chosen, fixed in _fields(type(section)):
        if chosen is not None:
            sub = getattr(section, f.name)
            words += [f"{chosen.declared.flag} {key_of(chosen.registry, sub)}", describe(sub)]
        elif fixed is not None:
            words.append(describe(getattr(section, f.name)))
    return " ".join(w for w in words if w)


def declarations(cls: type) -> dict[str, Declared]:
    """Every setting of ``cls``'s tree of parts, by name, first declaration first (a name
    several parts declare, such as ``snapshot_every``, has one flag, whose help says what
    each part does with it)."""
    out: dict[str, Declared] = {}
    for _, part_cls in _parts(cls):
        for f, declared, chosen, _ in _fields(part_cls):
            declared = declared or (chosen.declared if chosen else None)
            if declared is None:
                continue
            if f.name not in out:
                out[f.name] = declared
            elif declared.help not in out[f.name].help:  # another part's meaning of the same flag
                out[f.name] = dataclasses.replace(out[f.name], help=f"{out[f.name].help}; {declared.help}")
    return out


def _flag_of(cls: type, name: str) -> str:
    declared = declarations(cls)[name]
    return declared.flag or declared.off


def walk(section: Any) -> Iterator[tuple[str, Any, Declared]]:
    """Each setting of a configuration's chosen parts: (name, value, declaration)."""
    for f, declared, chosen, fixed in _fields(type(section)):
        value = getattr(section, f.name)
        if chosen is not None:
            yield f.name, key_of(chosen.registry, value), chosen.declared
            yield from walk(value)
        elif fixed is not None:
            yield from walk(value)
        elif declared is not None:
            yield f.name, value, declared


def identity(root: Any) -> dict[str, Any]:
    """The settings of ``root``'s chosen parts that make the run this run, by name."""
    out = {}
    for name, value, declared in walk(root):
        rule = declared.identity
        if rule is True:
            out[name] = value
        elif rule is not None and (kept := rule(value, root)) is not OMIT:
            out[name] = kept
    return out


def arguments(parser: argparse.ArgumentParser, cls: type) -> list[str]:
    """Add a flag for every setting of ``cls``'s tree to ``parser`` (absent: None, so that a
    job's defaults apply); returns the settings' names (each flag's ``dest``)."""
    for name, d in declarations(cls).items():
        if d.kind is not None:
            parser.add_argument(d.flag, dest=name, type=d.kind, choices=d.choices, default=None, help=d.help,
                                metavar=d.metavar, **({"nargs": "?", "const": d.const} if d.const is not None else {}))
            continue
        if d.flag is not None:
            parser.add_argument(d.flag, dest=name, action="store_true", default=None, help=d.help)
        if d.off is not None:
            parser.add_argument(d.off, dest=name, action="store_false", default=None,
                                help=None if d.flag else d.help)
    return list(declarations(cls))


def api_names(cls: type) -> dict[str, str]:
    """Each flag of ``cls``'s settings -> its name in the Python API (``TrainConfig.zero``,
    ``TrainConfig(reduce_fp32=False)``)."""
    out = {}
    for name, d in declarations(cls).items():
        if d.flag is not None:
            out[d.flag] = f"{cls.__name__}.{name}" if d.kind is not None else f"{cls.__name__}({name}=True)"
        if d.off is not None:
            out[d.off] = f"{cls.__name__}({name}=False)"
    return out


def implementation(path: str) -> Any:
    """What a part names as its code, ``"package.module:Name"`` (a mode's driver and
    program, a stage's strategy): imported when a run first needs it, so that a part's
    settings can be read, checked and shown without importing torch, Ray or its code."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
