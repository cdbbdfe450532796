"""The search task as an agent of your own that calls the model through an OpenAI client (the ``openai_agent``
workflow, :mod:`producers.chat_server`): ``workflow: {name: openai_agent, options: {agent:
"examples/environments/search_openai_agent.py:agent"}}`` with ``tools.search`` configured.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the knowledge base.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}


async def agent(client: Any, model: str, prompt: Any, tools: Mapping[str, Any], max_turns: int = 2) -> str:
    """Ask the model, run the searches it calls for with the run's ``search`` tool, and return its last answer
    (up to ``max_turns`` model turns; "" when it is still calling tools then)."""
    messages: list[dict] = [{"role": "user", "content": prompt.text}]
    for _ in range(max_turns):
        reply = await client.chat.completions.create(model=model, messages=messages, tools=[SEARCH])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            query = json.loads(call.function.arguments).get("query", "")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": await tools["search"](query)})
    return ""
