"""The exactly-once audit (astraflow/audit.py) accounts for the prompts RaaS committed and the groups written for
them; a record that does not decode (dead-lettered by the run) is no prompt to account for, not a crash."""
import numpy as np

from astraflow.audit import audit_run
from topics.bus import TopicPartition, connect
from topics.codec import encode
from topics.layout import ensure_run_topics
from topics.names import TopicNames
from topics.schemas import Prompt, Sample, TrajectoryGroup


def group_for(prompt_id: str) -> TrajectoryGroup:
    sample = Sample(input_ids=np.arange(4, dtype=np.int32), loss_mask=np.array([0, 0, 1, 1], np.uint8),
                    behavior_logprobs=np.array([0, 0, -0.5, -0.5], np.float32),
                    versions=np.array([-1, -1, 0, 0], np.int32), reward=1.0)
    return TrajectoryGroup.build(samples=[sample, sample], prompt_id=prompt_id, group_id=f"g-{prompt_id}",
                                 policy="actor")


def test_the_audit_skips_records_that_do_not_decode(tmp_path):
    bus, names = connect(f"local://{tmp_path / 'bus'}"), TopicNames("audited")
    ensure_run_topics(bus.admin(), names, ["actor"], partitions=1)
    producer = bus.producer()
    for value in (encode(Prompt(prompt_id="a", source="t", task_type="math", text="1+1=", answer="2")), b"garbage",
                  encode(Prompt(prompt_id="b", source="t", task_type="math", text="2+2=", answer="4"))):
        producer.send(names.prompts, value, partition=0)
    producer.send(names.trajectories("actor"), encode(group_for("a")), partition=0)
    producer.send(names.trajectories("actor"), b"\x28\xb5\x2f\xfd not a frame", partition=0)
    producer.flush()
    raas = bus.consumer(names.raas_group("single_turn"))
    raas.commit({TopicPartition(names.prompts, 0): 3})  # RaaS committed all three records
    raas.close()
    audit = audit_run(bus, names, "actor", "single_turn")
    assert (audit.committed_prompts, audit.lost, audit.trained_twice) == (2, ["b"], [])
