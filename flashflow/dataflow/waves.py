"""Waves and tails: how many tiles run at once, and how full the last wave is.

A launch of T equal tiles on S slots (SMs × resident tiles per SM) takes ceil(T/S) waves; the
last one is (T mod S)/S full. Time moves in steps: as N grows, the tile count grows smoothly
but the latency jumps by a whole wave each time T crosses a multiple of S — the stair-step
curve that makes an N just above a wave boundary cost nearly a whole extra wave.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from flashflow.device import cdiv


@dataclass(frozen=True)
class WaveStats:
    tiles: int
    slots: int

    @property
    def waves(self) -> int:
        return cdiv(self.tiles, self.slots)

    @property
    def last_wave_tiles(self) -> int:
        rest = self.tiles % self.slots
        return rest if rest else min(self.tiles, self.slots)

    @property
    def last_wave_utilization(self) -> float:
        return self.last_wave_tiles / self.slots

    @property
    def efficiency(self) -> float:
        """Tiles run / slot-waves paid for: 1.0 means no idle SM in any wave."""
        return self.tiles / (self.waves * self.slots) if self.tiles else 1.0


def wave_stats(tiles: int, num_sms: int, tiles_per_sm: int = 1) -> WaveStats:
    if tiles < 0 or num_sms <= 0 or tiles_per_sm <= 0:
        raise ValueError(f"need tiles >= 0 and positive num_sms, tiles_per_sm; got "
                         f"{tiles}, {num_sms}, {tiles_per_sm}")
    return WaveStats(tiles, num_sms * tiles_per_sm)


@dataclass(frozen=True)
class StairPoint:
    N: int
    tiles: int
    waves: int
    last_wave_utilization: float
    time: float          # in units of one tile's run time (every tile costs the same)
    ideal_time: float    # tiles / slots: the time with perfect load balance


def stair_steps(M: int, n_values: Iterable[int], block_m: int, block_n: int,
                num_sms: int, tiles_per_sm: int = 1) -> list[StairPoint]:
    """Latency of an M×N GEMM as N grows: waves × one tile's time."""
    out = []
    tiles_m = cdiv(M, block_m)
    for n in n_values:
        st = wave_stats(tiles_m * cdiv(n, block_n), num_sms, tiles_per_sm)
        out.append(StairPoint(n, st.tiles, st.waves, st.last_wave_utilization, float(st.waves),
                              st.tiles / st.slots))
    return out
