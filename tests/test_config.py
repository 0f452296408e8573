"""Options, modes and env vars: precedence and errors."""

import ast
import dataclasses
import logging
import re

import pytest
import torch

from cgtrees.config import MODES, Config


def test_defaults():
    c = Config.resolve(environ={})
    assert c.cudagraphs and c.cache and c.max_shapes_per_function > 0


def test_env_then_mode_then_options():
    env = {"CGTREES_CUDAGRAPHS": "0", "CGTREES_MAX_SHAPES_PER_FUNCTION": "3"}
    assert Config.resolve(environ=env).cudagraphs is False
    assert Config.resolve(environ=env).max_shapes_per_function == 3
    assert Config.resolve("reduce-overhead", environ=env).cudagraphs is True
    assert Config.resolve("reduce-overhead", {"cudagraphs": False}, environ=env).cudagraphs is False
    assert Config.resolve("max-autotune-no-cudagraphs", environ={}).cudagraphs is False


def test_unknown_option_lists_valid_ones():
    with pytest.raises(ValueError, match=r"options=\{'cudagraph': \.\.\.\}\) is not an option of ours; "
                                         r"did you mean 'cudagraphs'\? valid options: cudagraphs, cache"):
        Config.resolve(options={"cudagraph": True}, environ={})


def test_unknown_mode_lists_valid_ones():
    with pytest.raises(ValueError, match=r"mode='fast'\) is not a mode of ours; valid modes: .*reduce-overhead"):
        Config.resolve("fast", environ={})
    with pytest.raises(ValueError, match="did you mean 'reduce-overhead'"):
        Config.resolve("reduce_overhead", environ={})


def test_bad_values_are_errors():
    with pytest.raises(ValueError, match="cache"):
        Config.resolve(options={"cache": "maybe"}, environ={})
    with pytest.raises(ValueError, match="CGTREES_MAX_SHAPES_PER_FUNCTION"):
        Config.resolve(environ={"CGTREES_MAX_SHAPES_PER_FUNCTION": "many"})


def test_every_field_declares_whether_it_affects_codegen():
    for f in dataclasses.fields(Config):
        assert isinstance(f.metadata.get("affects_codegen"), bool), f.name
    assert ("interpret", False) in Config.resolve(environ={}).codegen_key()


def test_modes_are_known():
    assert set(MODES) >= {"default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"}


def test_torch_compile_passes_mode_and_options():
    x = torch.randn(3)
    f = torch.compile(lambda x: x.cos(), backend="cgtrees", mode="max-autotune-no-cudagraphs")
    torch.testing.assert_close(f(x), x.cos())
    g = torch.compile(lambda x: x.sin(), backend="cgtrees", options={"cache": False})
    torch.testing.assert_close(g(x), x.sin())
    bad_mode = torch.compile(lambda x: x.cos(), backend="cgtrees", mode="fast")
    with pytest.raises(Exception, match=r"mode='fast'\) is not a mode of ours"):
        bad_mode(x)
    bad = torch.compile(lambda x: x.cos(), backend="cgtrees", options={"nope": 1})
    with pytest.raises(Exception, match=r"options=\{'nope': \.\.\.\}\) is not an option of ours"):
        bad(x)


def test_an_unknown_cgtrees_variable_is_named_with_the_nearest_one(caplog, monkeypatch):
    """A typo of a real variable (``CGTREES_CUDAGRAPH``) or a name of none (``CGTREES_NOPE``) was
    ignored without a word: each is named once a process, with the nearest valid name (issue 46)."""
    from cgtrees import config as config_module

    monkeypatch.setattr(config_module, "_WARNED", set())
    env = {"CGTREES_CUDAGRAPH": "0", "CGTREES_NOPE": "1", "CGTREES_CACHE": "0", "OTHER": "x"}
    with caplog.at_level(logging.WARNING, logger="cgtrees"):
        cfg = Config.resolve(environ=env)
        Config.resolve(environ=env)  # once a process
    assert cfg.cache is False and cfg.cudagraphs == Config().cudagraphs  # the typo changes nothing
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2, warned
    typo, unknown = sorted(warned)
    assert "CGTREES_CUDAGRAPH is not one of ours" in typo and "did you mean CGTREES_CUDAGRAPHS?" in typo, typo
    assert "CGTREES_NOPE is not one of ours" in unknown and "did you mean" not in unknown, unknown
    assert "CGTREES_GEMM_DECISIONS" in unknown  # the valid names are listed


