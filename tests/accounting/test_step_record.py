"""One accountant step-record type, normalised once, and the explicit PRV step interface."""

import dataclasses

import pytest

from opacus_rc.accounting import RCPRVAccountant, StepRecord, sketch_record
from opacus_rc.accounting.multiplicity import AccumulatedStepPRV
from opacus_rc.accounting.prv import DETERMINISTIC, StepPRV
from opacus_rc.accounting.prv.prvs import PRVStep
from opacus_rc.config import SketchConfig


def test_record_is_frozen_hashable_and_reads_every_stored_form():
    record = StepRecord.from_config(SketchConfig(sketch_size=8), micro_batches=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.sketch_size = 4
    assert {record: 1}[StepRecord.of(record.as_dict())] == 1  # round trip, same key
    assert record.as_dict() == {"estimator": "hutchinson", "sketch_size": 8,
                                "sketching": "per_example", "micro_batches": 3}
    legacy = StepRecord.of({"accounting_sketch_count": 8, "estimator": "hutchinson"})
    assert (legacy.sketch_size, legacy.sketching) == (8, "shared")  # unnamed: the larger epsilon
    assert StepRecord.of(None) == StepRecord() and not StepRecord().randomized
    assert StepRecord.of({"micro_batches": 2}).as_dict() == {"micro_batches": 2}
    assert sketch_record(SketchConfig(sketch_size=8), micro_batches=3) == record.as_dict()
    with pytest.raises(ValueError, match="micro_batches"):
        StepRecord.of({"sketch_size": 8, "micro_batches": 0})
    with pytest.raises(ValueError, match="sketching"):
        StepRecord.of({"sketch_size": 8, "sketching": "other"})


def test_equal_steps_merge_history_holds_records_and_state_dict_plain_dicts():
    acc = RCPRVAccountant()
    for _ in range(3):
        acc.step(noise_multiplier=1.0, sample_rate=0.1, sketch_config=SketchConfig(sketch_size=8))
    (entry,) = acc.history
    assert entry[2] == 3 and entry[3] == StepRecord.from_config(SketchConfig(sketch_size=8))
    assert acc.state_dict()["history"] == [(1.0, 0.1, 3, entry[3].as_dict())]
    restored = RCPRVAccountant()
    restored.load_state_dict({"history": [(1.0, 0.1, 3, {"sketch_size": 8}), (1.0, 0.1, 2)],
                              "mechanism": "rc_prv"})
    assert [e[3] for e in restored.history] == [StepRecord("hutchinson", 8, "shared"), StepRecord()]
    with pytest.raises(ValueError, match="sketching"):
        restored.load_state_dict({"history": [(1.0, 0.1, 3, {"sketch_size": 8, "sketching": "x"})],
                                  "mechanism": "rc_prv"})


def test_both_step_kinds_implement_the_prv_step_interface():
    assert isinstance(StepPRV(1.0, 0.1, DETERMINISTIC), PRVStep)
    assert isinstance(AccumulatedStepPRV(1.0, 0.1, 2, DETERMINISTIC), PRVStep)
