"""CompilerConfig: every option typed, validated on assignment and from an options dict."""

from __future__ import annotations

import os
import pickle
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from npugraph_backend import CompilerConfig, OptionError, PassOptionError
from npugraph_backend.config import option_names

BOOLS = [
    "force_eager", "force_recapture", "clone_input", "clone_output",
    "reuse_graph_pool_in_same_fx", "frozen_parameter", "remove_noop_ops", "remove_cat_ops",
    "inplace_pass", "input_inplace_pass", "pattern_fusion_pass", "dump_tensor_data",
    "deadlock_check", "static_kernel_compile", "disable_static_kernel_compile_cache",
]
ENUMS = {
    "capture_error_mode": ("global", "thread_local", "relaxed"),
    "data_dump_stage": ("optimized", "original"),
    "mode": ("npugraph_ex",),
}
PASSES = ["post_grad_custom_pre_pass", "post_grad_custom_post_pass"]


def user_pass(gm, example_inputs, config):  # type: ignore[no-untyped-def]
    return None


def test_every_api_option_has_its_documented_default() -> None:
    c = CompilerConfig()
    assert c.as_dict() == {
        "force_eager": False, "force_recapture": False, "capture_limit": 64,
        "clone_input": True, "clone_output": False, "use_graph_pool": None,
        "reuse_graph_pool_in_same_fx": True, "frozen_parameter": False,
        "remove_noop_ops": True, "remove_cat_ops": True, "inplace_pass": True,
        "input_inplace_pass": True, "pattern_fusion_pass": True,
        "post_grad_custom_pre_pass": None, "post_grad_custom_post_pass": None,
        "capture_error_mode": "global", "dump_tensor_data": False,
        "data_dump_stage": "optimized", "data_dump_dir": "./", "deadlock_check": False,
        "static_kernel_compile": False, "disable_static_kernel_compile_cache": False,
        "capture_sizes": None, "pad_values": None, "mode": "npugraph_ex",
    }


@pytest.mark.parametrize("name", BOOLS)
@pytest.mark.parametrize("value", [0, 1, "True", None])
def test_bool_option_refuses_non_bool_naming_option_and_value(name: str, value: object) -> None:
    with pytest.raises(OptionError) as err:
        CompilerConfig.from_options({name: value})
    assert name in str(err.value) and repr(value) in str(err.value)
    assert "True or False" in str(err.value)


@pytest.mark.parametrize("value", ["64", True, 0, -1, 1.5, None])
def test_capture_limit_refuses_non_positive_int(value: object) -> None:
    with pytest.raises(OptionError, match="capture_limit") as err:
        CompilerConfig.from_options({"capture_limit": value})
    assert repr(value) in str(err.value)


def test_assignment_is_validated() -> None:
    c = CompilerConfig()
    with pytest.raises(OptionError, match="capture_limit"):
        c.capture_limit = "64"  # type: ignore[assignment]
    assert c.capture_limit == 64
    c.capture_limit = 3
    assert c.capture_limit == 3


def test_unknown_option_suggests_the_closest_name() -> None:
    with pytest.raises(OptionError, match="Did you mean 'frozen_parameter'"):
        CompilerConfig.from_options({"froze_parameter": True})
    with pytest.raises(OptionError, match="Did you mean 'clone_output'"):
        CompilerConfig().clone_ouput = True


@pytest.mark.parametrize("name", PASSES)
def test_non_callable_pass_is_a_type_error(name: str) -> None:
    with pytest.raises(TypeError, match=name) as err:
        CompilerConfig.from_options({name: "not a function"})
    assert isinstance(err.value, PassOptionError) and isinstance(err.value, ValueError)


def test_enum_options_refuse_values_outside_the_list() -> None:
    for name, allowed in ENUMS.items():
        with pytest.raises(OptionError, match=name) as err:
            CompilerConfig.from_options({name: "reduce-overhead"})
        assert all(repr(a) in str(err.value) for a in allowed)


def test_data_dump_dir_must_exist(tmp_path: os.PathLike[str]) -> None:
    with pytest.raises(ValueError, match="data_dump_dir"):
        CompilerConfig.from_options({"data_dump_dir": os.path.join(tmp_path, "missing")})
    assert CompilerConfig.from_options({"data_dump_dir": tmp_path}).data_dump_dir == str(tmp_path)


def test_use_graph_pool_accepts_a_raw_device_pool_id_and_refuses_junk() -> None:
    assert CompilerConfig.from_options({"use_graph_pool": (0, 1)}).use_graph_pool == (0, 1)
    with pytest.raises(OptionError, match="use_graph_pool"):
        CompilerConfig.from_options({"use_graph_pool": "pool"})


