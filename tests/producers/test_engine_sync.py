"""EngineSync, the one weight-sync contract: an engine that takes tensors is handed only those that changed since
its last load (all of them the first time), from a verified host copy; a failed load keeps them for the next."""
import pytest
import torch

from producers.engine_sync import EngineSync
from producers.engines import EngineUpdateError
from producers.hf_engine import HFEngine
from topics.names import TopicNames
from weights.publisher import Publisher
from weights.puller import Puller
from weights.store import WeightStore


class RecordingEngine(HFEngine):
    """The HF engine, recording the names of every tensor it is handed, refusing the next ``refuse`` loads."""

    def __init__(self, model_dir):
        super().__init__(model_dir)
        self.handed: list[list[str]] = []
        self.refuse = 0

    def load_weights(self, state_dict, version):
        if self.refuse:
            self.refuse -= 1
            raise EngineUpdateError(f"version {version} not loaded: refused by the test")
        self.handed.append(sorted(state_dict))
        super().load_weights(state_dict, version)


def test_only_the_changed_tensors_reach_the_engine_and_a_refused_load_sends_them_again(tiny_model_dir, tmp_path):
    torch.set_num_threads(1)
    engine = RecordingEngine(tiny_model_dir)
    run, names = "sync", TopicNames("sync")
    store = WeightStore((tmp_path / "weights").as_uri(), run)
    state = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    first, second = sorted(state)[0], sorted(state)[-1]
    pub = Publisher(store, None, names, "actor")
    sync = EngineSync(engine, Puller(store, None, names, "actor"))
    assert sync.update() == 0  # nothing published: the base model stays

    state[first] += 1.0
    pub.publish(state, 1)  # a full snapshot: the host copy starts with it, and every tensor is handed over
    assert pub.wait(60)
    assert sync.update() == 1
    assert engine.handed[-1] == sorted(state)

    state[second] += 1.0
    pub.publish(state, 2)  # a delta touching one tensor
    assert pub.wait(60)
    engine.refuse = 1
    sync.fetch(2)
    with pytest.raises(EngineUpdateError):
        sync.load(2)
    assert (engine.version, sync.loadable()) == (1, 2)
    state[first] += 1.0
    pub.publish(state, 3)  # another tensor: the retry carries both
    pub.close()
    assert not pub.errors
    assert sync.update() == 3
    assert engine.handed[-1] == sorted({first, second})
    loaded = engine.model.state_dict()
    assert torch.equal(loaded[first], state[first]) and torch.equal(loaded[second], state[second])
