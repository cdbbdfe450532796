"""A prompt file holding one of each bad record a hostile tester found, among three good ones (a test helper)."""
import json
from pathlib import Path

#: Line number -> a regex of the reason its record is rejected for (with data.max_prompt_chars = 32768).
BAD_LINES = {
    2: r"not JSON \(Expecting value",
    4: r"not UTF-8 \(invalid continuation byte",
    6: r"no field 'answer' \(fields: \['problem'\]\)",
    7: r"prompt is 1000071 characters long, over the limit of 32768 \(data.max_prompt_chars",
}
#: The good records' gold answers, by line.
GOOD_LINES = {1: "2", 3: "4", 8: "6"}


def write_bad_prompt_file(path: Path) -> Path:
    """Write the file: good lines 1, 3, 8; broken JSON on 2, a non-UTF-8 byte on 4, a blank line 5, no answer
    on 6 and a 1 MB prompt on 7. Returns ``path``."""
    lines = [
        json.dumps({"problem": "What is 1+1?", "answer": "2"}).encode(),
        b'{"problem": "What is 9+9?", "answer": ',
        json.dumps({"problem": "What is 2+2?", "answer": "4"}).encode(),
        b'{"problem": "caf\xe9 au lait?", "answer": "1"}',
        b"",
        json.dumps({"problem": "What is the answer?"}).encode(),
        json.dumps({"problem": "x" * 1_000_000, "answer": "1"}).encode(),
        json.dumps({"problem": "What is 3+3?", "answer": "6"}).encode(),
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path
