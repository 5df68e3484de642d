"""The 2-D map's predictions against audits on captured tensors."""

from stableattn.auditing import map_check

DATA = {
  "regions": {
    "pallas bf16-fa2": {
      "corners": [
        {"max_logit": 10.0, "near_tied_share": 0.3, "missed": {},
         "missed_of_cases": [1, 1]},
      ],
      "cases": 4,
      "missed": 1,
    }
  }
}  # fmt: skip


def test_each_layer_lands_in_one_cell_of_the_confusion_table():
  points = {
    "a": {"max_logit": 500.0, "near_tied_share": 0.9},  # in, missed: hit
    "b": {"max_logit": 500.0, "near_tied_share": 0.5},  # in, passed
    "c": {"max_logit": 5.0, "near_tied_share": 0.9},  # out, missed
    "d": {"max_logit": 900.0, "near_tied_share": 0.0},  # out, passed
  }
  misses = {"pallas bf16-fa2": {"a": True, "b": False, "c": True, "d": False}}
  found = map_check.confusion(points, misses, DATA)["pallas bf16-fa2"]
  assert (
    found["hit"],
    found["false_alarm"],
    found["missed"],
    found["quiet"],
  ) == (
    1,
    1,
    1,
    1,
  )
  assert found["false_alarm_rate"] == 0.5
  assert (
    found["layers"]["b"]["predicted"] and not found["layers"]["b"]["measured"]
  )
  table = map_check.confusion_table({"pallas bf16-fa2": found})
  assert "| pallas bf16-fa2 | 1 | 1 | 1 | 1 | 0.50 |" in table
