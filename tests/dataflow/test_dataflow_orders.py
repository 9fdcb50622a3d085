import pytest

from flashflow.dataflow import orders


GRIDS = [(1, 1), (2, 3), (4, 4), (5, 3), (3, 7), (8, 8)]


@pytest.mark.parametrize("spec", ["row_major", "column_major", "snake", "grouped_m:2",
                                  "grouped_m:8", "cutlass_swizzle:2", "cutlass_swizzle:4",
                                  "hilbert", "morton"])
@pytest.mark.parametrize("grid", GRIDS)
def test_every_named_order_is_a_permutation(spec, grid):
    order = orders.make_order(spec, *grid)
    assert sorted(order) == orders.row_major(*grid)


def test_small_orders_by_hand():
    assert orders.row_major(2, 2) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert orders.column_major(2, 2) == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert orders.snake(2, 3) == [(0, 0), (0, 1), (0, 2), (1, 2), (1, 1), (1, 0)]
    # Triton's grouping with GROUP_SIZE_M = 2 on a 3x2 grid: strip of rows 0-1 walked column
    # by column (m fastest), then the last row alone
    assert orders.grouped_m(3, 2, 2) == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (2, 1)]
    # CUTLASS swizzle of width 2 on a 2x3 grid: strips of 2 columns, row-major in a strip
    assert orders.cutlass_swizzle(2, 3, 2) == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (1, 2)]
    assert orders.hilbert(2, 2) == [(0, 0), (0, 1), (1, 1), (1, 0)]
    assert orders.morton(2, 2) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_hilbert_steps_are_neighbours_on_power_of_two_grids():
    order = orders.hilbert(8, 8)
    for (m0, n0), (m1, n1) in zip(order, order[1:]):
        assert abs(m0 - m1) + abs(n0 - n1) == 1


def test_group_of_one_is_row_major_and_whole_grid_group_is_column_major():
    assert orders.grouped_m(4, 5, 1) == orders.row_major(4, 5)
    assert orders.grouped_m(4, 5, 4) == orders.column_major(4, 5)
    assert orders.cutlass_swizzle(4, 5, 1) == orders.column_major(4, 5)


def test_permutation_round_trip():
    order = orders.make_order("grouped_m:2", 3, 4)
    perm = orders.to_permutation(order, 4)
    assert orders.from_permutation(perm, 3, 4) == order
    with pytest.raises(ValueError, match="twice"):
        orders.from_permutation([0, 0, 1, 2], 2, 2)
    with pytest.raises(ValueError, match="tiles"):
        orders.from_permutation([0, 1, 2], 2, 2)


def test_bad_specs_and_tiles():
    with pytest.raises(ValueError, match="order must be one of"):
        orders.make_order("zigzag", 2, 2)
    with pytest.raises(ValueError, match="takes no parameter"):
        orders.make_order("snake:2", 2, 2)
    with pytest.raises(ValueError, match="outside"):
        orders.validate([(2, 0)], 2, 2)
    with pytest.raises(ValueError, match="pairs"):
        orders.validate([5], 2, 2)
