"""The arena allocator on the CPU: fixed reservations, value appends, reports, leases, resizing.

On the CPU ``submit`` reports at once (there is nothing asynchronous to wait for), except in
an arena made ``asynchronous``, which reports through slots as on CUDA: the last tests drive
that path with a simulated device and with the torch codec (and with the Triton codec on
CUDA). Value demand is driven by really compressing (or measuring) tensors into the arena
with the torch codec.
"""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch
from helpers import NoRoomForBuffers, assert_bitwise_equal, generator, make_input

from bitsparse import TileGeometry, ValueBuffer, compress, decompress
from bitsparse.allocator import Arena, ArenaPool, ArenaUsage, Lease, mapped
from bitsparse.allocator import arena as arena_module
from bitsparse.allocator.arena import (
    ALIGN_WORDS,
    DEMAND_STEPS,
    GROW_WHEN_ABOVE,
    HEADROOM,
    START_SLOTS,
    WORD_BYTES,
)
from bitsparse.codecs import torch_codec
from bitsparse.compressed import compress_into
from bitsparse.format import dtype_spec

GEOMETRY = TileGeometry()
COUNTER_BYTES = 4 * 8
"""The arena's cursor, the encoders' two scratch words and the tally, made with its buffer."""


def relu_like(numel: int, zero_fraction: float, *seed) -> torch.Tensor:
    """A float32 tensor of ``numel`` elements, exactly ``zero_fraction`` of them +0.0, none negative."""
    return make_input(
        numel, torch.float32, zero_fraction, generator("arena", numel, zero_fraction, *seed), specials=False
    )


def fixed_words(numel: int) -> int:
    return GEOMETRY.fixed_nbytes(numel) // 4


class Store:
    """Compresses (or, without room, measures) tensors into an arena and records the
    reports ``submit`` makes."""

    def __init__(self, arena: Arena):
        self.arena = arena
        self.reports: list[tuple[int, int]] = []

    def __call__(self, x: torch.Tensor):
        fixed = self.arena.reserve_fixed(fixed_words(x.numel()))
        if fixed is None and self.arena.cursor is None:  # no buffer: measured in host memory
            tile_words = self.arena.next_measure(GEOMETRY.num_tiles(x.numel()))
            torch_codec.measure_tiles(x, tile_words, dtype_spec(x.dtype), GEOMETRY, False)
            number = self.arena.submit_measure(tile_words)
            self.arena.drain()
            ends = self.arena.ends()
            self.reports.append((ends[number - 1] if number else 0, ends[number]))
            return None
        max_words = GEOMETRY.max_stream_words(x.numel(), 32)
        slot, report, sure = self.arena.next_report(max_words, max_words if fixed is not None else 0)
        assert (report, sure) == (None, False), "on the CPU, submit reads the cursor itself"
        if fixed is None:
            torch_codec.measure(x, self.arena.cursor, self.arena.appends, dtype_spec(x.dtype), GEOMETRY, False)
            c = None
        else:
            base = self.arena.next_start()
            c = compress_into(x, torch_codec, GEOMETRY, self.arena.values, fixed, False, base=base)
        before = len(self.reports)
        number = self.arena.submit(slot, lambda start, end: self.reports.append((start, end)))
        assert len(self.reports) == before + 1, "on the CPU, submit reports at once"
        ends = self.arena.ends()
        assert number == len(ends) - 1 and self.reports[-1] == (ends[number - 1] if number else 0, ends[number])
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
    assert arena.values.capacity == arena.values_capacity_words == 767
    assert arena.values.device == torch.device("cpu")
    assert arena.cursor.dtype == torch.int64 and int(arena.cursor) == 0
    assert arena.values.cursor.data_ptr() == arena.cursor.data_ptr()
    assert arena.reserved_bytes == 4096 + COUNTER_BYTES + 8 * START_SLOTS
    assert not arena.leased


def test_an_arena_without_capacity_holds_nothing():
    """No buffer, no counters or start words either: a first step's arena holds no memory."""
    arena = Arena("cpu")
    assert arena.capacity_bytes == 0 and arena.values is None and arena.fixed_capacity_words == 0
    assert arena.reserved_bytes == 0 and arena.cursor is None and arena.tally is None
    assert arena.reserve_fixed(1) is None
    assert arena.usage().fixed_demand == WORD_BYTES
    arena.resize(4096)
    assert arena.reserved_bytes == 4096 + COUNTER_BYTES + 8 * START_SLOTS
    arena.resize(0)
    assert arena.reserved_bytes == 0 and arena.cursor is None


def test_capacity_rounds_down_to_words():
    arena = Arena("cpu", 4099)
    assert arena.capacity_bytes == 4096


@pytest.mark.parametrize("capacity", [1000, 10_000, 4096 + 20])
def test_a_fixed_region_of_unaligned_size_keeps_the_buffer_within_the_capacity(capacity):
    # The value region starts at a multiple of ALIGN_WORDS: the words skipped count too.
    arena = Arena("cpu", capacity)
    assert arena.fixed_capacity_words % ALIGN_WORDS != 0
    assert arena.capacity_bytes == capacity


def test_negative_capacity():
    with pytest.raises(ValueError, match="arena capacity must be >= 0 bytes, got -4096"):
        Arena("cpu", -4096)


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
    sizes = [10, 1, 100, 45, 100]  # 256 in all
    slices = [arena.reserve_fixed(n) for n in sizes]
    assert all(s is not None for s in slices)
    for s, n in zip(slices, sizes):
        assert s.dtype == torch.int32 and s.shape == (n,) and s.device.type == "cpu"
        assert s.is_contiguous()
    # Host-known positions: one after the other, in the fixed region before the value words.
    offsets = [s.storage_offset() for s in slices]
    assert offsets[0] == 0 and arena.values.words.storage_offset() == arena.fixed_capacity_words
    assert offsets == [offsets[0] + sum(sizes[:i]) for i in range(len(sizes))]
    assert words_ranges_disjoint(slices)
    # None of them overlaps the value region (words and guard).
    assert words_ranges_disjoint(slices + [arena.values.words])
    for i, s in enumerate(slices):
        s.fill_(i + 1)
    for i, s in enumerate(slices):
        assert bool((s == i + 1).all())
    usage = arena.usage()
    assert usage.fixed_used == usage.fixed_demand == 256 * WORD_BYTES


def test_reserve_fixed_returns_none_when_full_and_counts_demand():
    arena = Arena("cpu", 4096, fixed_fraction=0.25)
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
    empty = arena.reserve_fixed(0)
    assert empty is not None and empty.numel() == 0
    assert arena.usage().fixed_used == 0


def test_reserve_fixed_reuses_a_span_view_across_steps():
    arena = Arena("cpu", 4096, fixed_fraction=0.25, growable=False)  # the same buffer
    first = [arena.reserve_fixed(n) for n in (10, 20)]
    assert arena.begin_step(0, 0)
    again = [arena.reserve_fixed(n) for n in (10, 20)]
    assert [a is b for a, b in zip(first, again)] == [True, True]  # the same spans, made once
    other = arena.reserve_fixed(5)
    assert other.storage_offset() == again[1].storage_offset() + 20 and other.numel() == 5


