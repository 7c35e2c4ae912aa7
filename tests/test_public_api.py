import types

import trainstate


def test_all_is_sorted_and_complete():
    public = {
        name
        for name in dir(trainstate)
        if not name.startswith("_")
        and not isinstance(getattr(trainstate, name), types.ModuleType)
        and name != "annotations"
    }
    assert trainstate.__all__ == sorted(trainstate.__all__)
    assert set(trainstate.__all__) - {"__version__"} == public


def test_error_tree():
    assert issubclass(trainstate.CheckpointNotFoundError, FileNotFoundError)
    # A newer writer's checkpoint is not damage: code that skips damaged checkpoints must not skip it.
    assert not issubclass(trainstate.FormatVersionError, trainstate.CorruptCheckpointError)
    assert issubclass(trainstate.InvalidArgumentError, ValueError)
    assert issubclass(trainstate.InvalidArgumentError, TypeError)
    assert issubclass(trainstate.MissingDependencyError, ImportError)
    for name in trainstate.__all__:
        obj = getattr(trainstate, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, trainstate.CheckpointError)


def test_internal_modules_are_private():
    import pkgutil

    found = {m.name for m in pkgutil.iter_modules(trainstate.__path__)}
    public = {"errors", "__main__", "integrations"}  # integrations: one public module per framework
    assert found - public, found
    assert all(name.startswith("_") for name in found - public), sorted(found)
    # `trainstate.save` is the function, never shadowed by a submodule of the same name
    assert callable(trainstate.save) and not isinstance(trainstate.save, types.ModuleType)
    assert not isinstance(trainstate.load, types.ModuleType)
    assert callable(trainstate.consolidate) and not isinstance(trainstate.consolidate, types.ModuleType)


def test_backends_and_policies_are_public():
    assert issubclass(trainstate.LocalStorage, trainstate.Storage)
    assert issubclass(trainstate.FsspecStorage, trainstate.Storage)
    assert trainstate.KeepLast(3) == trainstate.KeepLast(3)
