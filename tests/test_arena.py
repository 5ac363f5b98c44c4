"""The arena allocator on the CPU: fixed reservations, value appends, reports, leases, resizing.

On the CPU ``submit`` reports at once (there is nothing asynchronous to wait for), so every
report is complete when a step ends and the arena may shrink as well as grow. Value demand is
driven by really compressing tensors into ``arena.values`` with the torch codec.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_bitwise_equal, generator, make_input

from bitsparse import TileGeometry, ValueBuffer, compress, decompress
from bitsparse.allocator import Arena, ArenaUsage, Lease
from bitsparse.allocator.arena import GROW_WHEN_ABOVE, HEADROOM, WORD_BYTES

GEOMETRY = TileGeometry()


def relu_like(numel: int, zero_fraction: float, *seed) -> torch.Tensor:
    """A float32 tensor of ``numel`` elements, exactly ``zero_fraction`` of them +0.0, none negative."""
    return make_input(numel, torch.float32, zero_fraction, generator("arena", numel, zero_fraction, *seed), specials=False)


def fixed_words(numel: int) -> int:
    return GEOMETRY.fixed_nbytes(numel) // 4


class Store:
    """Compresses tensors into an arena and records the reports ``submit`` makes."""

    def __init__(self, arena: Arena):
        self.arena = arena
        self.reports: list[tuple[int, int]] = []

    def __call__(self, x: torch.Tensor):
        fixed = self.arena.reserve_fixed(fixed_words(x.numel()))
        assert fixed is not None, "fixed region full"
        report = self.arena.next_report()
        assert report is None, "on the CPU, submit reads the cursor itself"
        c = compress(x, values=self.arena.values, fixed=fixed, backend="torch", geometry=GEOMETRY)
        before = len(self.reports)
        self.arena.submit(lambda start, end: self.reports.append((start, end)))
        assert len(self.reports) == before + 1, "on the CPU, submit reports at once"
        return c


def words_ranges_disjoint(slices) -> bool:
    spans = sorted((s.data_ptr(), s.data_ptr() + s.numel() * s.element_size()) for s in slices)
    return all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


# --------------------------------------------------------------------------------------------
# Construction


def test_initial_layout():
    arena = Arena("cpu", 4096, fixed_fraction=0.25)
    assert arena.device == torch.device("cpu")
    assert arena.capacity_bytes == 4096
    assert arena.fixed_capacity_words == 256
    assert isinstance(arena.values, ValueBuffer)
    # 768 value words, the last one the guard.
    assert arena.values.capacity == 767
    assert arena.values.device == torch.device("cpu")
    assert arena.values.cursor.dtype == torch.int64 and int(arena.values.cursor) == 0
    assert not arena.step_over


def test_capacity_rounds_down_to_words():
    arena = Arena("cpu", 4099)
    assert arena.capacity_bytes == 4096


@pytest.mark.parametrize("capacity", [0, 1, 63, -4096])
def test_capacity_too_small(capacity):
    with pytest.raises(ValueError, match=f"arena capacity must be at least 64 bytes, got {capacity}"):
        Arena("cpu", capacity)


def test_smallest_capacity():
    arena = Arena("cpu", 64)
    assert arena.capacity_bytes == 64
    assert arena.fixed_capacity_words >= 1 and arena.values.capacity >= 0


@pytest.mark.parametrize("fraction", [0, 0.0, 1, 1.0, -0.5, 1.5])
def test_fixed_fraction_out_of_range(fraction):
    with pytest.raises(ValueError, match=f"fixed_fraction must be between 0 and 1, got {fraction}"):
        Arena("cpu", 4096, fixed_fraction=fraction)


@pytest.mark.parametrize("window", [0, -1])
def test_window_too_small(window):
    with pytest.raises(ValueError, match=f"window must be at least 1, got {window}"):
        Arena("cpu", 4096, window=window)


# --------------------------------------------------------------------------------------------
# The fixed region


def test_reserve_fixed_hands_out_consecutive_disjoint_slices():
    arena = Arena("cpu", 4096, fixed_fraction=0.25)  # 256 fixed words
    arena.open_lease()
    sizes = [10, 1, 100, 45, 100]  # 256 in all
    slices = [arena.reserve_fixed(n) for n in sizes]
    assert all(s is not None for s in slices)
    for s, n in zip(slices, sizes):
        assert s.dtype == torch.int32 and s.shape == (n,) and s.device.type == "cpu"
        assert s.is_contiguous()
    # Host-known positions: one after the other, in the fixed region after the value words.
    offsets = [s.storage_offset() for s in slices]
    assert offsets[0] == arena.values.capacity + 1
    assert offsets == [offsets[0] + sum(sizes[:i]) for i in range(len(sizes))]
    assert words_ranges_disjoint(slices)
    # None of them overlaps the value region (words and guard).
    assert words_ranges_disjoint(slices + [arena.values.words])
    # Writing one slice leaves the others alone.
    for i, s in enumerate(slices):
        s.fill_(i + 1)
    for i, s in enumerate(slices):
        assert bool((s == i + 1).all())
    usage = arena.usage()
    assert usage.fixed_used == 256 * WORD_BYTES
    assert usage.fixed_demand == 256 * WORD_BYTES


def test_reserve_fixed_returns_none_when_full_and_counts_demand():
    arena = Arena("cpu", 4096, fixed_fraction=0.25)
    arena.open_lease()
    assert arena.reserve_fixed(200) is not None
    assert arena.reserve_fixed(57) is None  # 257 > 256
    assert arena.reserve_fixed(1000) is None
    last = arena.reserve_fixed(56)  # what is left still fits
    assert last is not None and last.numel() == 56
    assert arena.reserve_fixed(1) is None
    usage = arena.usage()
    assert usage.fixed_used == 256 * WORD_BYTES
    assert usage.fixed_demand == (200 + 57 + 1000 + 56 + 1) * WORD_BYTES


def test_reserve_zero_words():
    arena = Arena("cpu", 4096)
    arena.open_lease()
    empty = arena.reserve_fixed(0)
    assert empty is not None and empty.numel() == 0
    assert arena.usage().fixed_used == 0


def test_reserve_fixed_reuses_a_span_view_across_steps():
    arena = Arena("cpu", 4096, fixed_fraction=0.25, growable=False)  # the same buffer
    lease = arena.open_lease()
    first = [arena.reserve_fixed(n) for n in (10, 20)]
    lease.release()
    arena.open_lease()
    again = [arena.reserve_fixed(n) for n in (10, 20)]
    assert [a is b for a, b in zip(first, again)] == [True, True]  # the same spans, made once
    other = arena.reserve_fixed(5)
    assert other.storage_offset() == again[1].storage_offset() + 20 and other.numel() == 5


def test_start_words_are_distinct_within_a_step_and_grow_for_the_next():
    from bitsparse.allocator.arena import INITIAL_START_SLOTS

    arena = Arena("cpu", 1 << 16)
    lease = arena.open_lease()
    starts = [arena.next_start() for _ in range(INITIAL_START_SLOTS + 3)]
    assert all(s.dtype == torch.int64 and s.shape == (1,) for s in starts)
    assert words_ranges_disjoint(starts)
    lease.release()
    arena.open_lease()
    # The step that needed more made them for the next one: all from one allocation.
    more = [arena.next_start() for _ in range(INITIAL_START_SLOTS + 3)]
    assert len({s.untyped_storage().data_ptr() for s in more}) == 1
    assert words_ranges_disjoint(more)


def test_tensors_compressed_with_start_words_round_trip():
    arena = Arena("cpu", 1 << 20)
    arena.open_lease()
    xs = [relu_like(n, 0.7, n) for n in (5000, 4096, 1)]
    compressed = []
    for x in xs:
        fixed = arena.reserve_fixed(fixed_words(x.numel()))
        compressed.append(compress(x, values=arena.values, fixed=fixed, backend="torch", base=arena.next_start()))
    for x, c in zip(xs, compressed):
        assert_bitwise_equal(decompress(c), x)


# --------------------------------------------------------------------------------------------
# Values and reports


def test_submit_reports_at_once_and_reports_chain():
    arena = Arena("cpu", 1 << 16)
    arena.open_lease()
    store = Store(arena)
    tensors = [relu_like(n, z, i) for i, (n, z) in enumerate([(5000, 0.5), (4096, 0.9), (300, 0.0), (8192, 1.0), (7000, 0.7)])]
    compressed = [store(x) for x in tensors]
    assert store.reports[0][0] == 0
    for (start, end), (next_start, _) in zip(store.reports, store.reports[1:]):
        assert next_start == end
    for c, (start, end) in zip(compressed, store.reports):
        assert int(c.base) == start
        assert end - start == int(c.stream_words())
        assert c.fits()
    assert store.reports[-1][1] == int(arena.values.cursor)
    assert arena.usage().values_demand == store.reports[-1][1] * WORD_BYTES
    for c, x in zip(compressed, tensors):
        assert_bitwise_equal(decompress(c, backend="torch"), x)


def test_submit_without_appending_reports_an_empty_range():
    arena = Arena("cpu", 1 << 16)
    arena.open_lease()
    store = Store(arena)
    store(relu_like(4096, 0.5))
    reports = []
    arena.submit(lambda s, e: reports.append((s, e)))
    end = store.reports[-1][1]
    assert reports == [(end, end)]


def test_overflowing_tensor_does_not_fit_and_earlier_ones_survive():
    # 64 KiB: 4096 fixed words and 12288 value words (12287 usable).
    arena = Arena("cpu", 1 << 16, fixed_fraction=0.25)
    assert arena.values.capacity == 12287
    arena.open_lease()
    store = Store(arena)
    tensors = [relu_like(4096, 0.5, i) for i in range(7)]  # 2048 value words each
    compressed = [store(x) for x in tensors]
    fits = [c.fits() for c in compressed]
    assert fits == [True] * 5 + [False] * 2
    ends = [end for _, end in store.reports]
    assert ends == [2048 * (i + 1) for i in range(7)]
    # The cursor went past the capacity, the demand says how far.
    assert int(arena.values.cursor) == 7 * 2048 > arena.values.capacity
    usage = arena.usage()
    assert usage.values_demand == 7 * 2048 * WORD_BYTES
    for c, x in zip(compressed[:5], tensors[:5]):
        assert_bitwise_equal(decompress(c, backend="torch"), x)


def test_peak_after_overflow_is_at_most_what_the_regions_hold():
    arena = Arena("cpu", 1 << 16, fixed_fraction=0.25)
    arena.open_lease()
    store = Store(arena)
    for i in range(7):
        store(relu_like(4096, 0.5, i))
    usage = arena.usage()
    # Not the whole buffer less the fixed words in use: the unused fixed words are not values.
    assert usage.values_capacity == arena.values.capacity * WORD_BYTES
    assert usage.peak == usage.fixed_used + usage.values_capacity
    assert usage.peak < arena.capacity_bytes


def test_usage_fields_and_peak():
    arena = Arena("cpu", 1 << 16)
    assert isinstance(arena.usage(), ArenaUsage)
    fresh = arena.usage()
    assert (fresh.capacity, fresh.fixed_used, fresh.fixed_demand, fresh.values_demand, fresh.window_waits, fresh.peak) == (
        1 << 16, 0, 0, 0, 0, 0
    )
    assert fresh.values_capacity == arena.values.capacity * WORD_BYTES
    arena.open_lease()
    store = Store(arena)
    c1 = store(relu_like(5000, 0.5))
    c2 = store(relu_like(4096, 0.75))
    usage = arena.usage()
    fixed = fixed_words(5000) + fixed_words(4096)
    assert usage.capacity == arena.capacity_bytes == 1 << 16
    assert usage.fixed_used == usage.fixed_demand == fixed * WORD_BYTES
    assert usage.values_demand == int(c1.stream_words() + c2.stream_words()) * WORD_BYTES
    assert usage.window_waits == 0  # nothing asynchronous on the CPU
    assert usage.peak == usage.fixed_used + usage.values_demand
    assert usage.fixed_used + usage.values_demand == c1.nbytes + c2.nbytes


# --------------------------------------------------------------------------------------------
# Leases and steps


def test_step_over_only_after_every_lease_is_released():
    arena = Arena("cpu", 4096)
    leases = [arena.open_lease() for _ in range(3)]
    assert all(isinstance(lease, Lease) for lease in leases)
    for lease in leases[:-1]:
        lease.release()
        assert not arena.step_over
    # Releasing twice counts once.
    leases[0].release()
    leases[1].release()
    assert not arena.step_over
    leases[-1].release()
    assert arena.step_over
    leases[-1].release()
    assert arena.step_over


def test_leases_opened_during_a_step_keep_it_going():
    arena = Arena("cpu", 4096)
    a = arena.open_lease()
    b = arena.open_lease()
    a.release()
    c = arena.open_lease()  # the step is not over: nothing is reset
    assert not arena.step_over
    b.release()
    assert not arena.step_over
    c.release()
    assert arena.step_over


def test_next_lease_resets_cursor_and_fixed_usage():
    arena = Arena("cpu", 1 << 16, growable=False)
    lease = arena.open_lease()
    store = Store(arena)
    first = arena.reserve_fixed(100)
    store(relu_like(4096, 0.5))
    assert int(arena.values.cursor) > 0 and arena.usage().fixed_used > 0
    # While the step lasts nothing is reset, even by new leases.
    extra = arena.open_lease()
    assert int(arena.values.cursor) > 0
    extra.release()
    lease.release()
    assert arena.step_over
    # Releasing the last lease resets nothing yet: the contents stay readable...
    assert int(arena.values.cursor) > 0
    # ...until the next step's first lease.
    arena.open_lease()
    assert not arena.step_over
    assert int(arena.values.cursor) == 0
    usage = arena.usage()
    assert (usage.fixed_used, usage.fixed_demand, usage.values_demand) == (0, 0, 0)
    again = arena.reserve_fixed(100)
    assert again.data_ptr() == first.data_ptr()
    # The first report of the new step starts at 0.
    store.reports.clear()
    store(relu_like(4096, 0.5, "next"))
    assert store.reports[0][0] == 0


def test_compressed_tensors_of_a_step_survive_until_its_end():
    arena = Arena("cpu", 1 << 16)
    lease = arena.open_lease()
    store = Store(arena)
    tensors = [relu_like(4096, z) for z in (0.3, 0.6, 0.9)]
    compressed = [store(x) for x in tensors]
    # Nothing that happens to leases within the step disturbs the stored values.
    for _ in range(3):
        arena.open_lease().release()
    for c, x in zip(compressed, tensors):
        assert_bitwise_equal(decompress(c, backend="torch"), x)
    lease.release()
    for c, x in zip(compressed, tensors):
        assert_bitwise_equal(decompress(c, backend="torch"), x)


# --------------------------------------------------------------------------------------------
# Growing and shrinking between steps


def assert_all_fit_exactly(compressed, tensors) -> None:
    """Every tensor's values were written, and it decodes to the original bit for bit."""
    assert all(c.fits() for c in compressed)
    for c, x in zip(compressed, tensors):
        assert_bitwise_equal(decompress(c, backend="torch"), x)


