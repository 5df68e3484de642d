"""CI's shares of the slow tier: whole files, every test in one share."""

import pytest
import shares


class _Item:
  def __init__(self, nodeid):
    self.nodeid = nodeid


def test_shares_take_whole_files_and_cover_every_test_once():
  items = [_Item(f"tests/test_{f}.py::t{i}") for f in "abcde" for i in range(3)]
  seconds = {item.nodeid: 1.0 for item in items[:12]}  # test_e unstored
  seconds["tests/test_a.py::t0"] = 100.0
  seconds["tests/test_b.py::t0"] = 30.0
  kept = [shares.split(items, (i, 3), seconds)[0] for i in (1, 2, 3)]
  ids = [item.nodeid for share in kept for item in share]
  assert sorted(ids) == sorted(item.nodeid for item in items)
  files = [{i.nodeid.split("::")[0][11:-3] for i in share} for share in kept]
  # Largest first onto the least loaded share: a (102 s) on 1, e (its
  # tests at the stored mean, 11.7 s each: 35 s) on 2, b (32 s) on 3, c
  # (3 s) on 3, then d on the lower of the two tied at 35 s.
  assert files == [{"a"}, {"e", "d"}, {"b", "c"}]
  kept_one, dropped = shares.split(items, (1, 1), seconds)
  assert kept_one == items and dropped == []


@pytest.mark.parametrize(
  "text, message", [("2", "is not 'i/n'"), ("5/4", "i must be in 1..n")]
)
def test_a_bad_share_is_a_usage_error(text, message):
  with pytest.raises(pytest.UsageError, match=message):
    shares.parse(text)
