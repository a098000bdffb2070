"""Package layout (DESIGN.md): operator/ and runtime/ are top-level folders that import as
kuberl.operator and kuberl.runtime, so nothing importable shadows the standard library's `operator`."""
from setuptools import find_packages, setup

FOLDERS = {"kuberl": "kuberl", "kuberl.operator": "operator", "kuberl.runtime": "runtime"}
packages = []
for package, folder in FOLDERS.items():
    packages.append(package)
    packages += [f"{package}.{sub}" for sub in find_packages(folder)]
setup(packages=packages, package_dir=FOLDERS)
