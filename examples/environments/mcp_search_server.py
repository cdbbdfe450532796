"""An MCP server (stdio) over the search demo's corpus: tools ``search`` (the document naming a word) and ``add``.

Run by an environment as ``MCPServer([sys.executable, "examples/environments/mcp_search_server.py"])``
(:mod:`producers.mcp_tools`); ``python examples/environments/mcp_search_server.py`` serves on stdin/stdout.
"""
from __future__ import annotations

import json
from pathlib import Path

from mcp.server.mcpserver import MCPServer

CORPUS = Path(__file__).resolve().parents[2] / "producers" / "data" / "search_kb.jsonl"
DOCS = [json.loads(line) for line in CORPUS.read_text().splitlines() if line.strip()]

server = MCPServer("search-kb")


@server.tool()
def search(query: str) -> str:
    """Search the knowledge base: the first document containing every word of the query, or "no results".

    Args:
        query: the words to look for.
    """
    words = query.lower().split()
    hit = next((d["text"] for d in DOCS if words and all(w in d["text"].split() for w in words)), None)
    return hit if hit is not None else "no results"


@server.tool()
def add(a: int, b: int) -> int:
    """The sum of two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


if __name__ == "__main__":
    server.run("stdio")
