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
