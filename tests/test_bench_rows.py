"""The held-out rows a benchmark reads: the reported set, and the validation set after it."""

import json

from bench.common import heldout_rows


def ids(rows: list[dict]) -> list[str]:
    return [row["id"] for row in rows]


def test_skip_gives_the_rows_after_the_reported_ones(tmp_path):
    for voice, count in (("joe", 5), ("slt", 3)):
        rows = [{"id": f"{voice}-{i}", "voice": voice} for i in range(count)]
        (tmp_path / f"{voice}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert ids(heldout_rows(tmp_path, 2)) == ["joe-0", "joe-1", "slt-0", "slt-1"]
    assert ids(heldout_rows(tmp_path, 2, skip=2)) == ["joe-2", "joe-3", "slt-2"]
    assert ids(heldout_rows(tmp_path, 10, ["slt"], skip=1)) == ["slt-1", "slt-2"]
