"""Typed job configs composed of sections: flags, TOML files, presets and the inert-flag rule (what a user
sees: ``platform/README.md``, "Configuration").

A command's config is composed of exactly the sections it uses; each section is a small typed dataclass
(at most 30 fields) that validates its own values. The composition is one dataclass whose fields are the
union of its sections' fields (names unique in a composition, asserted when the class is defined), so
code reads ``cfg.lr`` or ``cfg.optim.lr`` (the section as its typed dataclass), and ``Cls(lr=...)``,
``dataclasses.replace(cfg, lr=...)`` and ``dataclasses.fields(cfg)`` work on the flat names. A value the
user set explicitly where its field does not apply is refused (exit 2).

How an app declares its sections (an example): platform/README.md, "Configuration".

Conditions (``opt(..., applies=...)`` or a section's ``APPLIES``): `only` (field in values), `not_with`,
`at_least` (a number >= n), `given` (a non-empty value), `when` (any test; ``layout=True``: a look into a
data folder); each names a field of the composition, asserted at definition time. ``VALIDATES`` stands for
the composition's ``VALIDATION`` (when it has validation data). A value the command fixes (neither flag
nor TOML key) is a ``ClassVar`` of the composition (e.g. a stream's ``epochs: ClassVar[int] = 1``).
Presets are instances of the composition. The CLI side: `add_config_args` (flag groups), `resolve_config`
(defaults < preset < --config < flags, then `check_applies` and ``validate()``).
"""

from .fields import (
    VALIDATES,
    _base_type,
    at_least,
    check_choice,
    coerce,
    flag,
    given,
    not_with,
    only,
    opt,
    when,
)
from .files import load_toml, read_config_values, save_config, sectioned_toml
from .resolve import add_config_args, applicable_values, resolve_config, saved_run_values
from .sections import MAX_FIELDS, Config, Section
from .train import (
    RESUME_MAY_CHANGE,
    WITHOUT_MAX_STEPS,
    DataParallelSection,
    DataSection,
    LaunchSection,
    LoopSection,
    OptimSection,
    RunSection,
    TrainConfig,
    TrainJob,
    at_least_one,
    finite_non_negative,
    non_negative,
)
