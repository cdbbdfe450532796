"""EngineBatcher's hold: while a worker's rollout is ahead of its trainer, an engine call waits for a floor of rows
or a deadline, whichever comes first, and ending the hold sends what waits at once. The tiny model, real calls."""
import asyncio

import pytest
import torch

from producers.engine_batcher import EngineBatcher
from producers.engines import SamplingParams
from producers.hf_engine import HFEngine

SAMPLING = SamplingParams(max_new_tokens=2, temperature=1.0, seed=1)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return HFEngine(tiny_model_dir, dtype=torch.float32)


async def _until(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"{what} did not happen"
        await asyncio.sleep(0.01)


def test_a_held_call_waits_for_its_rows_and_goes_when_they_are_pending(engine):
    async def main():
        batcher = EngineBatcher(engine)
        batcher.hold(4, wait_s=600.0)
        try:
            first = [asyncio.create_task(batcher.generate([5, 6, 7], SAMPLING)) for _ in range(3)]
            await asyncio.sleep(0.5)
            waited = (batcher.calls, batcher.pending)
            fourth = asyncio.create_task(batcher.generate([5, 6], SAMPLING))
            gens = await asyncio.gather(*first, fourth)
            return waited, gens, (batcher.calls, batcher.rows)
        finally:
            batcher.close()

    waited, gens, made = asyncio.run(main())
    assert waited == (0, 3)  # three of the four rows: no call yet
    assert made == (1, 4) and all(1 <= len(g.output_ids) <= 2 for g in gens)


def test_a_held_call_goes_at_its_deadline_or_when_the_hold_ends(engine):
    async def main():
        batcher = EngineBatcher(engine)
        try:
            batcher.hold(10, wait_s=0.3)  # the floor is never reached: the deadline sends the call
            await batcher.generate([5, 6, 7], SAMPLING)
            after_deadline = (batcher.calls, batcher.rows)
            batcher.hold(10, wait_s=600.0)
            pending = [asyncio.create_task(batcher.generate([5, 6], SAMPLING)) for _ in range(2)]
            await _until(lambda: batcher.pending == 2, "two requests pending")
            await asyncio.sleep(0.3)
            held = batcher.calls
            batcher.hold(0, wait_s=600.0)  # ended: what waits goes now
            await asyncio.gather(*pending)
            return after_deadline, held, (batcher.calls, batcher.rows)
        finally:
            batcher.close()

    after_deadline, held, made = asyncio.run(main())
    assert after_deadline == (1, 1) and held == 1 and made == (2, 3)
