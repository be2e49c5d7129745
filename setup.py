"""Ships the C++ CPU kernel's source inside the wheel, as ``gefen_dist/_csrc/``.

Why a hook: the source lives in the top-level ``csrc/`` (the project's C++ directory, with its
own README), outside the package, so a plain wheel left it behind
and an installed Gefen fell back to numba. ``native_cpu`` builds the copy on first use; a
checkout or an editable install reads ``csrc/`` itself, so nothing is copied there.
Everything else is in ``pyproject.toml``.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CSRC = Path(__file__).resolve().parent / "csrc"
CPU_SOURCES = ("gefen_cpu.cpp",)
"""What ``native_cpu`` compiles: the one file, which includes only system headers."""
PACKAGED = Path("gefen_dist", "_csrc")


class BuildPyWithCsrc(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:  # the package reads csrc/ itself there
            return
        dest = Path(self.build_lib, PACKAGED)
        self.mkpath(str(dest))
        for name in CPU_SOURCES:
            self.copy_file(str(CSRC / name), str(dest / name))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        out = super().get_outputs(include_bytecode)
        if self.editable_mode:
            return out
        return [*out, *(str(Path(self.build_lib, PACKAGED, n)) for n in CPU_SOURCES)]


setup(cmdclass={"build_py": BuildPyWithCsrc})
