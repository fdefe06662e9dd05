"""The C thread pool's source is a file shipped with the package (cpu_pool.c), found where the package is installed."""
import fnmatch
import pathlib
import tomllib
from fusegrad.device import Device
from fusegrad.runtime import cpu_pool

ROOT = pathlib.Path(__file__).resolve().parents[2]

def test_pool_source_is_read_from_the_package():
    assert cpu_pool.POOL_SOURCE_PATH.parent == pathlib.Path(cpu_pool.__file__).parent
    assert cpu_pool.POOL_SOURCE == cpu_pool.POOL_SOURCE_PATH.read_text()
    assert "fg_pool_submit" in cpu_pool.POOL_SOURCE and cpu_pool.CPool.QUEUE >= 1

def test_pool_source_is_package_data():
    # what a wheel ships besides Python modules: the pool's source must be among it, or an installed fusegrad has no
    # C pool (and a source checkout wouldn't notice)
    with open(ROOT / "pyproject.toml", "rb") as f: data = tomllib.load(f)["tool"]["setuptools"]["package-data"]
    assert any(fnmatch.fnmatch(cpu_pool.POOL_SOURCE_PATH.name, g) for g in data.get("fusegrad.runtime", []))

def test_pool_binary_is_cached_by_its_source():
    compiler = Device["CPU"].compiler
    assert compiler.cache_path(cpu_pool.POOL_SOURCE) != compiler.cache_path(cpu_pool.POOL_SOURCE + "\n")