def test_start_words_are_distinct_within_a_step_and_grow_for_the_next():
    arena = Arena("cpu", 1 << 16, growable=False)  # the same buffer
    store = Store(arena)
    for i in range(START_SLOTS + 3):
        store(relu_like(1, 0.0, i))
    starts = [arena.next_start() for _ in range(3)]
    assert all(s.dtype == torch.int64 and s.shape == (1,) for s in starts)
    assert arena.begin_step(0, 0)
    # The step that needed more made them for the next one: all from one allocation.
    more = [arena.next_start() for _ in range(START_SLOTS + 3)]
    assert len({s.untyped_storage().data_ptr() for s in more}) == 1
    assert words_ranges_disjoint(more)


# --------------------------------------------------------------------------------------------
# Values and reports


def test_submit_reports_at_once_and_reports_chain():
    arena = Arena("cpu", 1 << 16)
    store = Store(arena)
    tensors = [
        relu_like(n, z, i) for i, (n, z) in enumerate([(5000, 0.5), (4096, 0.9), (300, 0.0), (8192, 1.0), (7000, 0.7)])
    ]
    compressed = [store(x) for x in tensors]
    assert store.reports[0][0] == 0
    for (start, end), (next_start, _) in zip(store.reports, store.reports[1:]):
        assert next_start == end
    for c, (start, end) in zip(compressed, store.reports):
        assert int(c.base) == start
        assert end - start == int(c.stream_words())
        assert c.fits()
    assert store.reports[-1][1] == int(arena.cursor)
    assert arena.usage().values_demand == store.reports[-1][1] * WORD_BYTES
    for c, x in zip(compressed, tensors):
        assert_bitwise_equal(decompress(c, backend="torch"), x)


def test_submit_without_appending_reports_an_empty_range():
    arena = Arena("cpu", 1 << 16)
    store = Store(arena)
    store(relu_like(4096, 0.5))
    reports = []
    slot, _, _ = arena.next_report(0, 0)
    arena.submit(slot, lambda s, e: reports.append((s, e)))
    end = store.reports[-1][1]
    assert reports == [(end, end)]


def test_overflowing_tensor_does_not_fit_and_earlier_ones_survive():
    # 64 KiB: 4096 fixed words and 12288 value words (12287 usable).
    arena = Arena("cpu", 1 << 16, fixed_fraction=0.25)
    assert arena.values.capacity == 12287
    store = Store(arena)
    tensors = [relu_like(4096, 0.5, i) for i in range(7)]  # 2048 value words each
    compressed = [store(x) for x in tensors]
    assert [c.fits() for c in compressed] == [True] * 5 + [False] * 2
    assert [end for _, end in store.reports] == [2048 * (i + 1) for i in range(7)]
    # The cursor went past the capacity, the demand says how far.
    assert int(arena.cursor) == 7 * 2048 > arena.values.capacity
    assert arena.usage().values_demand == 7 * 2048 * WORD_BYTES
    for c, x in zip(compressed[:5], tensors[:5]):
        assert_bitwise_equal(decompress(c, backend="torch"), x)


def test_measured_tensors_move_the_cursor_as_stored_ones_would():
    empty, roomy = Arena("cpu"), Arena("cpu", 1 << 20)
    tensors = [relu_like(n, z, i) for i, (n, z) in enumerate([(5000, 0.5), (4096, 0.9), (8192, 1.0)])]
    measured, stored = Store(empty), Store(roomy)
    assert [measured(x) for x in tensors] == [None] * 3  # no room: only measured
    compressed = [stored(x) for x in tensors]
    assert measured.reports == stored.reports
    assert [end - start for start, end in measured.reports] == [int(c.stream_words()) for c in compressed]
    assert empty.usage().values_demand == roomy.usage().values_demand
    assert empty.usage().fixed_demand == roomy.usage().fixed_demand


def test_a_step_that_measured_without_a_buffer_stores_in_one_from_the_next_step_on():
    """Measured without a buffer (in host memory), then given one in the same step: the
    buffer's cursor would start past the values measured, so the step measures on and lets
    it go, as it does a buffer its tensors do not fit in; the next step stores from its start."""
    arena = Arena("cpu")
    store = Store(arena)
    tensors = [relu_like(5000, 0.5, i) for i in range(2)] + [relu_like(4096, 0.5)]
    assert [store(x) for x in tensors[:2]] == [None, None]
    arena.resize(1 << 16)
    assert store(tensors[2]) is None and arena.reserved_bytes == 0
    assert store.reports[-1][0] == store.reports[-2][1]  # measured on from the last end
    assert arena.begin_step(*demand(arena))
    store = Store(arena)
    compressed = [store(x) for x in tensors]
    assert_all_fit_exactly(compressed, tensors)
    assert int(compressed[0].base) == 0


def test_a_buffer_no_tensor_of_a_step_fits_in_is_let_go_until_one_does():
    """A step of tensors each larger than the buffer (a batch far larger than the recent
    steps that bound it) holds no device memory for it, and the next step like the recent
    ones has its buffer again."""
    arena = Arena("cpu")
    small, large = [relu_like(4096, 0.5, i) for i in range(2)], [relu_like(16 * 4096, 0.5, i) for i in range(2)]
    run_step(arena, small)
    assert_all_fit_exactly(run_step(arena, small), small)
    planned = arena.reserved_bytes
    assert planned > 0 and [Store(arena)(x) for x in large] == [None, None]
    assert arena.reserved_bytes == 0
    assert arena.begin_step(*demand(arena), 2 * 16 * 4096)
    store = Store(arena)
    assert_all_fit_exactly([store(x) for x in small], small)
    assert 0 < arena.reserved_bytes <= 2 * 4096 * WORD_BYTES  # within the small step's dense size


def test_a_buffer_with_a_spill_region_stays_for_a_tensor_it_cannot_take():
    arena = spilling(values_demand=2000, most_value_words=20_000)
    buffer = arena.values.words
    assert arena.reserve_fixed(arena.fixed_capacity_words + 1) is None
    assert arena.values.words is buffer  # releasing it would wait for the device


def test_tile_words_of_an_interrupted_measure_are_let_go_at_the_next_drain():
    """Tile words handed out and never submitted (an exception between the codec's call and
    ``submit_measure``) are held while the device may write them, not for good."""
    arena = Arena("cpu")
    tile_words = arena.next_measure(GEOMETRY.num_tiles(5000))
    released = weakref.ref(tile_words)
    del tile_words
    assert released() is not None
    arena.drain()
    assert released() is None
    assert Store(arena)(relu_like(5000, 0.5)) is None and arena.ends()[-1] > 0  # measures on


