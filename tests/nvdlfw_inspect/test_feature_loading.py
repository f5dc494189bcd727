"""Loading feature directories: files, packages, nesting, errors, and loading again after end_debug."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from inspect_ns_factory import unique, write_namespace

import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.errors import FeatureLoadError
from nvdlfw_inspect.feature_loading import BUILTIN_FEATURE_DIR, load_feature_dirs, normalize_feature_dirs
from nvdlfw_inspect.registry import RegistrationWarning, Registry


def init(feature_dirs, log_dir, config=""):
    debug_api.initialize(config_file=config, feature_dirs=feature_dirs, log_dir=log_dir)


def features_of(namespace: str) -> dict[str, type]:
    return {name: type(obj) for name, obj in Registry.data[namespace].features.items()}


def config_for(ns, feature="FeatA", value=1) -> dict:
    return {"sec": {"enabled": True, "layers": {"layer_numbers": "all"}, ns.name: {feature: {"enabled": True, "value": value}}}}


# --------------------------------------------------------------------------------------------
# what gets loaded
# --------------------------------------------------------------------------------------------


def test_builtin_features_are_always_loaded(tmp_path, log_dir):
    ns = write_namespace(tmp_path / "features")
    init(None, log_dir)  # built-in modules are imported by now; only the new files run below
    debug_api.end_debug()
    init([ns.directory], log_dir)
    assert next(iter(Registry.data)) == "base"  # built-ins still come first
    assert "LogTensorStats" in Registry.data["base"].features
    assert set(features_of(ns.name)) == {"FeatA", "FeatB"}


def test_feature_file_importing_its_sibling_loads(tmp_path, log_dir):
    ns = write_namespace(tmp_path / "features")
    assert sorted(p.name for p in ns.directory.iterdir()) == [ns.feature_file.name, ns.api_file.name]  # feature first
    path_before = list(sys.path)
    init(ns.directory, log_dir, config_for(ns))
    assert sys.path == path_before
    assert ns.api_module not in sys.modules  # loaded under a private name only
    (api,) = [m for m in sys.modules.values() if getattr(m, "__file__", None) == str(ns.api_file)]
    mapper = api.Mapper
    assert issubclass(features_of(ns.name)["FeatA"], mapper)
    assert getattr(debug_api, ns.name).probe("model.1.fc1") == ("FeatA", "model.1.fc1", 1)


def test_nested_subdirectories_are_loaded(tmp_path, log_dir):
    root = tmp_path / "features"
    ns = write_namespace(root / "level1" / "level2", ("DeepFeat",))
    other = write_namespace(root / "level1b", ("SideFeat",))
    init(root, log_dir)
    assert set(features_of(ns.name)) == {"DeepFeat"}
    assert set(features_of(other.name)) == {"SideFeat"}


def test_pycache_and_non_python_files_are_skipped(tmp_path, log_dir):
    ns = write_namespace(tmp_path / "features")
    (ns.directory / "notes.txt").write_text("raise SystemExit\n")
    (ns.directory / "__pycache__").mkdir()
    (ns.directory / "__pycache__" / "stale.py").write_text("raise RuntimeError('must not run')\n")
    init(ns.directory, log_dir)
    assert set(features_of(ns.name)) == {"FeatA", "FeatB"}


def test_hidden_directories_are_skipped(tmp_path, log_dir):
    ns = write_namespace(tmp_path / "features")
    checkpoints = ns.directory / ".ipynb_checkpoints"
    checkpoints.mkdir()
    # a notebook checkpoint copy would otherwise define FeatA a second time
    (checkpoints / f"{ns.feature_module}-checkpoint.py").write_text(ns.feature_file.read_text())
    (checkpoints / "boom.py").write_text("raise RuntimeError('must not run')\n")
    init(ns.directory, log_dir)
    assert set(features_of(ns.name)) == {"FeatA", "FeatB"}


def test_hidden_parent_of_the_feature_dir_is_fine(tmp_path, log_dir):
    ns = write_namespace(tmp_path / ".config" / "features")
    init(ns.directory, log_dir)
    assert set(features_of(ns.name)) == {"FeatA", "FeatB"}


def test_several_directories(tmp_path, log_dir):
    one = write_namespace(tmp_path / "one", ("One",))
    two = write_namespace(tmp_path / "two", ("Two",))
    init([one.directory, two.directory], log_dir)
    assert set(features_of(one.name)) == {"One"}
    assert set(features_of(two.name)) == {"Two"}


def test_file_named_like_a_loaded_module_does_not_replace_it(tmp_path, log_dir):
    directory = tmp_path / "features"
    ns = write_namespace(directory)
    (directory / "json.py").write_text("LOADED_AS_FEATURE_FILE = True\n")
    init(directory, log_dir)
    assert sys.modules["json"] is json
    assert not hasattr(json, "LOADED_AS_FEATURE_FILE")
    assert set(features_of(ns.name)) == {"FeatA", "FeatB"}
    loaded = [m for m in sys.modules.values() if getattr(m, "__file__", None) == str(directory / "json.py")]
    assert len(loaded) == 1 and loaded[0].LOADED_AS_FEATURE_FILE is True


def test_two_dirs_defining_one_feature_name_in_a_namespace(tmp_path, log_dir):
    ns = write_namespace(tmp_path / "one", ("Dup",))
    clash = tmp_path / "two" / f"{unique('clash')}.py"
    clash.parent.mkdir()
    clash.write_text(
        f"from {ns.api_module} import Mapper\n"
        "from nvdlfw_inspect.registry import Registry\n\n\n"
        f"@Registry.register_feature(namespace={ns.name!r})\n"
        "class Dup(Mapper):\n"
        "    pass\n"
    )
    with pytest.warns(RegistrationWarning) as record:
        init([ns.directory, clash.parent], log_dir)
    message = str(record[0].message)
    assert len(record) == 1 and "feature 'Dup'" in message and str(ns.feature_file) in message and str(clash) in message
    assert sys.modules[features_of(ns.name)["Dup"].__module__].__file__ == str(ns.feature_file)  # the first one is kept


# --------------------------------------------------------------------------------------------
# feature_dirs argument
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["str", "path", "list", "tuple", "list_of_str"])
def test_feature_dirs_forms(tmp_path, log_dir, form):
    ns = write_namespace(tmp_path / "features")
    value = {
        "str": str(ns.directory),
        "path": ns.directory,
        "list": [ns.directory],
        "tuple": (ns.directory,),
        "list_of_str": [str(ns.directory)],
    }[form]
    init(value, log_dir)
    assert set(features_of(ns.name)) == {"FeatA", "FeatB"}


@pytest.mark.parametrize("value", [None, "", [], ()])
def test_no_feature_dirs_means_builtins_only(log_dir, value):
    assert normalize_feature_dirs(value) == []
    init(value, log_dir)
    assert list(Registry.data) == ["base"]


def test_normalize_resolves_relative_paths(tmp_path, monkeypatch):
    (tmp_path / "features").mkdir()
    monkeypatch.chdir(tmp_path)
    assert normalize_feature_dirs("features") == [(tmp_path / "features").resolve()]


@pytest.mark.parametrize("value", [42, {"dir": "x"}, {"x"}, b"bytes", 1.5])
def test_feature_dirs_of_wrong_type(log_dir, value):
    with pytest.raises(TypeError, match="feature_dirs must be a path or a list of paths"):
        init(value, log_dir)
    assert debug_api.DEBUG_MANAGER is None


def test_feature_dirs_entry_of_wrong_type(tmp_path, log_dir):
    with pytest.raises(TypeError, match="entries must be paths, got 5"):
        init([tmp_path, 5], log_dir)


def test_nonexistent_feature_dir(tmp_path, log_dir):
    missing = tmp_path / "does_not_exist"
    with pytest.raises(FeatureLoadError) as info:
        init([missing], log_dir)
    assert "feature directory not found" in str(info.value) and str(missing) in str(info.value)
    assert debug_api.DEBUG_MANAGER is None
    assert Registry.data == {}


def test_file_given_as_feature_dir(tmp_path, log_dir):
    ns = write_namespace(tmp_path / "features")
    with pytest.raises(FeatureLoadError, match="is not a directory") as info:
        init(ns.feature_file, log_dir)
    assert str(ns.feature_file) in str(info.value)


def test_empty_path_inside_a_list_is_an_error(tmp_path, log_dir, monkeypatch):
    # "" would otherwise mean the current directory, and every .py file below it would be executed
    monkeypatch.chdir(tmp_path)
    (tmp_path / "stray.py").write_text("raise RuntimeError('must not run')\n")
    with pytest.raises(FeatureLoadError, match="empty path"):
        init([""], log_dir)


# --------------------------------------------------------------------------------------------
# broken files
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("raise RuntimeError('broken on purpose')\n", "RuntimeError: broken on purpose"),
        ("def broken(:\n", "SyntaxError"),
        ("import module_that_does_not_exist_anywhere\n", "ModuleNotFoundError"),
        ("import sys\nsys.exit(3)\n", "SystemExit: 3"),
    ],
)
def test_file_failing_at_import(tmp_path, log_dir, source, expected):
    ns = write_namespace(tmp_path / "features")
    bad = ns.directory / f"{unique('bad')}.py"
    bad.write_text(source)
    with pytest.raises(FeatureLoadError) as info:
        init(ns.directory, log_dir)
    message = str(info.value)
    assert str(bad) in message and expected in message
    assert isinstance(info.value, ImportError)
    assert debug_api.DEBUG_MANAGER is None
    assert Registry.data == {}
    assert bad.stem not in sys.modules


def test_fixed_file_loads_after_a_failure(tmp_path, log_dir):
    ns = write_namespace(tmp_path / "features")
    source = ns.feature_file.read_text()
    ns.feature_file.write_text(source + "\nraise ValueError('not yet')\n")
    with pytest.raises(FeatureLoadError, match="not yet"):
        init(ns.directory, log_dir)
    ns.feature_file.write_text(source)
    init(ns.directory, log_dir)
    assert set(features_of(ns.name)) == {"FeatA", "FeatB"}


def test_failure_in_a_package_file(tmp_path, log_dir, monkeypatch):
    package = unique("pkg")
    directory = tmp_path / package
    write_namespace(directory, relative_import=True)
    (directory / "__init__.py").write_text("")
    (directory / "broken.py").write_text("raise KeyError('inside package')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(FeatureLoadError) as info:
        init(directory, log_dir)
    assert str(directory / "broken.py") in str(info.value) and "KeyError" in str(info.value)


# --------------------------------------------------------------------------------------------
# loading again after end_debug
# --------------------------------------------------------------------------------------------


def test_initialize_again_registers_features_without_executing_modules_twice(tmp_path, log_dir):
    marker = tmp_path / "executions.txt"
    ns = write_namespace(tmp_path / "features", marker=marker)
    init(ns.directory, log_dir, config_for(ns, value="first"))
    first_classes = features_of(ns.name)
    first_api = Registry.data[ns.name].api
    assert getattr(debug_api, ns.name).probe("m.1.x") == ("FeatA", "m.1.x", "first")
    debug_api.end_debug()
    assert Registry.data == {}

    init(ns.directory, log_dir, config_for(ns, "FeatB", value="second"))
    assert features_of(ns.name) == first_classes  # the very same classes, registered again
    assert Registry.data[ns.name].api is not first_api  # a fresh API object for the new run
    assert getattr(debug_api, ns.name).probe("m.1.x") == ("FeatB", "m.1.x", "second")
    debug_api.end_debug()

    init([ns.directory, ns.directory], log_dir)  # the same directory twice is harmless too
    assert marker.read_text() == "executed\n"


def test_load_feature_dirs_returns_tagged_classes_once(tmp_path):
    ns = write_namespace(tmp_path / "features")
    try:
        classes = load_feature_dirs([ns.directory, ns.directory])
    finally:
        Registry.reset()  # loading registered the classes outside initialize
    names = [c.__name__ for c in classes]
    assert names.count("FeatA") == 1 and names.count("FeatB") == 1
    assert "LogTensorStats" in names and "GenericFrameworkAPI" in names
    assert sum(name.startswith("Api_") for name in names) == 1
    assert "Mapper" not in names  # untagged classes are not collected


def test_builtin_dir_is_the_package_directory():
    assert BUILTIN_FEATURE_DIR == Path(debug_api.__file__).parent / "debug_features"


# --------------------------------------------------------------------------------------------
# importable packages
# --------------------------------------------------------------------------------------------


def test_importable_package_is_imported_by_dotted_name(tmp_path, log_dir, monkeypatch):
    package = unique("pkg")
    directory = tmp_path / package
    ns = write_namespace(directory, relative_import=True)
    (directory / "__init__.py").write_text("")
    (directory / "sub").mkdir()
    (directory / "sub" / "__init__.py").write_text("")
    (directory / "sub" / "extra.py").write_text(
        f"from ..{ns.api_module} import Mapper\n"
        "from nvdlfw_inspect.registry import Registry\n\n\n"
        f"@Registry.register_feature(namespace={ns.name!r})\n"
        "class SubFeat(Mapper):\n"
        "    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    init(directory, log_dir, config_for(ns))

    registered = features_of(ns.name)
    assert registered["FeatA"] is sys.modules[f"{package}.{ns.feature_module}"].FeatA
    assert registered["SubFeat"] is sys.modules[f"{package}.sub.extra"].SubFeat
    assert type(Registry.data[ns.name].api).__module__ == f"{package}.{ns.api_module}"
    assert ns.feature_module not in sys.modules  # not loaded a second time under its bare name
    # a normal import afterwards gives the same objects
    module = __import__(f"{package}.{ns.feature_module}", fromlist=["FeatA"])
    assert module.FeatA is registered["FeatA"]
    assert getattr(debug_api, ns.name).probe("m.1.x") == ("FeatA", "m.1.x", 1)


def test_directory_with_init_but_not_importable_is_loaded_file_by_file(tmp_path, log_dir):
    directory = tmp_path / unique("notonpath")
    ns = write_namespace(directory)
    (directory / "__init__.py").write_text("")
    init(directory, log_dir)
    assert set(features_of(ns.name)) == {"FeatA", "FeatB"}


def test_default_feature_dirs_load_at_every_initialize(tmp_path, log_dir):
    from nvdlfw_inspect.feature_loading import register_default_feature_dir

    ns = write_namespace(tmp_path / "features")
    register_default_feature_dir(ns.directory)
    register_default_feature_dir(ns.directory)  # once is enough
    init(None, log_dir, config_for(ns))
    assert set(features_of(ns.name)) == set(ns.features)
    debug_api.end_debug()
    init([ns.directory], log_dir, config_for(ns))  # also passed explicitly: loaded once
    assert set(features_of(ns.name)) == set(ns.features)
    with pytest.raises(FeatureLoadError, match="default feature directory not found"):
        register_default_feature_dir(tmp_path / "missing")
