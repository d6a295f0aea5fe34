"""The engine env rule: which variables a profile may give an engine, and which values are masked wherever shown."""

import pytest

from agent.engines.launch import build_launch
from nodewire.engine_env import MASK, MAX_VALUE_LENGTH, MAX_VARIABLES, env_problem, is_secret, masked, shown


@pytest.mark.parametrize(
    "name",
    ["HF_TOKEN", "hf_token", "OPENAI_API_KEY", "api_key", "AWS_SECRET", "client_secret", "DB_PASSWORD", "WANDB_KEY"],
)
def test_names_ending_in_key_token_secret_or_password_are_secret_in_any_case(name):
    assert is_secret(name)


@pytest.mark.parametrize("name", ["OMP_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE", "TOKENIZERS_PARALLELISM", "KEY_FILE"])
def test_other_names_are_not_secret(name):
    assert not is_secret(name)


def test_masked_replaces_only_the_secret_values_and_keeps_the_order():
    env = {"OMP_NUM_THREADS": "8", "HF_TOKEN": "hf_abc", "Api_Key": "sk-1", "EMPTY": ""}
    assert list(masked(env).items()) == [("OMP_NUM_THREADS", "8"), ("HF_TOKEN", MASK), ("Api_Key", MASK), ("EMPTY", "")]
    assert env["HF_TOKEN"] == "hf_abc"  # the caller's mapping is left alone


def test_shown_is_shell_assignments_with_secrets_masked():
    assert shown({"A": "1", "B": "two words", "HF_TOKEN": "hf_abc"}) == "A=1 B='two words' HF_TOKEN='***'"
    assert shown({}) == ""


@pytest.mark.parametrize(
    "env",
    [{}, {"OMP_NUM_THREADS": "8"}, {"_X1": ""}, {"HF_TOKEN": "hf_abc"}, {f"V{i}": "x" for i in range(MAX_VARIABLES)}],
)
def test_a_mapping_of_valid_names_to_strings_is_an_engine_env(env):
    assert env_problem(env) is None


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (["A=1"], "Engine env must be a mapping of variable names to strings"),
        ("A=1", "not a str"),
        (None, "; not null."),
        ({"1ABC": "x"}, "Variable name '1ABC' is not valid: use letters, digits and _, not starting with a digit."),
        ({"A-B": "x"}, "Variable name 'A-B' is not valid"),
        ({"A=B": "x"}, "Variable name 'A=B' is not valid"),
        ({"": "x"}, "Variable name '' is not valid"),
        ({"N" * 200: "x"}, "is 200 characters long; at most 128"),
        ({"VLLM_CPU_KVCACHE_SPACE": 1}, "Variable VLLM_CPU_KVCACHE_SPACE: the value must be a string, not a number"),
        ({"FLAG": True}, "Variable FLAG: the value must be a string, not true or false"),
        ({"LIST": ["a"]}, "Variable LIST: the value must be a string, not a list"),
        ({"NONE": None}, "Variable NONE: the value must be a string, not null"),
        ({"A": "x\x00y"}, "Variable A: the value holds a NUL character"),
        ({"A": "x" * (MAX_VALUE_LENGTH + 1)}, f"Variable A: the value is {MAX_VALUE_LENGTH + 1} characters long"),
        ({f"V{i}": "x" for i in range(MAX_VARIABLES + 1)}, f"has {MAX_VARIABLES + 1} variables; at most 64"),
        ({"CUDA_VISIBLE_DEVICES": "0"}, "Variable CUDA_VISIBLE_DEVICES cannot be set on a profile: the agent sets it"),
        ({"HF_HOME": "/data"}, "Variable HF_HOME cannot be set on a profile: the agent sets it to the node's weights"),
    ],
)
def test_a_bad_engine_env_is_named(env, message):
    problem = env_problem(env)
    assert problem is not None and message in problem, problem


def test_a_bad_secret_value_is_named_without_showing_it():
    problem = env_problem({"HF_TOKEN": "hf_sup3r\x00secret"})
    assert problem is not None and "HF_TOKEN" in problem and "sup3r" not in problem


@pytest.mark.parametrize(
    ("engine", "rank", "node_count"),
    [
        ("vllm", 0, 1),
        ("vllm", 0, 2),
        ("vllm", 1, 2),
        ("sglang", 0, 1),
        ("sglang", 1, 2),
        ("llamacpp", 0, 1),
        ("mock", 0, 1),
    ],
)
def test_every_variable_the_agent_sets_for_an_engine_is_refused_on_a_profile(engine, rank, node_count):
    # A profile setting one would only appear to change it: the agent's value is applied after the profile's.
    launch = build_launch(
        engine,
        model="m",
        source="org/m",
        port=8000,
        gpu_indices=[0],
        rank=rank,
        node_count=node_count,
        head_address="10.0.0.1",
        rendezvous_port=8001 if node_count > 1 else 0,
        args=[],
        host="127.0.0.1",
        python="python",
        llama_server="llama-server",
    )
    assert launch.env
    for name, value in launch.env.items():
        assert env_problem({name: value}) is not None, name
