import pytest

from flashflow.dataflow.waves import stair_steps, wave_stats


def test_h100_ffn_tiles():
    # GEMM0 of Llama-3-8B's FFN at BLOCK_N = 128: 14336 / 128 = 112 tiles on 132 SMs
    st = wave_stats(112, 132)
    assert st.waves == 1
    assert st.last_wave_utilization == pytest.approx(112 / 132)   # 85%
    st = wave_stats(133, 132)
    assert (st.waves, st.last_wave_tiles) == (2, 1)
    assert st.efficiency == pytest.approx(133 / 264)
    assert wave_stats(264, 132).last_wave_utilization == 1.0
    assert wave_stats(200, 66, tiles_per_sm=2).waves == 2
    with pytest.raises(ValueError):
        wave_stats(10, 0)


def test_stair_steps():
    points = stair_steps(1024, range(128, 8193, 128), 128, 128, num_sms=132)
    # 8 row-blocks: a wave of 132 slots holds 16.5 columns of tiles
    waves = [p.waves for p in points]
    assert waves == sorted(waves)
    by_n = {p.N: p for p in points}
    assert by_n[2048].waves == 1 and by_n[2176].waves == 2
    assert by_n[2176].last_wave_utilization == pytest.approx(4 / 132)
    assert all(p.time >= p.ideal_time for p in points)
