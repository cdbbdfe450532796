"""The ``verifiers`` workflow (:mod:`producers.verifiers_env`): a verifiers 0.4 environment (the search example)
run by a RaaS worker from a run config, its agent talking to the worker's endpoint through verifiers' own
interception server, against the real search server, with no network and no container; and its options refused
by name."""
import sys
import uuid
from pathlib import Path

import pytest

pytest.importorskip("verifiers.v1")

from producers.workflows import get_workflow  # noqa: E402
from tests.producers.test_agentic import start_search_server  # noqa: E402
from topics.schemas import Prompt  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from env_rig import cached_hermes_policy, episode_ids, roll_out_one_group  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EPISODE = ("code of zovob?", "zovob", "the code of zovob is 846", "846")  # the env strips the source's newline
SEARCH_ENV = f"{ROOT}/examples/environments/search_verifiers.py"


@pytest.fixture(scope="module")
def hermes_dir() -> Path:
    return cached_hermes_policy([EPISODE])


def test_a_raas_worker_rolls_out_a_verifiers_environment_one_session_per_episode(tmp_path, hermes_dir):
    """Each of the prompt's 3 episodes is a verifiers trace: the agent's two model calls (a search call, then the
    code) reach the worker's engine as one session, whose tokens are the sample, and the task's
    ``@vf.reward`` is the sample's reward."""
    server, url = start_search_server(tmp_path / "search.log")
    path = tmp_path / "run.yaml"
    path.write_text(f"""
run: vf{uuid.uuid4().hex[:8]}
run_dir: {tmp_path / 'run'}
bus: local://{tmp_path / 'bus'}
policies:
  actor: {{model: {hermes_dir}}}
workflow: {{name: verifiers, options: {{env: "{SEARCH_ENV}", max_turns: 3}}}}
tools: {{search: {{url: "{url}"}}}}
data: {{sources: [{{name: search, limit: 1}}], n_samples: 3}}
sampling: {{max_new_tokens: 80, temperature: 0.05}}  # the replayed episode: near greedy
raas: {{batch_prompts: 1, max_inflight_groups: 1000, max_episodes: 3}}
""")
    group, calls, tokenizer = roll_out_one_group(path, server)
    ids, mask = episode_ids(tokenizer, *EPISODE)
    assert (group.workflow, calls, len(group.samples)) == ("verifiers", 3, 3)
    for s in group.samples:
        assert (s.input_ids.tolist(), s.loss_mask.tolist(), s.reward, s.turns) == (ids, mask, 1.0, 2)
        generated = s.loss_mask == 1
        assert (s.versions[generated] == 0).all() and (s.versions[~generated] == -1).all()
        assert (s.behavior_logprobs[generated] <= 0).all() and (s.behavior_logprobs[~generated] == 0).all()


@pytest.mark.parametrize("options,message", [
    ({}, "options.env is required"),
    ({"env": SEARCH_ENV, "max_turns": 0}, "options.max_turns must be >= 1"),
    ({"env": SEARCH_ENV, "env_args": {"limt": 2}}, "env_args"),
    ({"env": f"{ROOT}/examples/environments/no_such_env.py"}, "options.env: cannot import"),
])
def test_a_bad_verifiers_option_is_refused_naming_it(options, message):
    with pytest.raises(ValueError, match=message):
        get_workflow("verifiers", **options)


def test_a_prompt_becomes_a_task_of_the_environments_task_type():
    workflow = get_workflow("verifiers", env=SEARCH_ENV)
    prompt = Prompt(prompt_id="p0", source="search", task_type="search", text=EPISODE[0] + "\n", answer=EPISODE[3])
    task = workflow.task(prompt)
    assert (type(task).__name__, task.data.prompt, task.data.answer, task.data.id) == \
        ("SearchTask", EPISODE[0], "846", "p0")
    with pytest.raises(ValueError, match="(?s)p1: not a SearchData.*answer.*Field required"):
        workflow.task(prompt.model_copy(update={"prompt_id": "p1", "answer": None}))