def test_peak_after_overflow_is_at_most_what_the_regions_hold():
    arena = Arena("cpu", 1 << 16, fixed_fraction=0.25)
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
    fresh = arena.usage()
    assert isinstance(fresh, ArenaUsage)
    assert (
        fresh.capacity,
        fresh.fixed_used,
        fresh.fixed_demand,
        fresh.values_demand,
        fresh.window_waits,
        fresh.peak,
    ) == (1 << 16, 0, 0, 0, 0, 0)
    assert fresh.reserved == arena.reserved_bytes
    assert fresh.values_capacity == arena.values.capacity * WORD_BYTES
    store = Store(arena)
    c1 = store(relu_like(5000, 0.5))
    c2 = store(relu_like(4096, 0.75))
    usage = arena.usage()
    fixed = fixed_words(5000) + fixed_words(4096)
    assert usage.capacity == arena.capacity_bytes == 1 << 16
    assert usage.fixed_used == usage.fixed_demand == fixed * WORD_BYTES
    assert usage.values_demand == int(c1.stream_words() + c2.stream_words()) * WORD_BYTES
    assert usage.window_waits == 0  # nothing asynchronous on the CPU
    assert usage.peak == usage.fixed_used + usage.values_demand == c1.nbytes + c2.nbytes


# --------------------------------------------------------------------------------------------
# Leases and steps


def test_a_step_begins_only_when_every_lease_is_released():
    arena = Arena("cpu", 4096)
    leases = [arena.open_lease() for _ in range(3)]
    assert all(isinstance(lease, Lease) for lease in leases) and arena.leased
    for lease in leases[:-1]:
        lease.release()
        assert not arena.begin_step(0, 0)
    # Releasing twice counts once.
    leases[0].release()
    leases[1].release()
    assert arena.leased and not arena.begin_step(0, 0)
    leases[-1].release()
    assert not arena.leased and arena.begin_step(0, 0)
    leases[-1].release()
    assert not arena.leased


def test_a_dropped_lease_is_released_and_open_ones_are_counted():
    """The arena knows its leases by weak reference: dropping one releases it, whatever
    dropped it (an exception that cut its owner's bookkeeping short included)."""
    arena = Arena("cpu", 4096)
    leases = [arena.open_lease() for _ in range(3)]
    assert arena.open_leases == 3
    leases[0].release()
    del leases[1]
    gc.collect()
    assert arena.open_leases == 1 and not arena.begin_step(0, 0)
    del leases[-1]
    assert arena.open_leases == 0 and arena.begin_step(0, 0)


def test_begin_step_empties_the_arena_and_until_then_contents_survive():
    arena = Arena("cpu", 1 << 16, growable=False)
    lease = arena.open_lease()
    store = Store(arena)
    first = arena.reserve_fixed(100)
    tensors = [relu_like(4096, z) for z in (0.3, 0.6, 0.9)]
    compressed = [store(x) for x in tensors]
    assert not arena.begin_step(0, 0)  # leased: nothing is emptied
    assert int(arena.cursor) > 0 and arena.usage().fixed_used > 0
    lease.release()
    for c, x in zip(compressed, tensors):  # released, but not emptied until the next step
        assert_bitwise_equal(decompress(c, backend="torch"), x)
    assert arena.begin_step(0, 0)
    assert int(arena.cursor) == 0
    usage = arena.usage()
    assert (usage.fixed_used, usage.fixed_demand, usage.values_demand) == (0, 0, 0)
    assert arena.reserve_fixed(100).data_ptr() == first.data_ptr()
    # The first report of the new step starts at 0.
    store.reports.clear()
    store(relu_like(4096, 0.5, "next"))
    assert store.reports[0][0] == 0


# --------------------------------------------------------------------------------------------
# Sizing for the next step


def assert_all_fit_exactly(compressed, tensors) -> None:
    """Every tensor's values were written, and it decodes to the original bit for bit."""
    assert all(c is not None and c.fits() for c in compressed)
    for c, x in zip(compressed, tensors):
        assert_bitwise_equal(decompress(c, backend="torch"), x)


def demand(arena: Arena) -> tuple[int, int]:
    """What the arena was asked for since it was emptied, in (fixed, value) words."""
    usage = arena.usage()
    return usage.fixed_demand // WORD_BYTES, usage.values_demand // WORD_BYTES


def test_an_empty_arena_measures_then_has_room_for_the_same_step():
    arena = Arena("cpu")
    tensors = [relu_like(4096, 0.5, i) for i in range(5)] + [relu_like(300, 0.9)]
    store = Store(arena)
    assert [store(x) for x in tensors] == [None] * 6
    assert arena.begin_step(*demand(arena))
    assert arena.capacity_bytes == 0  # allocated when first needed
    store = Store(arena)
    compressed = [store(x) for x in tensors]
    assert_all_fit_exactly(compressed, tensors)
    assert arena.fixed_capacity_words == math.ceil(HEADROOM * sum(fixed_words(x.numel()) for x in tensors))
    assert arena.values.capacity == math.ceil(HEADROOM * sum(int(c.stream_words()) for c in compressed))


def test_values_grow_after_an_overflow():
    arena = Arena("cpu", 1 << 16, fixed_fraction=0.25)
    tensors = [relu_like(4096, 0.5, i) for i in range(7)]
    store = Store(arena)
    for x in tensors:
        store(x)
    fixed, values = demand(arena)
    assert values == 7 * 2048 > arena.values.capacity
    assert arena.begin_step(fixed, values)
    store = Store(arena)
    assert_all_fit_exactly([store(x) for x in tensors], tensors)
    assert arena.values.capacity == math.ceil(HEADROOM * values)


