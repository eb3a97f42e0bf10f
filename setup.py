"""Ships csrc/ inside the package, so an installed (non-editable) punica_hf can JIT-compile its kernels."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithKernelSources(build_py):
    def run(self):
        super().run()
        source = Path(__file__).parent / "csrc"
        target = Path(self.build_lib) / "punica_hf" / "csrc"
        if source.is_dir():
            shutil.copytree(source, target, dirs_exist_ok=True)


setup(cmdclass={"build_py": BuildPyWithKernelSources})
