"""Map the repository folders onto the `mariana.*` namespace.

`platform/` has no `__init__.py` (a top-level package named `platform` would shadow the standard library
module torch imports), so `mariana.platform` is a namespace package and its subfolders are ordinary packages.
"""

import ast
import hashlib
import re
from pathlib import Path

from setuptools import Extension, find_packages, setup

FOLDERS = {"mariana.platform": "platform", "mariana.apps": "apps", "mariana.serving": "serving"}

packages, package_dir = [], {}
for prefix, folder in FOLDERS.items():
    package_dir[prefix] = folder
    packages.append(prefix)
    packages += [f"{prefix}.{sub}" for sub in find_packages(folder)]

# The job service's web pages (HTML/CSS/JS, no build step) ship inside the package.
package_data = {
    "mariana.platform.jobs": ["static/*"],
    # the CPU step's C loops, built at first use (`mariana.platform.sparse.kernels`)
    "mariana.platform.sparse": ["*.c"],
    # `mariana tune` search spaces users start from.
    **{f"mariana.apps.{app}": ["spaces/*.toml"] for app in find_packages("apps") if "." not in app},
}

# The CPU step's C loops (`mariana.platform.sparse.kernels`): a plain C library (no Python API: loaded with
# ctypes), built here with kernels.py's portable FLAGS and the identity of rows.c's text, which kernels.py
# checks at load. Optional: without a C compiler the install succeeds and the step keeps its torch ops.
ROWS = Path("platform/sparse/rows.c")
FLAGS = re.search(r"^FLAGS = (\[.*\])$", Path("platform/sparse/kernels.py").read_text(), re.M).group(1)
rows_ext = Extension(
    "mariana.platform.sparse._rows",
    [str(ROWS)],
    define_macros=[("MARIANA_ROWS_SOURCE", f'"{hashlib.sha256(ROWS.read_bytes()).hexdigest()[:16]}"')],
    extra_compile_args=ast.literal_eval(FLAGS),  # read, not imported: setup.py runs without torch
    libraries=["m"],
    optional=True,
)

setup(packages=packages, package_dir=package_dir, package_data=package_data, ext_modules=[rows_ext])
