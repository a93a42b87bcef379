"""Where the ``prefixserve.*`` packages live: the design's top-level folders, mapped by setuptools."""

from setuptools import find_namespace_packages, setup

FOLDERS = {"common": "common", "kernels": "kernels", "replica": "replica", "router": "router", "loadtest": "loadtest"}

package_dir = {"prefixserve": "src/prefixserve"}
packages = ["prefixserve"]
for name, folder in FOLDERS.items():
    package_dir[f"prefixserve.{name}"] = folder
    packages.append(f"prefixserve.{name}")
    for sub in find_namespace_packages(where=folder, exclude=["*__pycache__*"]):
        packages.append(f"prefixserve.{name}.{sub}")

setup(package_dir=package_dir, packages=packages)
