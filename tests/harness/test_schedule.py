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


def test_reversing_every_other_pass_changes_each_arms_predecessor():
    arms = ["llm", "serve", "no-stack", "opt-in", "ctl"]
    for rotate in (False, True):
        order = [s.arm for s in interleaved(arms, passes=6, rotate_start=rotate, reverse_alternate=True)]
        assert all(order[i * 5:(i + 1) * 5].count(a) == 1 for i in range(6) for a in arms)  # each arm once a pass
        assert all(x != y for x, y in zip(order, order[1:]))  # never twice in a row, across passes too
        before = {a: {order[i - 1] for i in range(1, len(order)) if order[i] == a} for a in arms}
        assert all(len(p) >= 2 for p in before.values()), before
    # Without it, each arm inside a pass always follows the same arm.
    plain = interleaved(arms, passes=6, rotate_start=True)
    inside = {plain[i - 1].arm for i in range(1, len(plain))
              if plain[i].arm == "opt-in" and plain[i - 1].pass_index == plain[i].pass_index}
    assert inside == {"no-stack"}


def test_reversal_keeps_pass_numbers_and_the_plain_order_when_off():
    order = interleaved(["A", "B", "C"], passes=2, reverse_alternate=True)
    assert "".join(s.arm for s in order) == "ABC" "BAC"  # C B A, rotated: C may not follow C
    assert [s.pass_index for s in order] == [1, 1, 1, 2, 2, 2]
    assert interleaved(["A", "B", "C"], passes=2) == interleaved(["A", "B", "C"], passes=2, reverse_alternate=False)
