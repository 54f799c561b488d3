"""nanolatent/common.py's file replaced in one rename, which every script's JSON, checkpoint and record writes go
through. (die's one line: each script's tests; the progress line: test_progress.py.)"""

import errno
import os

import pytest

from nanolatent import common


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()])
def test_replacing_renames_when_the_block_ends_and_keeps_the_old_file_when_it_raises(tmp_path, error):
    path = tmp_path / "results.json"
    path.write_text("old")
    with pytest.raises(type(error)):
        with common.replacing(str(path)) as tmp, open(tmp, "w") as f:
            f.write("half")
            raise error
    assert os.listdir(tmp_path) == ["results.json"] and path.read_text() == "old"  # no temporary file left
    with common.replacing(str(path)) as tmp:
        assert os.path.dirname(tmp) == str(tmp_path) and tmp.endswith(f".tmp{os.getpid()}")  # beside it, this process's
        with open(tmp, "w") as f:
            f.write("new")
        assert path.read_text() == "old"  # until the block ends
    assert os.listdir(tmp_path) == ["results.json"] and path.read_text() == "new"
