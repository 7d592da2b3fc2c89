"""Map the repository folders onto the `mariana.*` namespace.

`platform/` has no `__init__.py` (a top-level package named `platform` would shadow the standard library
module torch imports), so `mariana.platform` is a namespace package and its subfolders are ordinary packages.
"""

from setuptools import find_packages, setup

FOLDERS = {"mariana.platform": "platform", "mariana.apps": "apps", "mariana.serving": "serving"}

packages, package_dir = [], {}
for prefix, folder in FOLDERS.items():
    package_dir[prefix] = folder
    packages.append(prefix)
    packages += [f"{prefix}.{sub}" for sub in find_packages(folder)]

# The job service's web pages (HTML/CSS/JS, no build step) ship inside the package.
package_data = {
    "mariana.platform.jobs": ["static/*"],
    # the CPU step's C loops, built at first use (`mariana.platform.ps.cpu_rows`)
    "mariana.platform.ps": ["*.c"],
    # `mariana tune` search spaces users start from.
    **{f"mariana.apps.{app}": ["spaces/*.toml"] for app in find_packages("apps") if "." not in app},
}

setup(packages=packages, package_dir=package_dir, package_data=package_data)
