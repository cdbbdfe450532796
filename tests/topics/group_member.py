"""A consumer-group member run as a real subprocess by the contract tests.

Usage: ``python group_member.py BUS_URL TOPIC GROUP OUT_JSONL SESSION_TIMEOUT_S [INSTANCE_ID]``

Joins GROUP on TOPIC and polls forever, never committing. Each change of its
assignment is appended to OUT_JSONL as ``{"assignment": [[topic, p], ...]}`` and
each polled record as ``{"record": [partition, offset, value]}`` (value decoded
as UTF-8), flushed at once so that a SIGKILL loses nothing already written. It
exits by itself after 120 s in case the test that started it died. With INSTANCE_ID it
is a static member (``group.instance.id``).
"""
import json
import sys
import time

from topics.bus import connect


def main(url: str, topic: str, group: str, out_path: str, session_timeout_s: str, instance_id: str = "") -> None:
    consumer = connect(url).consumer(group, session_timeout_s=float(session_timeout_s), client_id="member",
                                     instance_id=instance_id or None)
    consumer.subscribe([topic])
    last = None
    deadline = time.monotonic() + 120
    with open(out_path, "a") as out:
        while time.monotonic() < deadline:
            records = consumer.poll(100, 0.2)
            assignment = [list(tp) for tp in consumer.assignment()]
            if assignment != last:
                out.write(json.dumps({"assignment": assignment}) + "\n")
                last = assignment
            for r in records:
                out.write(json.dumps({"record": [r.partition, r.offset, r.value.decode()]}) + "\n")
            out.flush()


if __name__ == "__main__":
    main(*sys.argv[1:])