def run_step(arena: Arena, tensors=(), extra_fixed_words: int = 0) -> ArenaUsage:
    """One step: a lease, reservations and compressions, then the lease released."""
    lease = arena.open_lease()
    store = Store(arena) if tensors else None
    for x in tensors:
        store(x)
    if extra_fixed_words:
        arena.reserve_fixed(extra_fixed_words)
    usage = arena.usage()
    lease.release()
    return usage


def test_values_grow_after_an_overflow():
    arena = Arena("cpu", 1 << 16, fixed_fraction=0.25)
    tensors = [relu_like(4096, 0.5, i) for i in range(7)]
    usage = run_step(arena, tensors)
    demand_words = usage.values_demand // WORD_BYTES
    assert demand_words == 7 * 2048 > arena.values.capacity
    # Resizing happens when the next step begins.
    assert arena.values.capacity == 12287
    arena.open_lease()
    assert arena.values.capacity >= HEADROOM * demand_words
    assert int(arena.values.cursor) == 0
    # Now everything of that size fits.
    store = Store(arena)
    assert_all_fit_exactly([store(x) for x in tensors], tensors)


def test_values_grow_at_91_percent_without_overflow():
    arena = Arena("cpu", 1 << 16, fixed_fraction=0.25)  # 12288 value words
    # 11264 words (91.7%) that all fit.
    tensors = [relu_like(4096, 0.5, i) for i in range(5)] + [relu_like(2048, 0.5, "top")]
    usage = run_step(arena, tensors)
    demand_words = usage.values_demand // WORD_BYTES
    assert demand_words == 11264 <= arena.values.capacity
    assert demand_words > GROW_WHEN_ABOVE * (arena.values.capacity + 1)
    arena.open_lease()
    assert arena.values.capacity >= HEADROOM * demand_words