# Every option: values that must be refused given in options= and as env text, and one that is taken.
BAD_OPTIONS = {
    "cudagraphs": ["yes", 1, None], "cache": ["yes", 0], "interpret": ["1"], "precompile_cache": ["on"],
    "cpu_pipeline": ["true", 1], "warm_first_calls": ["false"], "unfuse_addmm": [2],
    "max_shapes_per_function": ["8", -1, 0, True, 2.0], "max_rerecords_per_function": ["4", -1],
    "max_live_branches_per_function": ["4", -2], "max_copy_mb_per_launch": ["8", -1, 8.5],
    "cache_size_mb": [-5, "100"],
    "debug_dir": [3, None], "cache_dir": [7], "remote_cache_key": [b"key", 3],
    "layout_opt": ["sideways", 1], "gemm_decisions": ["fastest", None],
    "batch_buckets": ["1,2,4", (0,), [2.5], 8],
    "remote_cache": ["localhost:6379", "http://host:6379/0", 5], "progress": ["no", 0],
}
BAD_ENV = {
    "cudagraphs": ["maybe", "2"], "cache": ["maybe"], "interpret": ["y"], "precompile_cache": ["enabled"],
    "cpu_pipeline": ["always"],
    "warm_first_calls": ["nope"], "unfuse_addmm": ["2"],
    "max_shapes_per_function": ["-1", "0", "many", "8.0"], "max_rerecords_per_function": ["-1"],
    "max_live_branches_per_function": ["x"], "max_copy_mb_per_launch": ["1e3"], "cache_size_mb": ["-5"],
    "layout_opt": ["sideways"], "gemm_decisions": ["fastest"], "batch_buckets": ["4,a", "0"],
    "remote_cache": ["localhost:6379"], "progress": ["quiet"],
    "debug_dir": [], "cache_dir": [], "remote_cache_key": [],  # any text is a path or a key
}
GOOD = {  # option value, env text, the value either gives
    "cudagraphs": (False, "off", False), "cache": (False, "no", False), "interpret": (True, "1", True),
    "cpu_pipeline": (True, "on", True),
    "precompile_cache": (True, "true", True), "warm_first_calls": (False, "0", False),
    "unfuse_addmm": (False, "false", False), "max_shapes_per_function": (3, "3", 3),
    "max_rerecords_per_function": (0, "0", 0), "max_live_branches_per_function": (2, "2", 2),
    "max_copy_mb_per_launch": (0, "0", 0), "cache_size_mb": (100, "100", 100),
    "debug_dir": ("/tmp/d", "/tmp/d", "/tmp/d"), "cache_dir": ("/tmp/c", "/tmp/c", "/tmp/c"),
    "remote_cache_key": ("k", "k", "k"), "layout_opt": ("off", "off", "off"),
    "gemm_decisions": ("keep", "keep", "keep"), "batch_buckets": ([4, 1], "4,1", (1, 4)),
    "remote_cache": ("redis://h:6379/0", "redis://h:6379/0", "redis://h:6379/0"),
    "progress": (False, "0", False),
}


def test_every_option_has_its_checks():
    names = {f.name for f in dataclasses.fields(Config)}
    assert set(BAD_OPTIONS) == set(BAD_ENV) == set(GOOD) == names


@pytest.mark.parametrize("name", sorted(BAD_OPTIONS))
def test_a_bad_option_names_itself_the_value_what_is_accepted_and_the_fix(name):
    from cgtrees.config import OptionError

    for bad in BAD_OPTIONS[name]:
        with pytest.raises(OptionError) as caught:
            Config.resolve(options={name: bad}, environ={})
        first = str(caught.value).splitlines()[0]
        assert f"{name}={bad!r}" in first and ("expected" in first or "valid values" in first), first
        fix = first.split("fix: ")[1]
        assert f"{{{name!r}: " in fix, first
        shown = ast.literal_eval(re.search(r"options=(\{.*?\})(?:\)| or|$)", fix).group(1))
        assert Config.resolve(options=shown, environ={}) is not None  # the fix it names is taken
    for bad in BAD_ENV[name]:
        var = f"CGTREES_{name.upper()}"
        with pytest.raises(OptionError) as caught:
            Config.resolve(environ={var: bad})
        first = str(caught.value).splitlines()[0]
        assert var in first and repr(bad) in first or f"{name}={bad}" in first, first
        assert "fix: " in first and var in first.split("fix: ")[1], first
    value, text, expected = GOOD[name]
    assert getattr(Config.resolve(options={name: value}, environ={}), name) == expected
    assert getattr(Config.resolve(environ={f"CGTREES_{name.upper()}": text}), name) == expected


def test_bool_errors_list_the_accepted_spellings():
    from cgtrees.config import OptionError

    with pytest.raises(OptionError, match="1, true, yes, on \\(on\\) or 0, false, no, off \\(off\\)"):
        Config.resolve(environ={"CGTREES_CACHE": "maybe"})
    with pytest.raises(OptionError, match="True or False \\(as an env var: 1/0, true/false, yes/no, on/off\\)"):
        Config.resolve(options={"cache": "yes"}, environ={})


def test_a_path_is_taken_for_a_directory(tmp_path):
    assert Config.resolve(options={"cache_dir": tmp_path}, environ={}).cache_dir == str(tmp_path)


def test_a_bad_option_at_the_first_call_is_one_plain_error_not_a_torch_bug_report():
    """Torch hands a string backend its options only at the first call; there the error is ours,
    passed through Dynamo unwrapped: no BackendCompilerFailed, no advice to report a bug to PyTorch."""
    from cgtrees.config import OptionError

    torch._dynamo.reset()
    f = torch.compile(lambda x: x.sin() + 1, backend="cgtrees", options={"max_shapes_per_function": "8"})
    with pytest.raises(OptionError) as caught:
        f(torch.randn(3))
    assert type(caught.value).__name__ == "OptionError", type(caught.value)
    text = str(caught.value)
    assert text.startswith("cgtrees: options: max_shapes_per_function='8' is not valid; expected"), text
    assert "PyTorch" not in text and "TORCHDYNAMO_VERBOSE" not in text and "BackendCompilerFailed" not in text
    assert "fix: torch.compile(..., options={'max_shapes_per_function': 8})" in text