def test_options_must_be_a_mapping() -> None:
    with pytest.raises(OptionError, match="options"):
        CompilerConfig.from_options([("force_eager", True)])  # type: ignore[arg-type]


def test_copy_is_independent() -> None:
    a = CompilerConfig.from_options({"capture_limit": 5})
    b = a.copy()
    b.capture_limit = 7
    assert (a.capture_limit, b.capture_limit) == (5, 7)


def test_hash_is_stable_and_tracks_options_and_pass_source() -> None:
    a = CompilerConfig.from_options({"capture_limit": 5, "post_grad_custom_pre_pass": user_pass})
    b = pickle.loads(pickle.dumps(a))
    assert a.hash() == b.hash() == CompilerConfig.from_options(
        {"post_grad_custom_pre_pass": user_pass, "capture_limit": 5}).hash()
    assert a.hash() != CompilerConfig.from_options({"capture_limit": 5}).hash()

    def other_pass(gm, example_inputs, config):  # type: ignore[no-untyped-def]
        gm.recompile()

    other = CompilerConfig.from_options({"capture_limit": 5, "post_grad_custom_pre_pass": other_pass})
    assert other.hash() != a.hash()


# --- option fuzzing ----------------------------------------------------------------------------

def _valid_values(name: str) -> st.SearchStrategy[object]:
    if name in BOOLS:
        return st.booleans()
    if name in ENUMS:
        return st.sampled_from(ENUMS[name])
    if name == "capture_limit":
        return st.integers(1, 2**63 - 1)
    if name in PASSES:
        return st.sampled_from([None, user_pass])
    if name == "use_graph_pool":
        return st.sampled_from([None, (0, 1)])
    if name == "capture_sizes":
        return st.one_of(st.none(), st.just("auto"), st.sets(st.integers(1, 512), min_size=1)
                         .map(sorted))
    if name == "pad_values":
        return st.one_of(st.none(), st.dictionaries(
            st.sampled_from(["slots", "tokens"]), st.integers(0, 63) | st.booleans()))
    assert name == "data_dump_dir"
    return st.sampled_from(["./", os.getcwd()])


def _invalid_values(name: str) -> st.SearchStrategy[object]:
    junk = st.one_of(
        st.integers(-5, 5), st.text(string.ascii_letters, max_size=6), st.floats(allow_nan=False),
        st.none(), st.lists(st.integers(), max_size=2), st.booleans(),
    )
    if name in BOOLS:
        return junk.filter(lambda v: type(v) is not bool)
    if name in ENUMS:
        return junk.filter(lambda v: v not in ENUMS[name])
    if name == "capture_limit":
        return junk.filter(lambda v: not (type(v) is int and v >= 1))
    if name in PASSES:
        return junk.filter(lambda v: v is not None)
    if name == "use_graph_pool":
        return junk.filter(lambda v: v is not None)
    if name == "capture_sizes":
        return st.sampled_from([[4, 2], [0], [], [True], "all", 8, [2.0]])
    if name == "pad_values":
        return st.sampled_from([[("slots", 1)], {"slots": "1"}, {1: 2}, 3, "slots"])
    assert name == "data_dump_dir"
    return st.sampled_from(["/no/such/dir", 3, None])


valid_options = st.lists(st.sampled_from(option_names()), unique=True).flatmap(
    lambda names: st.fixed_dictionaries({n: _valid_values(n) for n in names})
)


@settings(max_examples=150, deadline=None)
@given(valid_options)
def test_no_valid_options_dict_is_refused(options: dict[str, object]) -> None:
    config = CompilerConfig.from_options(options)
    for name, value in options.items():
        assert getattr(config, name) == _as_stored(name, value)


def _as_stored(name: str, value: object) -> object:
    if name == "data_dump_dir":
        return str(value)
    if name == "capture_sizes" and isinstance(value, list):
        return tuple(value)  # kept immutable: a config is copied shallowly
    return value


@settings(max_examples=200, deadline=None)
@given(valid_options, st.sampled_from(option_names()).flatmap(
    lambda n: st.tuples(st.just(n), _invalid_values(n))))
def test_every_invalid_option_is_refused_naming_it(
    base: dict[str, object], bad: tuple[str, object]
) -> None:
    name, value = bad
    options = {**base, name: value}
    with pytest.raises(OptionError) as err:
        CompilerConfig.from_options(options)
    assert repr(name) in str(err.value)


@settings(max_examples=100, deadline=None)
@given(valid_options, st.text(string.ascii_lowercase + "_", min_size=1, max_size=30))
def test_every_unknown_option_name_is_refused_naming_it(
    base: dict[str, object], name: str
) -> None:
    if name in option_names():
        return
    with pytest.raises(OptionError) as err:
        CompilerConfig.from_options({**base, name: True})
    assert repr(name) in str(err.value)