def test_fixed_region_grows_after_a_refused_reservation():
    arena = Arena("cpu", 4096, fixed_fraction=0.25)  # 256 fixed words
    lease = arena.open_lease()
    assert arena.reserve_fixed(200) is not None
    assert arena.reserve_fixed(300) is None
    lease.release()
    demand = 500
    arena.open_lease()
    assert arena.fixed_capacity_words >= HEADROOM * demand
    assert arena.reserve_fixed(200) is not None
    assert arena.reserve_fixed(300) is not None


def test_fixed_region_grows_when_close_to_full():
    arena = Arena("cpu", 4096, fixed_fraction=0.25)  # 256 fixed words
    run_step(arena, extra_fixed_words=240)  # 93.75%
    arena.open_lease()
    assert arena.fixed_capacity_words >= HEADROOM * 240


def test_no_resize_between_half_and_ninety_percent():
    arena = Arena("cpu", 1 << 16, fixed_fraction=0.25)  # 4096 fixed, 12288 value words
    buffer_ptr = arena.values.words.data_ptr()
    # Values: 3 * 2048 + 2048 = 8192 words (67%); fixed: 4 * 129 + 2500 = 3016 words (74%).
    tensors = [relu_like(4096, 0.5, i) for i in range(4)]
    usage = run_step(arena, tensors, extra_fixed_words=2500)
    assert usage.values_demand == 8192 * WORD_BYTES
    assert usage.fixed_demand == (4 * fixed_words(4096) + 2500) * WORD_BYTES
    arena.open_lease()
    assert arena.capacity_bytes == 1 << 16
    assert arena.fixed_capacity_words == 4096
    assert arena.values.capacity == 12287
    assert arena.values.words.data_ptr() == buffer_ptr


