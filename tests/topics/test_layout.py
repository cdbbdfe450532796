"""A run's topic layout: every topic with its partitions and compaction, created as specified."""
from topics.bus import connect
from topics.layout import RunTopics, TopicSpec, ensure_run_topics
from topics.names import TopicNames
from topics.schemas import Control, PolicyState, TrainedBatch, TrainerProgress, WeightAnnouncement


def test_the_layout_of_a_run_with_two_policies():
    specs = RunTopics(TopicNames("r"), partitions=3).all(["a", "b"])
    assert specs == [TopicSpec("r.prompts", 3), TopicSpec("r.outcomes", 3), TopicSpec("r.metrics", 3),
                     TopicSpec("r.deadletter", 3), TopicSpec("r.trajectories.a", 3), TopicSpec("r.samples.a", 3),
                     TopicSpec("r.trajectories.b", 3), TopicSpec("r.samples.b", 3),
                     TopicSpec("r.weights", 1, compacted=True, schemas=(WeightAnnouncement,)),
                     TopicSpec("r.control", 1, compacted=True, schemas=(Control, TrainerProgress)),
                     TopicSpec("r.state", 1, compacted=True, schemas=(PolicyState,)),
                     TopicSpec("r.trained", 1, compacted=True, schemas=(TrainedBatch,))]


def test_ensure_run_topics_creates_each_as_specified_and_leaves_existing_ones(tmp_path):
    admin = connect(f"local://{tmp_path}").admin()
    admin.create_topic("r.metrics", partitions=2)  # made before, by someone else: left as it is
    ensure_run_topics(admin, TopicNames("r"), ["a"])
    ensure_run_topics(admin, TopicNames("r"), ["a"])  # idempotent
    got = {t: (admin.describe_topic(t).partitions, admin.describe_topic(t).compacted) for t in admin.list_topics()}
    assert got == {"r.prompts": (4, False), "r.outcomes": (4, False), "r.metrics": (2, False),
                   "r.deadletter": (4, False), "r.trajectories.a": (4, False), "r.samples.a": (4, False),
                   "r.weights": (1, True), "r.control": (1, True), "r.state": (1, True), "r.trained": (1, True)}