def test_values_grow_above_ninety_percent_without_overflow():
    arena = Arena("cpu", 1 << 16, fixed_fraction=0.25)  # 12287 usable value words
    assert 11264 > GROW_WHEN_ABOVE * 12287
    assert arena.begin_step(arena.fixed_capacity_words // 2 + 1, 11264)
    arena.reserve_fixed(0)
    assert arena.values.capacity == math.ceil(HEADROOM * 11264)


def test_fixed_region_grows_after_a_refused_reservation():
    arena = Arena("cpu", 4096, fixed_fraction=0.25)  # 256 fixed words
    assert arena.reserve_fixed(200) is not None
    assert arena.reserve_fixed(300) is None
    assert arena.begin_step(*demand(arena))
    assert arena.reserve_fixed(200) is not None
    assert arena.reserve_fixed(300) is not None
    assert arena.fixed_capacity_words == math.ceil(HEADROOM * 500)


def test_no_resize_between_half_and_ninety_percent():
    arena = Arena("cpu", 1 << 16, fixed_fraction=0.25)  # 4096 fixed, 12287 value words
    buffer = arena.values.words.data_ptr()
    assert arena.begin_step(3016, 8192)  # 74% and 67%
    assert arena.reserve_fixed(1) is not None
    assert (arena.capacity_bytes, arena.fixed_capacity_words, arena.values.capacity) == (1 << 16, 4096, 12287)
    assert arena.values.words.data_ptr() == buffer


def test_shrinks_when_demand_is_under_half():
    arena = Arena("cpu", 1 << 20, fixed_fraction=0.25)
    tensors = [relu_like(4096, 0.5, i) for i in range(3)]
    store = Store(arena)
    for x in tensors:
        store(x)
    assert demand(arena) == (3 * fixed_words(4096), 3 * 2048)
    assert arena.begin_step(*demand(arena))
    store = Store(arena)
    assert_all_fit_exactly([store(x) for x in tensors], tensors)  # room for the same step again
    assert arena.capacity_bytes < (1 << 20) // 4


def test_a_step_without_demand_releases_the_buffer():
    arena = Arena("cpu", 1 << 20)
    assert arena.begin_step(0, 0)
    assert arena.capacity_bytes == 0 and arena.values is None


def test_resizing_releases_the_old_buffer_before_the_new_one_is_made():
    arena = Arena("cpu", 1 << 16)
    Store(arena)(relu_like(4096, 0.5))
    old = weakref.ref(arena.values.words.untyped_storage())
    assert arena.begin_step(100_000, 100_000)
    gc.collect()
    assert old() is None  # gone before anything new is allocated
    assert arena.capacity_bytes == 0
    assert arena.reserve_fixed(1) is not None and arena.fixed_capacity_words == math.ceil(HEADROOM * 100_000)


def run_step(arena: Arena, tensors: list[torch.Tensor]) -> list:
    """Store ``tensors`` as a step does; then begin the next step with what this one asked for."""
    store = Store(arena)
    compressed = [store(x) for x in tensors]
    dense_words = sum(x.numel() for x in tensors)  # float32: a word per element
    assert arena.begin_step(*demand(arena), dense_words)
    return compressed


def test_steps_of_two_sizes_in_turn_each_find_room():
    # A step of 12 tensors, then one of 3, in turn (two models trained by turns, a longer
    # batch every other step): sized for the last step alone, the arena would have room for
    # 3 tensors of the next step of 12.
    arena = Arena("cpu")
    big = [relu_like(4096, 0.9, i) for i in range(12)]
    small = big[:3]
    run_step(arena, big)
    run_step(arena, small)
    for _ in range(2):
        for tensors in (big, small):
            compressed = run_step(arena, tensors)
            assert_all_fit_exactly(compressed, tensors)
    assert arena.fixed_capacity_words == math.ceil(HEADROOM * 12 * fixed_words(4096))


def test_a_leased_arena_notes_the_step_it_served_and_plans_from_it_once_free():
    # A generator's tensors kept alive through a discriminator's step: the arena keeps them,
    # and the step's demand is noted; once released, the next plan counts it.
    arena = Arena("cpu")
    tensors = [relu_like(4096, 0.9, i) for i in range(6)]
    run_step(arena, tensors[:3])  # measured: the plan has room for three
    compressed = [Store(arena)(x) for x in tensors]  # three stored, three measured
    assert compressed[3:] == [None] * 3
    lease = arena.open_lease(3 * 4096)
    assert not arena.begin_step(*demand(arena), 6 * 4096)  # kept: nothing emptied
    assert_all_fit_exactly(compressed[:3], tensors[:3])
    lease.release()
    assert arena.begin_step(None, None) and demand(arena) == (0, 0)
    arena.reserve_fixed(1)
    assert arena.fixed_capacity_words == math.ceil(HEADROOM * 6 * fixed_words(4096))


def test_a_step_expected_smaller_than_the_recent_ones_is_planned_as_they_scale_down():
    # A pipeline's warmup (several forwards in one step) before steps of one forward each.
    arena = Arena("cpu")
    warmup = [relu_like(4096, 0.9, i) for i in range(8)]
    run_step(arena, warmup)
    one_forward = 2 * 4096  # dense words
    assert arena.begin_step(None, None, expected_words=one_forward)
    assert arena.fixed_capacity_words == 0  # planned, made at the first reserve
    arena.reserve_fixed(1)
    assert arena.fixed_capacity_words == math.ceil(HEADROOM * 2 * fixed_words(4096))
    assert arena.capacity_bytes < 4 * one_forward


def test_a_budget_bounds_both_device_regions():
    arena = Arena("cpu")
    tensors = [relu_like(4096, 0.5, i) for i in range(6)]
    run_step(arena, tensors)
    budget = 3 * 4096  # less than the six tensors take stored
    assert arena.begin_step(None, None, budget_words=budget)
    arena.reserve_fixed(1)
    assert arena.capacity_bytes <= WORD_BYTES * budget and arena.reserved_bytes <= WORD_BYTES * budget
    stored = [Store(arena)(x) for x in tensors]
    fitted = [(c, x) for c, x in zip(stored, tensors) if c is not None and c.fits()]
    assert 0 < len(fitted) < len(tensors)
    assert_all_fit_exactly(*zip(*fitted))


def test_a_planned_buffer_the_device_has_no_room_for_leaves_its_step_measuring(monkeypatch):
    tensors = [relu_like(4096, 0.5, i) for i in range(6)]
    reference, arena = Arena("cpu"), Arena("cpu")
    for planned in (reference, arena):
        run_step(planned, tensors)  # measured: a buffer is planned, made at the next step's first store
    store = Store(reference)
    assert_all_fit_exactly([store(x) for x in tensors], tensors)
    planned_words = reference.fixed_capacity_words + reference.values_capacity_words
    monkeypatch.setattr(arena_module, "torch", NoRoomForBuffers())
    store = Store(arena)
    with pytest.warns(RuntimeWarning, match="no room on cpu for its arena"):
        assert store(tensors[0]) is None
    # No device memory held, as without the arena, and the step measured as a first step is.
    assert arena.out_of_memory and arena.reserved_bytes == 0 and arena.cursor is None
    assert [store(x) for x in tensors[1:]] == [None] * 5
    monkeypatch.undo()
    assert demand(arena) == demand(reference)
    # The next steps plan within half of the refused buffer, and store what fits there.
    assert arena.begin_step(*demand(arena), 6 * 4096) and not arena.out_of_memory
    compressed = [Store(arena)(x) for x in tensors]
    assert 0 < arena.fixed_capacity_words + arena.values_capacity_words <= planned_words // 2
    fitted = [(c, x) for c, x in zip(compressed, tensors) if c is not None and c.fits()]
    assert 0 < len(fitted) < len(tensors)
    assert_all_fit_exactly(*zip(*fitted))


def test_the_excess_is_what_the_arena_holds_beyond_its_leases():
    arena = Arena("cpu", 4096)
    words = arena.reserved_bytes // WORD_BYTES
    assert arena.excess_words == words
    first, second = arena.open_lease(100), arena.open_lease(words)
    assert arena.excess_words == 0
    del second
    assert arena.excess_words == words - 100
    first.release()
    assert arena.excess_words == words


def test_a_released_buffer_is_made_again_as_planned():
    arena = Arena("cpu")
    tensors = [relu_like(4096, 0.9, i) for i in range(3)]
    run_step(arena, tensors)
    run_step(arena, tensors)
    planned = (arena.fixed_capacity_words, arena.values_capacity_words)
    lease = arena.open_lease()
    with pytest.raises(RuntimeError, match="leased"):
        arena.release_buffer()
    lease.release()
    arena.release_buffer()
    assert arena.reserved_bytes == 0 and arena.values is None
    assert_all_fit_exactly([Store(arena)(x) for x in tensors], tensors)
    assert (arena.fixed_capacity_words, arena.values_capacity_words) == planned


def test_an_arena_planned_like_another_has_room_for_its_steps():
    first = Arena("cpu")
    tensors = [relu_like(4096, 0.9, i) for i in range(4)]
    run_step(first, tensors)
    second = Arena("cpu")
    second.plan_like(first)
    assert second.begin_step(None, None)
    assert_all_fit_exactly([Store(second)(x) for x in tensors], tensors)


# --------------------------------------------------------------------------------------------
# The pool: an arena per step whose tensors are alive


def store_step(pool: ArenaPool, tensors) -> tuple[list, list, tuple]:
    """Store ``tensors`` in the pool's current arena as a step does: what it stored, a lease
    per stored tensor (for its dense words) and the step's demand."""
    arena = pool.current
    store = Store(arena)
    compressed = [store(x) for x in tensors]
    leases = [arena.open_lease(x.numel()) for c, x in zip(compressed, tensors) if c is not None]
    return compressed, leases, (*demand(arena), sum(x.numel() for x in tensors), 0)


def test_a_step_begun_while_the_arena_is_leased_gets_an_arena_of_its_own():
    # A 1F1B pipeline stage with two microbatches in flight: a microbatch's backward, then
    # the next one's forward, while the microbatch before it waits for its backward.
    pool = ArenaPool("cpu")
    microbatches = [[relu_like(4096, 0.9, i, j) for j in range(3)] for i in range(6)]
    one_forward = 3 * 4096
    _, _, first = store_step(pool, microbatches[0])  # measured
    pool.begin_step(first)
    in_flight, served = [], []
    for tensors in microbatches[1:]:
        served.append(pool.current)
        compressed, leases, step = store_step(pool, tensors)
        assert_all_fit_exactly(compressed, tensors)
        in_flight.append(leases)
        if len(in_flight) == 2:
            in_flight.pop(0)  # the backward of the microbatch before
        pool.begin_step(step, one_forward)
    # Two arenas by turns, the primary (the only one that may spill) whenever it is free.
    assert served == [pool.primary, served[1]] * 2 + [pool.primary] and served[1] is not pool.primary
    assert len(pool.arenas) == 2 and not pool.arenas[1].spill
    assert pool.open_leases == 3 and pool.reserved_bytes == sum(arena.reserved_bytes for arena in pool.arenas)
    # Together no more than the microbatches in flight take dense.
    assert pool.reserved_bytes <= WORD_BYTES * 2 * one_forward


def test_the_primary_arena_stops_spilling_once_steps_overlap():
    # Arenas are resized and released as overlapping steps come and go, and a mapped buffer's
    # release waits for the device: from the first overlap on, no arena spills.
    pool = ArenaPool("cpu", spill=True)
    assert pool.primary.spill and not pool.overlapped
    tensors = [relu_like(4096, 0.9, i) for i in range(3)]
    pool.begin_step(store_step(pool, tensors)[2])
    assert pool.primary.spill
    _, leases, step = store_step(pool, tensors)
    pool.begin_step(step, 3 * 4096)
    assert pool.overlapped and not pool.primary.spill and not pool.current.spill
    del leases
    pool.begin_step((None, None, None, 0))
    pool.configure(1, True)
    assert pool.current is pool.primary and not pool.primary.spill


@pytest.mark.parametrize("zeros", [0.5, 0.9])
def test_a_warmup_is_planned_for_one_forward_where_its_buffer_would_outlast_the_first(zeros):
    # A 1F1B stage's iteration begins with a warmup, two forwards while nothing is alive, and
    # a forward whose tensors keep more than half their size stored would leave the warmup's
    # buffer holding more than the second forward's tensors take dense once the first's go.
    pool = ArenaPool("cpu")
    forward = [relu_like(4096, zeros, i) for i in range(3)]
    one_forward = 3 * 4096
    pool.begin_step(store_step(pool, forward * 2)[2])  # the first warmup, measured
    _, warmup, step = store_step(pool, forward * 2)
    pool.begin_step(step, one_forward)  # a forward begins while the warmup's tensors are alive
    assert pool.overlapped
    _, overlapping, step = store_step(pool, forward)
    del warmup, overlapping
    pool.begin_step(step)  # the next iteration's warmup
    assert pool.current is pool.primary
    pool.current.reserve_fixed(1)
    one, whole = math.ceil(HEADROOM * 3 * fixed_words(4096)), 6 * fixed_words(4096)
    assert pool.current.fixed_capacity_words == one if zeros == 0.5 else pool.current.fixed_capacity_words > whole


def test_an_arena_no_step_needs_lets_its_buffer_go():
    pool = ArenaPool("cpu")
    tensors = [relu_like(4096, 0.9, i) for i in range(3)]
    pool.begin_step(store_step(pool, tensors)[2])
    _, held_first, step = store_step(pool, tensors)
    pool.begin_step(step, 3 * 4096)
    second = pool.current
    _, held_second, step = store_step(pool, tensors)
    assert second is not pool.primary and second.reserved_bytes > 0
    del held_first, held_second
    pool.begin_step(step)  # all free: the primary serves, the other lets its buffer go
    assert pool.current is pool.primary and second.reserved_bytes == 0 and second.values is None


def test_a_new_step_is_planned_within_the_expected_size_less_the_leased_arenas_excess():
    pool = ArenaPool("cpu")
    tensors = [relu_like(4096, 0.5, i) for i in range(4)]
    pool.begin_step(store_step(pool, tensors)[2])
    _, leases, step = store_step(pool, tensors)
    del leases[:3]  # most of the step's tensors released: its arena holds more than the rest take
    old = pool.current
    excess = old.excess_words
    assert excess > 0
    pool.begin_step(step, 4 * 4096)
    assert pool.current is not old
    pool.current.reserve_fixed(1)
    assert 0 < pool.current.reserved_bytes <= WORD_BYTES * (4 * 4096 - excess)


def test_the_device_regions_never_take_more_than_the_smallest_recent_step_dense():
    # At 50% zeros the big step's tensors need more room than the small step's take dense:
    # the arena holds no more than that, so that the small step is no worse off with it, and
    # keeps room for the small step's own tensors.
    arena = Arena("cpu")
    big = [relu_like(4096, 0.5, i) for i in range(12)]
    small = big[:3]
    small_dense_words = 3 * 4096
    run_step(arena, big)
    for tensors in (small, big, small, big):
        run_step(arena, tensors)
        assert arena.reserve_fixed(0) is not None
        assert arena.fixed_capacity_words + arena.device_value_words <= small_dense_words
        assert arena.fixed_capacity_words > 3 * fixed_words(4096) and arena.device_value_words > 3 * 2048
        # All it allocates counts, each allocation as the caching allocator rounds it.
        start_bytes = arena.reserved_bytes - arena.capacity_bytes - COUNTER_BYTES
        allocated = sum(-(-n // 512) * 512 for n in (arena.capacity_bytes, COUNTER_BYTES, start_bytes))
        assert allocated <= small_dense_words * WORD_BYTES
    assert_all_fit_exactly(run_step(arena, small), small)
    # The regions share the room as the big step's demand does: the tensors whose fixed parts
    # fit find room for their values on the device, and the others are kept (a spill region
    # would otherwise take values over PCIe and back at every big step).
    compressed = run_step(arena, big)
    stored = [(c, x) for c, x in zip(compressed, big) if c is not None]
    assert 3 < len(stored) < len(big)
    assert_all_fit_exactly(*zip(*stored))


def test_the_arena_shrinks_once_a_smaller_demand_lasted_demand_steps():
    arena = Arena("cpu")
    big = [relu_like(4096, 0.9, i) for i in range(12)]
    small = big[:4]  # under half the big step's demand, and more than it dense
    run_step(arena, big)
    for step in range(1, DEMAND_STEPS + 1):
        run_step(arena, small)
        arena.reserve_fixed(0)
        shrunk = arena.fixed_capacity_words < 12 * fixed_words(4096)
        assert shrunk == (step == DEMAND_STEPS), step


def test_a_step_that_stores_nothing_releases_the_buffer_and_is_forgotten():
    arena = Arena("cpu")
    tensors = [relu_like(4096, 0.5, i) for i in range(4)]
    run_step(arena, tensors)
    assert arena.begin_step(0, 0, 0)  # after a step whose every save site stopped paying
    assert arena.reserve_fixed(1) is None and arena.capacity_bytes == 0
    run_step(arena, tensors)  # measured only: the arena was released
    # Sized for the steps that stored: the one that stored nothing does not count.
    assert_all_fit_exactly(run_step(arena, tensors), tensors)


def test_not_growable_never_resizes():
    arena = Arena("cpu", 1 << 16, fixed_fraction=0.25, growable=False)
    buffer = arena.values.words.data_ptr()
    for fixed, values in [(10_000, 10**6), (1, 1), (0, 0)]:
        assert arena.begin_step(fixed, values)
        assert arena.reserve_fixed(1) is not None
        assert (arena.capacity_bytes, arena.fixed_capacity_words, arena.values.capacity) == (1 << 16, 4096, 12287)
        assert arena.values.words.data_ptr() == buffer


def test_resize_refused_while_leased():
    arena = Arena("cpu", 4096)
    lease = arena.open_lease()
    with pytest.raises(RuntimeError, match="cannot be resized while its contents are leased"):
        arena.resize(8192)
    lease.release()
    arena.resize(8192)
    assert arena.capacity_bytes == 8192


# --------------------------------------------------------------------------------------------
# Reports through slots (pinned memory on CUDA; on the CPU with ``asynchronous=True``)


class SimulatedDevice:
    """Plays the GPU for an asynchronous CPU arena: runs appends when told, or when the arena
    waits for one (the GPU catching up to it), moving the cursor by the words each takes and
    setting its report word as an encoder does."""

    def __init__(self, arena: Arena):
        self.arena = arena
        self.queued: list[tuple[torch.Tensor, int]] = []
        self.reports: list[tuple[int, int]] = []
        arena._wait_for = self._catch_up

    def append(self, max_words: int, words: int, held_words: int | None = None) -> bool:
        """Queue an append that takes ``words`` (at most ``max_words``) and whose caller holds
        ``held_words`` (by default ``max_words``); whether it is sure to fit."""
        held_words = max_words if held_words is None else held_words
        slot, report, sure = self.arena.next_report(max_words, held_words)
        self.queued.append((report, words))
        self.arena.submit(slot, lambda start, end: self.reports.append((start, end)))
        return sure

    def run(self, appends: int) -> None:
        """Finish the oldest ``appends`` queued appends."""
        for report, words in self.queued[:appends]:
            self.arena.cursor += words
            report.copy_(self.arena.cursor + 1)
        del self.queued[:appends]

    def _catch_up(self, slot: int) -> None:
        report = self.arena._report_slots[slot]
        while not int(report):
            assert self.queued, "a wait for an append that was never queued"
            self.run(1)


def test_sure_appends_are_not_throttled_and_reports_make_others_sure():
    arena = Arena("cpu", 4 * 4096, fixed_fraction=0.25, window=1, asynchronous=True)  # 3071 value words
    device = SimulatedDevice(arena)
    # Nothing reported yet: the cursor may be anywhere up to the appends' sizes at most.
    assert [device.append(1000, 400) for _ in range(3)] == [True, True, True]  # 3000 <= 3071
    assert not device.append(1000, 400)  # 4000 > 3071: throttled, the first one
    assert arena._throttled == 1 and arena.usage().window_waits == 0
    # The next waits for reports, oldest first (the GPU catching up to each), until the one
    # throttled append is confirmed; then the cursor is known to be at 1600, and 1600 + 1000 <= 3071.
    assert device.append(1000, 400)
    assert arena.usage().window_waits == 4 and arena._throttled == 0
    assert device.reports == [(0, 400), (400, 800), (800, 1200), (1200, 1600)]
    # A measured append (nothing held) is never throttled, but it moves the cursor too.
    assert not device.append(5000, 5000, held_words=0)
    assert arena._throttled == 0
    device.run(2)
    arena.drain()
    assert device.reports[-2:] == [(1600, 2000), (2000, 7000)]
    assert not device.append(1, 1)  # past the end: nothing is sure


def test_reports_that_arrived_make_an_append_sure_without_a_wait():
    arena = Arena("cpu", 4 * 4096, fixed_fraction=0.25, window=1, asynchronous=True)  # 3071 value words
    device = SimulatedDevice(arena)
    assert device.append(2000, 100) and device.append(500, 100)
    assert not device.append(1000, 100)  # 3500 > 3071: throttled
    device.run(3)  # the GPU caught up; nothing delivered the reports yet
    assert device.reports == []
    assert device.append(2000, 100)  # the reports put the cursor at 300: 2300 <= 3071
    assert arena.usage().window_waits == 0 and arena._throttled == 0 and len(device.reports) == 3


def test_an_append_that_was_sure_and_did_not_fit_raises():
    # Its caller kept nothing: the arena's promise failing is a bug, never a silent loss.
    arena = Arena("cpu", 4 * 4096, fixed_fraction=0.25, window=1, asynchronous=True)  # 3071 value words
    device = SimulatedDevice(arena)
    assert device.append(1000, 5000)  # takes more than it said it could at most
    device.run(1)
    with pytest.raises(RuntimeError, match="an append the arena was sure of ended at word 5000"):
        arena.drain()


def test_a_wait_stops_once_the_reports_make_the_append_sure():
    arena = Arena("cpu", 4 * 4096, fixed_fraction=0.25, window=1, asynchronous=True)  # 3071 value words
    device = SimulatedDevice(arena)
    assert device.append(2000, 100) and device.append(500, 100)
    assert not device.append(1000, 100)  # 3500 > 3071: throttled
    # 4000 words at most: it waits, and the first report (100 words, not 2000) makes it sure
    # while the throttled append is still running: the wait stops there.
    assert device.append(500, 100)
    assert arena.usage().window_waits == 1 and arena._throttled == 1
    device.run(3)
    arena.drain()
    assert device.reports == [(0, 100), (100, 200), (200, 300), (300, 400)]


def test_a_wait_cut_short_leaves_its_report_to_a_later_delivery():
    """An exception (Ctrl-C) while the host waits for a report loses nothing: the report is
    delivered later, its callback called, its slot freed, and the ends stay one per append."""
    arena = Arena("cpu", 4 * 4096, fixed_fraction=0.25, window=1, asynchronous=True)  # 3071 value words
    device = SimulatedDevice(arena)
    assert device.append(2000, 100) and device.append(500, 100)
    catch_up = arena._wait_for

    def interrupted(slot: int) -> None:
        arena._wait_for = catch_up
        raise KeyboardInterrupt

    arena._wait_for = interrupted
    with pytest.raises(KeyboardInterrupt):
        arena.drain()
    arena.drain()
    assert device.reports == [(0, 100), (100, 200)] and arena.ends() == [100, 200]
    assert sorted(arena._free_reports) == list(range(len(arena._report_slots)))
    assert arena._awaited == arena._throttled == arena._held_words == 0


def test_a_wait_for_measured_words_cut_short_leaves_them_to_a_later_delivery(monkeypatch):
    """As above, for the words of an append measured in host memory."""
    arena = Arena("cpu")
    tile_words = arena.next_measure(3)
    assert arena.submit_measure(tile_words) == 0
    spin = arena._spin_until

    def interrupted(arrived) -> None:
        monkeypatch.setattr(arena, "_spin_until", spin)
        raise KeyboardInterrupt

    monkeypatch.setattr(arena, "_spin_until", interrupted)
    with pytest.raises(KeyboardInterrupt):
        arena.drain()
    tile_words.copy_(torch.tensor([5, 6, 7]))  # the device's words arrive
    arena.drain()
    assert arena.ends() == [18]


def test_a_report_that_never_comes_raises_once_and_the_arena_goes_on(monkeypatch):
    """An append that never reports (never queued on the device: a caller's bug) raises when
    waited for, and is then let go: the reports after it are delivered, and the arena empties
    for the next step."""
    monkeypatch.setattr("bitsparse.allocator.arena.REPORT_TIMEOUT_S", 0.01)
    arena = Arena("cpu", 4 * 4096, fixed_fraction=0.25, window=1, asynchronous=True)  # 3071 value words
    slot, _, _ = arena.next_report(100, 0)
    arena.submit(slot)  # never run
    device = SimulatedDevice(arena)
    device.append(100, 100)
    device.run(1)
    wait = Arena._wait_for.__get__(arena)
    monkeypatch.setattr(arena, "_wait_for", wait)  # the arena's own wait: it never arrives
    with pytest.raises(RuntimeError, match="never reported its end"):
        arena.drain()
    arena.drain()
    assert device.reports == [(0, 100)]
    assert arena.begin_step(0, 0) and arena.ends() == []


def test_measured_words_that_never_come_raise_once_and_the_arena_goes_on(monkeypatch):
    """As above, for an append measured in host memory whose words never arrive."""
    monkeypatch.setattr("bitsparse.allocator.arena.REPORT_TIMEOUT_S", 0.01)
    arena = Arena("cpu")
    arena.submit_measure(arena.next_measure(3))  # never written
    with pytest.raises(RuntimeError, match="never reported its end"):
        arena.drain()
    arena.drain()
    assert arena.begin_step(0, 0)


def expecting(dense_words: int, window: int | None = None) -> tuple[Arena, SimulatedDevice]:
    """An arena of 4095 words (3071 of values) in a step whose tensors are expected to take
    ``dense_words`` dense."""
    arena = Arena("cpu", 4 * 4096, fixed_fraction=0.25, window=window, growable=False, asynchronous=True)
    assert arena.begin_step(None, None, dense_words)
    return arena, SimulatedDevice(arena)


def test_the_hold_allowance_bounds_the_held_appends_beyond_the_first():
    # Copies of 2500 words may be held together, or one of any size.
    arena, device = expecting(dense_words=6595)
    assert [device.append(1000, 400) for _ in range(3)] == [True, True, True]
    assert not device.append(1000, 400) and not device.append(1000, 400)  # 2000 words held
    assert arena._throttled == 2 and arena.usage().window_waits == 0
    # 3000 words would pass the allowance: it waits, oldest first, until the first throttled
    # append is confirmed (1000 held: 2000 <= 2500).
    assert not device.append(1000, 400)
    assert arena.usage().window_waits == 4 and arena._throttled == 2
    assert device.reports == [(0, 400), (400, 800), (800, 1200), (1200, 1600)]
    arena, device = expecting(dense_words=6595)
    assert device.append(3000, 400) and not device.append(3000, 400)  # one copy: past the allowance
    assert device.append(2000, 400)  # a second one waits for the first (and is sure then)
    assert arena.usage().window_waits == 2 and arena._throttled == 0


def test_the_window_bounds_the_held_appends():
    arena, device = expecting(dense_words=100_000, window=3)
    assert [device.append(1000, 400) for _ in range(3)] == [True, True, True]
    assert [device.append(1000, 400) for _ in range(3)] == [False] * 3
    assert arena._throttled == 3 and arena.usage().window_waits == 0
    assert not device.append(2000, 400)  # waits until the first throttled one is confirmed
    assert arena._throttled == 3 and arena.usage().window_waits == 4


def spilling(values_demand: int, most_value_words: int) -> Arena:
    """A spilling arena (a simulated device's, on the CPU) after a step that needed 1000
    fixed words and ``values_demand`` value words for tensors whose values could take
    ``most_value_words``, with its buffer allocated."""
    arena = Arena("cpu", window=1, asynchronous=True, spill=True)
    assert arena.begin_step(1000, values_demand, 10 * most_value_words, most_value_words)
    assert arena.reserve_fixed(1) is not None
    return arena


def test_a_spill_region_continues_the_values_for_the_most_the_last_step_could_take():
    arena = spilling(values_demand=2000, most_value_words=20_000)
    device_part = math.ceil(HEADROOM * 2000)
    assert arena.device_value_words == device_part and arena.fixed_capacity_words == math.ceil(HEADROOM * 1000)
    assert arena.values_capacity_words == device_part + math.ceil(HEADROOM * (20_000 - device_part))
    # The value region starts aligned, after the fixed region; the spill and the guard end the buffer.
    assert arena.values.words.storage_offset() % ALIGN_WORDS == 0
    assert arena.values.capacity == arena.values_capacity_words
    assert arena.spill_bytes == (arena.values_capacity_words - device_part + 1) * WORD_BYTES
    assert arena.capacity_bytes + arena.spill_bytes == arena.values.words.untyped_storage().nbytes()
    # The hold allowance leaves the spill out: it is host memory.
    fixed_part = arena.values.words.storage_offset()
    assert arena.capacity_bytes == (fixed_part + device_part) * WORD_BYTES
    assert arena._hold_allowance == 10 * 20_000 - arena.fixed_capacity_words - device_part
    # The same demand keeps the buffer; a spill-free arena has none.
    buffer = arena.values.words
    assert arena.begin_step(1000, 2000, 200_000, 20_000) and arena.reserve_fixed(1) is not None
    assert arena.values.words is buffer
    assert spilling(2000, 2000).spill_bytes == 0
    plain = Arena("cpu", window=1, asynchronous=True)
    assert plain.begin_step(1000, 2000, 200_000, 20_000) and plain.reserve_fixed(1) is not None
    assert plain.spill_bytes == 0 and plain.values_capacity_words == plain.device_value_words


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sign_pack", [False, True])
def test_a_device_then_host_buffer_holds_a_stream_across_its_two_parts(dtype, sign_pack):
    step = mapped.granularity(torch.cuda.current_device())
    if step is None:
        pytest.skip("this CUDA driver cannot map host memory into a device range")
    words = mapped.device_then_host(torch.device("cuda", torch.cuda.current_device()), step, 4 * step)
    assert words.dtype == torch.int32 and words.numel() == 5 * step // WORD_BYTES
    counters = torch.zeros(3, dtype=torch.int64, device="cuda")
    buffer = ValueBuffer.over(words, counters)
    x = relu_like(1_000_000, 0.3, "mapped").to("cuda", dtype)
    counters[0] = step // WORD_BYTES - 1000  # the stream starts in device memory, ends in host memory
    c = compress(x, values=buffer, sign_pack=sign_pack)
    assert int(counters[0]) > step // WORD_BYTES and c.fits
    assert_bitwise_equal(decompress(c), x)
    assert_bitwise_equal(decompress(c, backend="torch"), x)
    del c, buffer, words
    gc.collect()  # released (after the device finished with it)


def test_a_steady_demand_keeps_a_buffer_whose_parts_were_rounded_up(monkeypatch):
    # Parts mapped in units of 1 MiB of words, far above this demand: the plans compare with
    # what was asked for, not with the rounded sizes, or the buffer would be remade every step.
    monkeypatch.setattr(Arena, "_cpu_mapping_words", 1 << 18)
    arena = spilling(values_demand=2000, most_value_words=20_000)
    assert arena.device_value_words + arena.values.words.storage_offset() == 1 << 18
    assert arena.values_capacity_words == 2 * (1 << 18) - 1 - arena.values.words.storage_offset()
    buffer = arena.values.words
    for _ in range(3):
        assert arena.begin_step(1000, 2000, 200_000, 20_000) and arena.reserve_fixed(1) is not None
        assert arena.values.words is buffer


def test_a_spill_region_that_cannot_be_mapped_leaves_an_arena_without_one(monkeypatch):
    def refused(arena, device_words, host_words):
        raise torch.OutOfMemoryError("no room for pinned host memory")

    monkeypatch.setattr(Arena, "_mapped_buffer", refused)
    with pytest.warns(RuntimeWarning, match="could not map its arena's spill region"):
        arena = spilling(values_demand=2000, most_value_words=20_000)
    assert arena.spill_bytes == 0 and arena.values_capacity_words == arena.device_value_words >= 2000
    assert not arena.spills  # not tried again, and the buffer is kept
    buffer = arena.values.words
    assert arena.begin_step(1000, 2000, 200_000, 20_000) and arena.reserve_fixed(1) is not None
    assert arena.values.words is buffer


def test_appends_within_the_spill_region_are_sure_and_counted_as_spilled():
    arena = spilling(values_demand=2000, most_value_words=20_000)
    device = SimulatedDevice(arena)
    # Nothing reported, the host far ahead: every append of the last step's size is sure.
    assert all(device.append(1000, 400) for _ in range(19))
    assert arena._throttled == 0
    device.run(19)
    arena.drain()
    assert arena.usage().window_waits == 0 and device.reports[-1] == (18 * 400, 19 * 400)
    assert arena.ends() == [400 * n for n in range(1, 20)]
    usage = arena.usage()
    assert usage.values_capacity == arena.device_value_words * WORD_BYTES
    assert usage.spilled == (19 * 400 - arena.device_value_words) * WORD_BYTES
    assert usage.peak == usage.fixed_used + usage.values_capacity  # device memory only
    # Past both parts, appends are throttled as without a spill region.
    assert not device.append(arena.values_capacity_words, 400)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
        ),
    ],
)
@pytest.mark.parametrize("window", [1, 3])
def test_reports_arrive_through_report_slots(device, window):
    codec = torch_codec
    if device == "cuda":
        from bitsparse.codecs import triton_codec as codec
    # Room for about two of the tensors at most: the others are sure to fit only once the reports
    # of earlier ones arrived (at once on the CPU), and throttled until then.
    arena = Arena(device, 4 * 600_000, window=window, asynchronous=True)
    reports, compressed, sure_appends = [], [], []
    tensors = [relu_like(n, 0.5, n).to(device) for n in (4096, 100_000, 1, 300_000, 4096 * 7, 200_000)]
    for i, x in enumerate(tensors):
        fixed = arena.reserve_fixed(fixed_words(x.numel()))
        measured = i == 2  # one measured append in between: not throttled, reported all the same
        max_words = GEOMETRY.max_stream_words(x.numel(), 32)
        slot, report, sure = arena.next_report(max_words, 0 if measured else max_words)
        sure_appends.append(sure)
        if measured:
            codec.measure(x, arena.cursor, arena.appends, dtype_spec(x.dtype), GEOMETRY, False, report)
            compressed.append(None)
        else:
            compressed.append(compress_into(x, codec, GEOMETRY, arena.values, fixed, False, None, report))
        arena.submit(slot, lambda start, end: reports.append((start, end)))
        assert arena._throttled <= window  # older appends were waited for
    assert sure_appends[:2] == [True, True]
    arena.drain()
    ends = [end for _, end in reports]
    assert [start for start, _ in reports] == [0] + ends[:-1]
    stored = [(c, x) for c, x in zip(compressed, tensors) if c is not None]
    assert [end for (_, end), c in zip(reports, compressed) if c is not None] == [
        int(c.base) + int(c.stream_words()) for c, _ in stored
    ]
    assert ends[-1] == int(arena.cursor) and arena.usage().values_demand == ends[-1] * WORD_BYTES
    for c, x in stored:
        assert_bitwise_equal(decompress(c), x)