def test_shrinks_when_demand_is_under_half():
    arena = Arena("cpu", 1 << 20, fixed_fraction=0.25)  # 65536 fixed, 196608 value words
    tensors = [relu_like(4096, 0.5, i) for i in range(3)]
    usage = run_step(arena, tensors)
    values_words = usage.values_demand // WORD_BYTES
    fixed = usage.fixed_demand // WORD_BYTES
    assert values_words == 3 * 2048 and fixed == 3 * fixed_words(4096)
    arena.open_lease()
    assert arena.capacity_bytes < 1 << 20
    assert HEADROOM * fixed <= arena.fixed_capacity_words < 65536
    assert HEADROOM * values_words <= arena.values.capacity < 196607
    # A shrunk arena is big enough for the same step again, without growing.
    store = Store(arena)
    assert_all_fit_exactly([store(x) for x in tensors], tensors)


def test_resized_regions_are_exactly_demand_times_headroom():
    arena = Arena("cpu", 1 << 20, fixed_fraction=0.25)
    usage = run_step(arena, [relu_like(4096, 0.5)])
    arena.open_lease()
    fixed = usage.fixed_demand // WORD_BYTES
    values = usage.values_demand // WORD_BYTES
    assert arena.fixed_capacity_words == max(8, math.ceil(fixed * HEADROOM))
    # The value region includes its guard word.
    assert arena.values.capacity + 1 == max(8, math.ceil((values + 1) * HEADROOM))


