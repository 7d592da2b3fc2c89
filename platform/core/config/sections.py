"""Sections and the configs composed of them (the package docstring says how an app declares them).

A `Section` has a ``NAME`` (TOML table, attribute on a config), a ``TITLE`` (``--help`` group) and a
``validate()`` of its own fields; a `Config` subclass's fields are the union of its sections' fields,
whose names are checked unique here, at definition time. Standard library only.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, ClassVar

from .fields import VALIDATES, Clause

MAX_FIELDS = 30  # a section holds at most this many fields (issue 31: a reader can hold one section)


class Section:
    """Base of the typed sections. Subclasses are ``@dataclass`` with ``NAME`` and ``TITLE`` and may set
    ``APPLIES`` (clauses that hold for every field of the section but the ones they read) and override
    `validate` (checks of the section's own fields; raise `MarianaError` naming the flag)."""

    NAME: ClassVar[str] = ""
    TITLE: ClassVar[str] = ""
    APPLIES: ClassVar[tuple[Clause, ...]] = ()

    def validate(self) -> None:
        """Checks of this section's own values; nothing by default."""


class Config:
    """Base of a command's config: ``class X(Config, sections=(RunSection, ...))`` composes the sections.

    Class attributes a composition may set: ``EVAL_METRICS`` (what its evaluation reports, checked against
    ``--monitor``), ``RESUME_MAY_CHANGE`` (fields a ``--resume`` may change), ``VALIDATION`` (the clauses
    of having validation data, for fields declared ``applies=VALIDATES``), and plain ``ClassVar``
    constants for values the command fixes (readable as ``cfg.name`` by shared code, but neither flags nor
    TOML keys). Instances answer ``cfg.<section name>`` with that section's typed dataclass (a copy)."""

    SECTIONS: ClassVar[tuple[type[Section], ...]] = ()
    EVAL_METRICS: ClassVar[tuple[str, ...]] = ()
    RESUME_MAY_CHANGE: ClassVar[frozenset[str]] = frozenset()
    VALIDATION: ClassVar[tuple[Clause, ...]] = ()
    # field name -> its section's NAME, and field name -> its clauses (field's own + its section's)
    SECTION_OF: ClassVar[dict[str, str]] = {}
    CLAUSES: ClassVar[dict[str, tuple[Clause, ...]]] = {}

    def __init_subclass__(cls, sections: tuple[type[Section], ...] | None = None, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if sections is None:  # e.g. a subclass widening RESUME_MAY_CHANGE: the parent's fields stay
            return
        if any(getattr(b, "SECTIONS", ()) for b in cls.__mro__[1:]):
            raise TypeError(f"{cls.__name__}: compose from Config (with mixins), not from a composed config")
        _compose(cls, tuple(sections))

    def section(self, name: str) -> Section:
        """The section ``name`` of this config as its typed dataclass (a copy: write with `replace`)."""
        for s in type(self).SECTIONS:
            if s.NAME == name:
                return s(**{f.name: getattr(self, f.name) for f in dataclasses.fields(s)})
        raise KeyError(name)

    def applies(self, name: str) -> bool:
        """Whether field ``name`` is used under this config's values (all its clauses hold)."""
        return all(c.test(self) for c in type(self).CLAUSES.get(name, ()))

    def validate(self) -> None:
        """Every section's own `validate`, then `check` (the composition's cross-section checks)."""
        for s in type(self).SECTIONS:
            self.section(s.NAME).validate()
        self.check()

    def check(self) -> None:
        """Cross-section checks of the composition; nothing by default (a composition overrides it)."""


def _compose(cls: type, sections: tuple[type[Section], ...]) -> None:
    """Make ``cls`` the dataclass of ``sections``' fields; assert the composition rules."""
    names = [s.NAME for s in sections]
    assert all(names) and len(set(names)) == len(names), f"{cls.__name__}: sections need distinct NAMEs"
    own = dict(cls.__dict__.get("__annotations__", {}))
    annotations: dict[str, Any] = {}
    section_of: dict[str, str] = {}
    clauses: dict[str, tuple[Clause, ...]] = {}
    for s in sections:
        fs = dataclasses.fields(s)
        assert len(fs) <= MAX_FIELDS, f"section {s.NAME} has {len(fs)} fields (at most {MAX_FIELDS})"
        hints = typing.get_type_hints(s)
        for f in fs:
            assert f.name not in section_of, (
                f"{cls.__name__}: field {f.name!r} is in sections {section_of[f.name]} and {s.NAME}"
            )
            assert f.name not in names, f"{cls.__name__}: field {f.name!r} is also a section name"
            assert f.name not in own, f"{cls.__name__}: {f.name!r} is declared by a section; drop it here"
            section_of[f.name] = s.NAME
            annotations[f.name] = hints[f.name]
            field_clauses = tuple(f.metadata.get("applies", ()))
            field_clauses += tuple(c for c in s.APPLIES if c.field != f.name)
            expand = {id(VALIDATES): cls.VALIDATION}  # what "has validation data" means in this composition
            field_clauses = tuple(v for c in field_clauses for v in expand.get(id(c), (c,)))
            clauses[f.name] = field_clauses
            meta = {**f.metadata, "section": s.NAME}
            if f.default is not dataclasses.MISSING:
                setattr(cls, f.name, dataclasses.field(default=f.default, metadata=meta))
            else:
                setattr(cls, f.name, dataclasses.field(default_factory=f.default_factory, metadata=meta))
    for name, cs in clauses.items():
        for c in cs:
            assert c.field in section_of or hasattr(cls, c.field), (
                f"{cls.__name__}: --{name} depends on {c.field!r}, which the composition lacks"
            )
    for s in sections:
        setattr(cls, s.NAME, property(lambda self, n=s.NAME: self.section(n), doc=s.TITLE))
    cls.__annotations__ = {**annotations, **own}
    cls.SECTIONS, cls.SECTION_OF, cls.CLAUSES = sections, section_of, clauses
    dataclasses.dataclass(cls)
