import pytest

import stableattn as sa


def test_tiles_from_sram_follow_flashattention1():
  # M = 16K elements, d = 64: B_c = ceil(16384 / 256) = 64, B_r = min(64, 64).
  tiles = sa.tiles_from_sram(16384, 64)
  assert (tiles.block_q, tiles.block_k) == (64, 64)
  # d = 128: B_c = 32, B_r = min(32, 128) = 32.
  tiles = sa.tiles_from_sram(16384, 128)
  assert (tiles.block_q, tiles.block_k) == (32, 32)
  # Large SRAM: B_r is capped at d.
  tiles = sa.tiles_from_sram(100_000, 32)
  assert (tiles.block_q, tiles.block_k) == (32, 782)


@pytest.mark.parametrize("bad", [0, -4, 2.5, True])
def test_tiles_from_sram_rejects_bad_sizes(bad):
  with pytest.raises(ValueError, match="positive integer"):
    sa.tiles_from_sram(bad, 64)