def test_a_step_without_demand_does_not_resize():
    arena = Arena("cpu", 1 << 20)
    run_step(arena)
    arena.open_lease()
    assert arena.capacity_bytes == 1 << 20


def test_not_growable_never_resizes():
    arena = Arena("cpu", 1 << 16, fixed_fraction=0.25, growable=False)
    buffer_ptr = arena.values.words.data_ptr()
    tensors = [relu_like(4096, 0.5, i) for i in range(7)]
    run_step(arena, tensors, extra_fixed_words=10_000)  # both regions overflow
    lease = arena.open_lease()
    assert arena.capacity_bytes == 1 << 16
    assert arena.fixed_capacity_words == 4096
    assert arena.values.capacity == 12287
    assert arena.values.words.data_ptr() == buffer_ptr
    lease.release()
    run_step(arena, tensors[:1])  # far under half: no shrinking either
    arena.open_lease()
    assert arena.capacity_bytes == 1 << 16


def test_growth_keeps_the_last_report_chain_per_step():
    arena = Arena("cpu", 4096, fixed_fraction=0.25)
    # The second tensor is all zeros: it needs fixed words but no value words.
    tensors = [relu_like(4096, 0.5), relu_like(4096, 1.0)]
    # Step 1: the fixed region (256 words) takes only one tensor (129 words).
    lease = arena.open_lease()
    store = Store(arena)
    store(tensors[0])
    assert arena.reserve_fixed(fixed_words(4096)) is None
    lease.release()
    # Step 2: grown; both fit, and reports start again at 0.
    arena.open_lease()
    assert arena.fixed_capacity_words >= HEADROOM * 2 * fixed_words(4096)
    store = Store(arena)
    compressed = [store(x) for x in tensors]
    assert store.reports == [(0, 2048), (2048, 2048)]
    assert_all_fit_exactly(compressed, tensors)


# --------------------------------------------------------------------------------------------
# CUDA: reports through pinned memory


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("window", [1, 3])
def test_cuda_reports_arrive_through_report_slots(window):
    arena = Arena("cuda", 64 << 20, window=window)
    arena.open_lease()
    reports, compressed = [], []
    tensors = [relu_like(n, 0.5, n).cuda() for n in (4096, 100_000, 1, 300_000, 4096 * 7)]
    for x in tensors:
        fixed = arena.reserve_fixed(fixed_words(x.numel()))
        report = arena.next_report()
        compressed.append(compress(x, values=arena.values, fixed=fixed, report=report))
        arena.submit(lambda start, end: reports.append((start, end)))
        assert len(arena._pending) <= window  # older appends were waited for
    arena.drain()
    ends = [end for _, end in reports]
    assert [start for start, _ in reports] == [0] + ends[:-1]
    assert ends == [int(c.base) + int(c.stream_words()) for c in compressed] and ends[-1] == int(arena.values.cursor)
    assert arena.usage().values_demand == ends[-1] * WORD_BYTES
    for c, x in zip(compressed, tensors):
        assert_bitwise_equal(decompress(c), x)
