"""topics.atomic_write.atomic_write: replaces whole, leaves no temporary file behind."""
import pytest

from topics.atomic_write import atomic_write


def test_atomic_write_replaces_and_cleans_up(tmp_path):
    path = tmp_path / "state.json"
    atomic_write(path, '{"a": 1}')
    atomic_write(path, b'{"a": 2}')
    assert path.read_text() == '{"a": 2}'
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]
    with pytest.raises(FileNotFoundError):
        atomic_write(tmp_path / "missing" / "x", "y")
    with pytest.raises(TypeError):  # a failed write keeps the old content and removes its temporary file
        atomic_write(path, 3)
    assert path.read_text() == '{"a": 2}' and [p.name for p in tmp_path.iterdir()] == ["state.json"]
