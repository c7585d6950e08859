from vllm_omni_edge_bench.harness.schedule import interleaved


def test_interleaved_runs_every_arm_once_per_pass_in_grid_order():
    order = interleaved(["A", "B", "C"], passes=3)
    assert [s.arm for s in order] == list("ABCABCABC")
    assert [s.pass_index for s in order] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert [s.seq for s in order] == list(range(1, 10))


def test_rotation_moves_the_first_arm_each_pass():
    order = interleaved(["A", "B", "C"], passes=4, rotate_start=True)
    assert "".join(s.arm for s in order) == "ABC" "BCA" "CAB" "ABC"


def test_schedule_is_deterministic_and_stems_sort_by_pass():
    first = interleaved(["ctl", "x"], passes=12, rotate_start=True)
    assert first == interleaved(["ctl", "x"], passes=12, rotate_start=True)
    assert first[-1].stem == "12-ctl"  # rotation: pass 12 starts with x, ends with ctl
    assert first[0].stem == "01-ctl"


def test_no_arm_runs_twice_in_a_row_across_passes_without_rotation():
    order = [s.arm for s in interleaved(["A", "B"], passes=5)]
    assert all(x != y for x, y in zip(order, order[1:]))
