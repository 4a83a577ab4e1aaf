"""Loading the op library: version range, library discovery, importing too late."""

import pytest

from capuchin_tf.tf import loader


@pytest.mark.parametrize("version", ["2.21.0", "2.21.7", "2.21.0rc1"])
def test_supported_versions_pass(version):
    loader.check_tensorflow_version(version)


@pytest.mark.parametrize("version", ["2.20.1", "2.22.0", "3.0.0", "1.15.0", "garbage"])
def test_unsupported_versions_are_refused_with_one_clear_message(version):
    with pytest.raises(ImportError, match=r"capuchin_tf supports TensorFlow >=2\.21,<2\.22 .* but TensorFlow "):
        loader.check_tensorflow_version(version)


def test_the_library_was_found_and_loaded():
    path = loader.library_path()
    assert path is not None and path.name == "_capuchin_ops.so" and path in loader.candidate_paths()
    assert not loader.loaded_too_late()


def test_importing_after_tensorflow_ran_an_op_warns_and_leaves_the_allocator_unwrapped(simulated_device):
    result = simulated_device(
        """
        import json, warnings
        import tensorflow as tf
        tf.constant(1.0) + 1.0  # TensorFlow creates its devices here
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import capuchin_tf
        print(json.dumps({
            "warnings": [str(w.message) for w in caught if w.category.__name__ == "ImportedTooLateWarning"],
            "late": capuchin_tf.tf.loader.loaded_too_late(),
            "wrapped": capuchin_tf.allocator_stats()["wrapped"],
        }))
        """,
        limit_mb=256,
    )
    assert result["late"] and not result["wrapped"]
    assert len(result["warnings"]) == 1 and "imported after TensorFlow had created its devices" in result["warnings"][0]


def test_importing_first_installs_the_wrapper(simulated_device):
    result = simulated_device(
        """
        import json
        import tensorflow as tf
        import capuchin_tf
        print(json.dumps({"late": capuchin_tf.tf.loader.loaded_too_late(), **capuchin_tf.allocator_stats()}))
        """,
        limit_mb=256,
    )
    assert not result["late"] and result["wrapped"]
    assert result["bytes_limit"] == 256 << 20


def test_a_missing_library_is_a_clear_import_error(simulated_device, tmp_path):
    result = simulated_device(
        """
        import json, pathlib
        from capuchin_tf.tf import loader
        loader.candidate_paths = lambda: [pathlib.Path("/nonexistent/_capuchin_ops.so")]
        try:
            loader._module = None
            loader.load()
            print(json.dumps({"error": None}))
        except ImportError as e:
            print(json.dumps({"error": str(e)}))
        """,
        limit_mb=64,
        env={"PYTHONPATH": str(loader._REPO_DIR)},
    )
    assert result["error"] and "was not found" in result["error"] and "bazel build" in result["error"]
