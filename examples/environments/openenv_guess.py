"""Guess-the-number, an OpenEnv environment served with ``openenv-core`` (``examples/openenv-game.yaml``).

Each episode hides a number in ``1..high`` (drawn from the reset's ``seed``, so the samples of one group play
the same game); the player answers each observation with a guess as its action's ``message``, and hears "higher",
"lower" or "correct". The reward is 1.0 for the step that finds the number and 0.0 otherwise; the episode ends
there or after ``max_guesses`` guesses.

Runs in the venv of ``scripts/install_openenv.sh`` (``.venv-openenv``: openenv-core and its server stack):
    .venv-openenv/bin/python examples/environments/openenv_guess.py --port 8000 [--high 8] [--max-sessions 64]
"""
from __future__ import annotations

import argparse
import random
import re
import uuid
from typing import Any, Optional

import uvicorn
from openenv.core.env_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class GuessAction(Action):
    """A guess: the player's text, whose first integer is the guess."""

    message: str


class GuessObservation(Observation):
    """What the player is told: the rules, or the answer to its last guess."""

    message: str


class GuessState(State):
    """The hidden number and how many guesses were made."""

    target: int = 0


def make_env(high: int, max_guesses: int) -> type[Environment]:
    """The environment class for numbers in ``1..high`` and ``max_guesses`` guesses per episode."""

    class GuessEnvironment(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True  # each session has its own instance and nothing is shared

        def __init__(self) -> None:
            super().__init__()
            self._state = GuessState()

        def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None,
                  **kwargs: Any) -> GuessObservation:
            target = random.Random(seed).randint(1, high)
            self._state = GuessState(episode_id=episode_id or str(uuid.uuid4()), step_count=0, target=target)
            return GuessObservation(message=f"Guess my number from 1 to {high}. Answer with the number only.")

        def step(self, action: GuessAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GuessObservation:
            self._state.step_count += 1
            found = re.search(r"-?\d+", action.message)
            last = self._state.step_count >= max_guesses
            if found is None:
                return GuessObservation(message="not a number", reward=0.0, done=last)
            guess = int(found.group())
            if guess == self._state.target:
                return GuessObservation(message="correct", reward=1.0, done=True)
            return GuessObservation(message="higher" if guess < self._state.target else "lower", reward=0.0,
                                    done=last)

        @property
        def state(self) -> GuessState:
            return self._state

    return GuessEnvironment


def main() -> None:
    """Serve the game on 127.0.0.1 (HTTP ``/health``, ``/schema``; WebSocket sessions on ``/ws``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--high", type=int, default=8, help="numbers are 1..high")
    ap.add_argument("--max-guesses", type=int, default=4)
    ap.add_argument("--max-sessions", type=int, default=64, help="concurrent WebSocket sessions")
    ap.add_argument("--ws-ping-s", type=float, default=20.0,
                    help="uvicorn pings each WebSocket this often and closes one whose pong is this late")
    args = ap.parse_args()
    app = create_app(make_env(args.high, args.max_guesses), GuessAction, GuessObservation, env_name="guess",
                     max_concurrent_envs=args.max_sessions)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", ws_ping_interval=args.ws_ping_s,
                ws_ping_timeout=args.ws_ping_s)


if __name__ == "__main__":
    main()
