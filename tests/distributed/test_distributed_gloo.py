"""The gloo harness of this folder (tests/distributed/gloo.py) reports what its ranks did: a
failing rank's assertion, a rank that dies without a word, a rank stuck waiting for them (killed
after the grace period), and a rank that passed and then crashed in its teardown (passed: the
report came first). The bodies import no flashflow: each run costs a spawn only."""
import os
import signal

import pytest
import torch.distributed as dist

import gloo

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed's gloo backend")


def mixed_outcomes(rank, world):
    import time

    if rank == 1:
        assert world == 99, "rank one disagrees"
    if rank == 2:
        os._exit(3)   # no report, no teardown
    if rank == 3:
        time.sleep(600)   # a hang
    time.sleep(1.0)
    raise RuntimeError("rank zero lost a peer")   # what a collective with a dead peer raises, later


def test_failures_reach_pytest_in_the_order_they_happened():
    with pytest.raises(gloo.RankFailed) as info:
        gloo.run(4, mixed_outcomes, grace=2.0)
    text = str(info.value)
    assert "rank 1 of 4 failed" in text and "AssertionError: rank one disagrees" in text, text
    assert "rank 2 of 4 never reported (exit status 3)" in text, text
    assert "rank 3 of 4 never reported (killed 2 s after another rank failed" in text, text
    assert "rank 0 of 4 failed" in text and "RuntimeError: rank zero lost a peer" in text, text
    assert text.index("rank 1 of 4 failed") < text.index("rank 0 of 4 failed"), text


def passes_then_aborts_in_teardown(rank, world):
    dist.destroy_process_group = os.abort   # a crash after the report: what gloo's exit race looks like
    return {"rank": rank, "world": world}


def test_a_rank_that_reported_success_passes_whatever_its_teardown_does():
    with pytest.warns(UserWarning, match=f"rank 0: exit status {-signal.SIGABRT}"):
        reports = gloo.run(2, passes_then_aborts_in_teardown)
    assert [rep["result"] for rep in reports] == [{"rank": r, "world": 2} for r in range(2)]
    assert [rep["exitcode"] for rep in reports] == [-signal.SIGABRT] * 2


def test_a_nested_function_is_refused_before_spawning():
    def nested(rank, world):
        pass

    with pytest.raises(ValueError, match="must be module-level"):
        gloo.run(2, nested)
