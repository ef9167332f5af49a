"""The wheel: loaders/ and trainer/ ship as geoshard.loaders and geoshard.trainer, nothing
generic lands at the top of site-packages, and the CLI runs from a fresh venv."""

from __future__ import annotations

import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = dist.glob("geoshard-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"geoshard", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}, tops
    assert "geoshard/loaders/__init__.py" in names and "geoshard/trainer/__init__.py" in names and "geoshard/py.typed" in names

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    # Runtime imports of the CLI and the two subpackages; the heavy deps (torch, dask) are not
    # needed to import them, which is also what training images rely on.
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True, capture_output=True, timeout=300)
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "click", "google-crc32c", "numpy", "rich", "xxhash"],
        check=True,
        capture_output=True,
        timeout=600,
    )
    code = "import geoshard.loaders, geoshard.trainer, geoshard; print(geoshard.loaders.__file__)"
    out = subprocess.run([str(py), "-c", code], check=True, capture_output=True, text=True, timeout=60, cwd=tmp_path).stdout
    assert str(env_dir) in out and "site-packages/geoshard/loaders/__init__.py" in out
    help_text = subprocess.run(
        [str(env_dir / "bin" / "geoshard"), "--help"], check=True, capture_output=True, text=True, timeout=60, cwd=tmp_path
    ).stdout
    for command in ("split", "verify", "inspect", "synth"):
        assert command in help_text
    # No generic top-level package was installed.
    site = next((env_dir / "lib").glob("python3.*/site-packages"))
    assert not (site / "loaders").exists() and not (site / "trainer").exists()


def test_every_package_folder_is_listed_for_the_wheel() -> None:
    """A folder with an __init__.py that pyproject.toml does not list would be left out of the wheel
    while the editable install (which maps folders) still imported it."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    roots = {"geoshard": ROOT / "geoshard", "geoshard.loaders": ROOT / "loaders", "geoshard.trainer": ROOT / "trainer"}
    found = set()
    for name, folder in roots.items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder).parts
            found.add(".".join((name, *rel)))
    found = {p for p in found if not any(part == "__pycache__" for part in p.split("."))}
    assert found == listed, (sorted(found - listed), sorted(listed - found))


def test_a_new_module_imports_at_once_from_the_repository_root(tmp_path: Path) -> None:
    """The folder tree is the import tree: a file added to loaders/ imports as geoshard.loaders.X with no
    reinstall, from the repository root too (where the geoshard/ source folder is on sys.path)."""
    probe = ROOT / "loaders" / f"_probe_{tmp_path.name.replace('-', '_')}.py"
    probe.write_text("VALUE = 42\n")
    try:
        code = f"import geoshard.loaders.{probe.stem} as m, geoshard.trainer, geoshard.cli; print(m.VALUE, m.__file__)"
        for cwd in (ROOT, tmp_path):
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=cwd)
            assert out.returncode == 0, out.stderr
            assert out.stdout.split() == ["42", str(probe)]
    finally:
        probe.unlink()


def test_every_import_the_docs_show_works() -> None:
    """README.md and docs/ show ``from geoshard.X import Y`` lines; each works after the layout moves."""
    import importlib
    import re

    shown = set()
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in re.finditer(r"from (geoshard(?:\.\w+)*) import ([\w, ]+)", doc.read_text()):
            shown |= {(m.group(1), name.strip(), doc.name) for name in m.group(2).split(",") if name.strip()}
    assert len(shown) >= 8, shown
    for module, name, doc in sorted(shown):
        assert hasattr(importlib.import_module(module), name), f"{doc}: from {module} import {name}"
