"""How the binding finds libdsv4.so (dsv4._lib.find) and what dsv4.library_path() reports.

The search tests use temporary directories and never load what they find.
"""

import os
import re
from pathlib import Path

import pytest

import dsv4
from dsv4 import _lib

CHECKOUT = Path(__file__).resolve().parents[3]


def touch(p: Path) -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"")
    return p


@pytest.mark.skipif(not os.environ.get("DSV4_LIBRARY"), reason="DSV4_LIBRARY not set")
def test_library_path_reports_dsv4_library():
    loc = dsv4.library_path()
    assert loc == (os.path.abspath(os.environ["DSV4_LIBRARY"]), "DSV4_LIBRARY")
    path, how = loc
    assert how == "DSV4_LIBRARY" and os.fspath(loc) == path
    assert "how='DSV4_LIBRARY'" in str(loc)  # print() shows how it was found
    assert Path(loc).is_file()


def test_dsv4_library_comes_first(tmp_path):
    lib = touch(tmp_path / "custom" / "libdsv4.so")
    pkg = tmp_path / "site-packages" / "dsv4"
    touch(pkg / "libdsv4.so")
    found = _lib.find(env={"DSV4_LIBRARY": str(lib)}, here=pkg)
    assert found == _lib.LibraryPath(str(lib), "DSV4_LIBRARY")
    # Without it, the copy inside the package directory.
    assert _lib.find(env={}, here=pkg) == (str(pkg / "libdsv4.so"), "package")


def test_dsv4_library_that_is_not_a_file_is_an_error(tmp_path):
    with pytest.raises(dsv4.IoError, match="DSV4_LIBRARY=.* is not a file"):
        _lib.find(env={"DSV4_LIBRARY": str(tmp_path / "missing.so")}, here=tmp_path)


def test_checkout_found_by_walking_up(tmp_path):
    root = tmp_path / "checkout"
    touch(root / "Cargo.toml")
    touch(root / "include" / "dsv4.h")
    lib = touch(root / "target" / "release" / "libdsv4.so")
    pkg = root / "bindings" / "python" / "dsv4"
    pkg.mkdir(parents=True)
    assert _lib.find_checkout(pkg) == root
    assert _lib.find(env={}, here=pkg) == (str(lib), "checkout")
    target = tmp_path / "elsewhere"
    other = touch(target / "debug" / "libdsv4.so")
    assert _lib.find(env={"CARGO_TARGET_DIR": str(target)}, here=pkg) == (str(other), "CARGO_TARGET_DIR")
    # This source tree is such a checkout.
    assert _lib.find_checkout(Path(_lib.__file__).resolve().parent) == CHECKOUT


def test_not_found_names_every_place(tmp_path):
    pkg = tmp_path / "site-packages" / "dsv4"  # installed elsewhere: no checkout above
    pkg.mkdir(parents=True)
    env = {"CARGO_TARGET_DIR": str(tmp_path / "t")}
    with pytest.raises(dsv4.IoError) as e:
        _lib.find(env=env, here=pkg)
    msg = e.value.message
    cands = _lib.candidates(env, pkg)
    assert [how for _, how in cands] == ["package", "CARGO_TARGET_DIR", "CARGO_TARGET_DIR"]
    for path, how in cands:
        assert f"\n  {path} ({how})" in msg
    assert "(not set: DSV4_LIBRARY)" in msg
    assert f"(no dsv4 checkout at or above {pkg})" in msg
    assert "DSV4_LIBRARY" in msg.splitlines()[-1]


def test_package_version_matches_the_crate():
    tomllib = pytest.importorskip("tomllib")
    crate = tomllib.loads((CHECKOUT / "Cargo.toml").read_text())["package"]["version"]
    pyproject = tomllib.loads((CHECKOUT / "bindings" / "python" / "pyproject.toml").read_text())
    assert pyproject["project"]["version"] == crate
    assert re.fullmatch(r"\d+\.\d+\.\d+", crate)
