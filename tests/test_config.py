"""Options, modes and env vars: precedence and errors."""

import dataclasses
import logging

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
