"""Kernels for CUDA in Gluon (Triton's dialect with explicit layouts): the encoder, and the
decoder for 8- and 16-bit values and for streams that may hold sign-packed tiles.

The portable Triton kernels (``triton_codec``) let the compiler choose layouts and move each
value with its own 2-byte access; its encoder reached about half of copy bandwidth and its
packed decoder about 40%, bound by instructions and latency (docs/benchmarks.md). These:

- hold each thread's values as 16-byte vectors, a layout stated in the kernel (the encoder
  keeps them as 32-bit words, one register for two bf16 values), and build the mask words and
  ranks from per-vector bit masks (one 32-bit scan per tile, over its mask words' popcounts);
- stage a tile's values in shared memory, compacted, and move them between shared memory and
  the stream with 16-byte accesses (a sign-packed tile's stream words are assembled from the
  staged values, each written once, whole; the decoder loads its run with asynchronous
  copies, all in flight at once);
- (encoder) claim stream space for ``GROUP`` tiles with one atomic: the claim counter is one
  address that every program hits;
- (encoder, ``relu_square``) square the values a thread holds, once their ReLU is taken, and
  store the square in 16-byte vectors, in inline PTX: computed in Gluon beside the values
  held for the scan, the squares spilled registers, and a loop of its own that loaded the
  values again from L2 was slower (docs/benchmarks.md);
- (decoder) issue every load of a tile's fixed part before the first barrier, so that the
  stream's load waits for one round trip to memory, not two, and prefetch the fixed part of
  a later tile into L2, so that the first of those round trips can end there.

Triton has no access to computed shared-memory addresses, so the staging is inline PTX: one
instance per thread (``pack`` covers all of a thread's values) declares the buffer, fills it,
synchronizes the block and reads it.

Gluon kernels cannot run under ``TRITON_INTERPRET=1``, and need compute capability 8.0
(``cp.async``): the portable kernels are the ones the CPU tests run, and they serve every case
these do not (other GPUs and tile sizes, unaligned streams or inputs, raw 32-bit decoding,
where the portable decoder measured faster). GPU tests check both against the reference.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.runtime.jit import constexpr_function

from bitsparse.codecs.appends import finish_append

TILE = 4096
"""The tile size these kernels are built for (the format's default); others use the portable ones."""
GROUP = 2
"""Tiles per program, which share one claim on the stream (measured: docs/benchmarks.md)."""
ENCODE_OPTIONS = {8: {"num_warps": 4, "maxnreg": 64}, 16: {"num_warps": 4, "maxnreg": 64}, 32: {"num_warps": 4}}
"""Launch options by value width. 8- and 16-bit values, held as 32-bit words, fit in 64
registers a thread without spilling, and eight encoder programs fit an SM: +2 to +10 points
of copy bandwidth for bf16 against 80 registers (six programs); 56 spilled and lost 7-20.
32-bit values hold twice the registers: capped, they fell from 91% to 37%, so they run
uncapped."""
PREFETCH_TILES = gl.constexpr(2048)
"""How far ahead of its own tile a decoder program prefetches a fixed part: about as many
tiles as an H200's SMs hold decoder programs at once (12-16 each on 132 SMs)."""
DECODE_OPTIONS = {8: {"num_warps": 4, "maxnreg": 32}, 16: {"num_warps": 4}, 32: {"num_warps": 4}}
"""Launch options by value width. Capped at 32 registers, 16 decoder programs fit an SM
instead of 12: +1 to +7 points for float8, which does not spill there; bf16 spilled and lost
6 points."""

# Arguments Triton must not specialize on: the compiled kernels then depend only on what
# ``triton_codec._Launcher``'s keys hold.
_ENCODE_UNSPECIALIZED = [
    "cursor_ptr", "appends_ptr", "base_ptr", "report_ptr", "nonzeros_ptr", "capacity", "num_tiles", "num_programs",
]  # fmt: skip
_DECODE_UNSPECIALIZED = ["base_ptr", "num_tiles"]


def supports(tile_size: int, itemsize: int) -> bool:
    """Whether these kernels handle tiles of ``tile_size`` elements of ``itemsize`` bytes (the
    encoder's shared buffer, a group of tiles and some slack, must fit the 48 KiB of static
    shared memory)."""
    return tile_size == TILE and GROUP * TILE * itemsize <= 32 * 1024


@constexpr_function
def _int_type(bits):
    return {8: gl.int8, 16: gl.int16, 32: gl.int32}[bits]


@constexpr_function  # so that Triton hashes it into the kernels' cache keys
def _ptx_prologue(buffer_bytes):
    """Declarations of the thread's PTX block: the shared buffer (address in ``s``) and the
    registers the blocks use."""
    return [
        "{",
        f".shared .align 16 .b8 bs_buffer[{buffer_bytes + 32}];",
        ".reg .pred p, whole, packed;",
        ".reg .u32 s, a, b, q, lo, hi, v0, v1, v2, v3;",
        ".reg .u64 g;",
        "mov.u32 s, bs_buffer;",
    ]


@constexpr_function
def _run_copy_ptx(lead, stop, address, threads, into_shared, label=""):
    """PTX moving the run at buffer bytes [lead, stop) between shared memory and the stream,
    where buffer byte 0 is at the 16-byte aligned ``address``. Thread t handles bytes
    [16 b, 16 b + 16) for b = t, t + threads, ...: whole vectors inside the run, single words
    at its two ends (the rest of those vectors belongs to other runs). ``label`` tells apart
    the labels of several copies in one PTX block."""
    if into_shared:
        # Asynchronous copies: a thread's loads are all in flight at once, none waits for the
        # one before it to land in a register.
        vector = ["cp.async.cg.shared.global [a], [g], 16;"]

        def word(i):
            return [f"@p cp.async.ca.shared.global [a+{4 * i}], [g+{4 * i}], 4;"]

    else:
        vector = ["ld.shared.v4.b32 {v0, v1, v2, v3}, [a];", "st.global.v4.b32 [g], {v0, v1, v2, v3};"]

        def word(i):
            return [f"@p ld.shared.b32 v{i}, [a+{4 * i}];", f"@p st.global.b32 [g+{4 * i}], v{i};"]

    lines = [
        "mov.u32 b, %tid.x;",
        "shl.b32 b, b, 4;",
        "add.u32 a, s, b;",
        "cvt.u64.u32 g, b;",
        f"add.u64 g, g, {address};",
        f"bs_copy{label}:",
        f"setp.ge.u32 p, b, {stop};",
        f"@p bra bs_copied{label};",
        f"setp.ge.u32 whole, b, {lead};",
        "add.u32 q, b, 16;",
        f"setp.le.and.u32 whole, q, {stop}, whole;",
        f"@!whole bra bs_words{label};",
        *vector,
        f"bra bs_next{label};",
        f"bs_words{label}:",
    ]
    for i in range(4):
        lines += [f"add.u32 q, b, {4 * i};", f"setp.ge.u32 p, q, {lead};", f"setp.lt.and.u32 p, q, {stop}, p;"]
        lines += word(i)
    return lines + [
        f"bs_next{label}:",
        f"add.u32 b, b, {16 * threads};",
        f"add.u32 a, a, {16 * threads};",
        f"add.u64 g, g, {16 * threads};",
        f"bra bs_copy{label};",
        f"bs_copied{label}:",
    ] + (["cp.async.wait_all;"] if into_shared else [])


@constexpr_function
def _for_each_value(operands, vector, masks, before, body, per_operand=1):
    """PTX visiting a thread's values vector by vector, ``per_operand`` values to an operand:
    ``before(c)`` ahead of the vector at operand offset ``c``, then for its value ``j`` the
    predicate ``p`` (bit ``j`` of the vector's mask, operand ``masks + c``) and ``body(c, j)``."""
    lines = []
    for c in range(0, operands, vector // per_operand):
        lines += before(c)
        for j in range(vector):
            lines += [f"and.b32 q, ${masks + c}, {1 << j};", "setp.ne.b32 p, q, 0;"] + body(c, j)
    return lines


@constexpr_function
def _scatter_ptx(operands, vector, bits, before):
    """The encoders' scatter: a vector's nonzeros (values $E, 32-bit words holding ``32 //
    bits`` values each from the lowest bits, and masks $2E) to consecutive buffer bytes from
    the vector's first one ($3E)."""
    e, size, per_word = operands, bits // 8, 32 // bits
    kind = {1: "b8", 2: "b16", 4: "b32"}[size]

    def store(c, j):  # a store takes the register's lowest bits
        word, part = f"${e + c + j // per_word}", j % per_word
        shift = [f"@p shr.u32 q, {word}, {bits * part};"] if part else []
        return shift + [f"@p st.shared.{kind} [a], {'q' if part else word};", f"@p add.u32 a, a, {size};"]

    return _for_each_value(e, vector, 2 * e, lambda c: before(c) + [f"add.u32 a, s, ${3 * e + c};"], store, per_word)


@constexpr_function
def _square_ptx(operands, dtype, threads):
    """PTX storing the squares of a thread's values of ``dtype`` (their ReLU, none below zero),
    computed in float32 and rounded to nearest even as PyTorch squares them. Operands: the
    values $E (32-bit words), the bytes of the square from the group's first to the tensor's
    end $2E, the square's address at the group's first value $3E. In the encoder's layout
    thread t holds the group's 16-byte vectors t, t + threads, ...: each is stored whole when
    it lies inside the tensor, else word by word up to its end. The outputs are not written:
    the block is there for its stores (not pure, so it is kept)."""
    e = operands
    lines = ["{", ".reg .b32 s0, s1, s2, s3, lo, hi, end, o;", ".reg .b16 h0, h1;", ".reg .pred whole, p;"]
    lines += [".reg .u64 g;", "mov.u32 o, %tid.x;", "shl.b32 o, o, 4;", "cvt.u64.u32 g, o;", f"add.u64 g, g, ${3 * e};"]
    for c in range(0, e, 4):
        for k in range(4):
            word, square = f"${e + c + k}", f"s{k}"
            if dtype.primitive_bitwidth == 32:
                lines.append(f"mul.rn.f32 {square}, {word}, {word};")
                continue
            if dtype.is_bf16():
                lines += [f"shl.b32 lo, {word}, 16;", f"and.b32 hi, {word}, -65536;"]
            else:
                lines += [f"mov.b32 {{h0, h1}}, {word};", "cvt.f32.f16 lo, h0;", "cvt.f32.f16 hi, h1;"]
            pair = "bf16x2" if dtype.is_bf16() else "f16x2"
            lines += ["mul.rn.f32 lo, lo, lo;", "mul.rn.f32 hi, hi, hi;", f"cvt.rn.{pair}.f32 {square}, hi, lo;"]
        lines += ["add.u32 end, o, 16;", f"setp.le.u32 whole, end, ${2 * e};"]
        lines += ["@whole st.global.cs.v4.b32 [g], {s0, s1, s2, s3};"]
        for k in range(3):  # a vector the tensor's end cuts: its words before the end
            lines += [f"add.u32 end, o, {4 * k + 4};", f"setp.le.and.u32 p, end, ${2 * e}, !whole;"]
            lines += [f"@p st.global.cs.b32 [g+{4 * k}], s{k};"]
        lines += [f"add.u32 o, o, {16 * threads};", f"add.u64 g, g, {16 * threads};"]
    return "\n".join(lines + ["}"])


@constexpr_function
def _square_constraints(operands):
    return ",".join(["=r"] * operands + ["r"] * (2 * operands) + ["l"] * operands)


@constexpr_function
def _compaction_ptx(operands, vector, threads, buffer_bytes, bits):
    """The encoder's PTX, run once by every thread of a program for its values.

    Operands, ``operands`` registers each (one per 32-bit word of values; per-vector and
    per-program ones repeat): values $E (``32 // bits`` to a word, from its lowest bits), the
    bit mask of the word's vector of ``vector`` consecutive values $2E, the vector's first
    buffer byte $3E, the buffer byte of the last word of the vector's tile $4E (zeroed first:
    the padding after a tile's last value), the first byte of the run in the buffer $5E (the
    stream address modulo 16), the end of the run $6E (0 writes nothing) and the 16-byte
    aligned stream address of buffer byte 0 $7E.
    """
    e = operands
    lines = _ptx_prologue(buffer_bytes)
    if bits < 32:  # the last words are zeroed before any value lands in them
        for c in range(0, e, vector * bits // 32):
            lines += [f"add.u32 a, s, ${4 * e + c};", "st.shared.b32 [a], 0;"]
        lines += ["bar.sync 0;"]
    lines += _scatter_ptx(e, vector, bits, lambda c: [])
    lines += ["bar.sync 0;"]
    lines += _run_copy_ptx(f"${5 * e}", f"${6 * e}", f"${7 * e}", threads, into_shared=False)
    return "\n".join(lines + ["}"])


@constexpr_function
def _compaction_constraints(operands):
    return ",".join(["=r"] * operands + ["r"] * (6 * operands) + ["l"] * operands)


PACKING_GROUP = 32
"""Values a thread assembles at once when sign-packing: 32 values of ``w`` bits fill exactly
``w`` stream words, so each group's words are its own."""


@constexpr_function
def _packing_region_bytes(tile, size):
    """Buffer bytes of a packing tile: its values, then room for a group's worth of zeros."""
    return tile * size + PACKING_GROUP * size


@constexpr_function
def _group_word_terms(chunk_bits, chunks, word):
    """For stream word ``word`` of a packing group held as ``chunks`` registers of
    ``chunk_bits`` packed bits each: each (register, left shift) whose bits land in it (a
    negative shift is a right shift)."""
    return [
        (k, chunk_bits * k - 32 * word)
        for k in range(chunks)
        if chunk_bits * k < 32 * word + 32 and chunk_bits * k + chunk_bits > 32 * word
    ]


@constexpr_function
def _packing_ptx(operands, vector, threads, region_bytes, bits):
    """The sign-packing encoder's PTX (a group of two tiles), run once by every thread.

    Operands, ``operands`` registers each: values $E (as for ``_compaction_ptx``), vector bit
    masks $2E, the vector's first buffer byte $3E (tile t's values start at byte ``t *
    region_bytes``), then per program: the first byte after tile 0's values $4E and after
    tile 1's $5E, the stream words of the first tile $6E, of the group $7E (0 writes
    nothing), the tiles' packed flags (bit t) $8E and the stream address $9E.

    A raw tile's words are in the buffer as they are. A packed tile's are assembled by
    ``PACKING_GROUP`` values at a time: a thread loads a group's values with 16-byte loads,
    and after a barrier writes the group's ``bits - 1`` words over the values, shifted so
    that the run is copied out in aligned vectors. Each loaded register first drops its
    values' sign bits, leaving a chunk of packed bits at its bottom; every word is then the
    one or two chunks it overlaps, shifted. Building every word from the values overlapping
    it, loaded one by one, took three times the instructions per word; storing a group's
    words straight to the stream spread each warp store over 32 sectors (40% of copy
    bandwidth against 68% for bf16 at 50% zeros, docs/benchmarks.md).
    """
    e = operands
    size = bits // 8
    kind = {1: "b8", 2: "b16", 4: "b32"}[size]
    width = bits - 1
    group_bytes = PACKING_GROUP * size
    registers = [f"x{i}" for i in range(group_bytes // 4)]
    lines = _ptx_prologue(2 * region_bytes)
    lines += [".reg .u32 o, r, w, split, words, first, lead, stop;", ".reg .u64 aligned;", ".reg .pred mine;"]
    lines += [f".reg .b32 {', '.join(registers)};"]
    # A group may read up to PACKING_GROUP - 1 values past its tile's last: zero them (no
    # value lands there, so no barrier is needed). Threads 0-31 for tile 0, 32-63 for tile 1.
    lines += [
        "mov.u32 o, %tid.x;",
        f"setp.lt.u32 p, o, {2 * PACKING_GROUP};",
        "@!p bra bs_tails_done;",
        f"setp.lt.u32 whole, o, {PACKING_GROUP};",
        f"selp.u32 a, ${4 * e}, ${5 * e}, whole;",
        f"and.b32 r, o, {PACKING_GROUP - 1};",
        f"mad.lo.u32 a, r, {size}, a;",
        "add.u32 a, a, s;",
        f"st.shared.{kind} [a], 0;",
        "bs_tails_done:",
    ]
    lines += _scatter_ptx(e, vector, bits, lambda c: [])
    # split: the first tile's stream words, 0 when the group writes nothing.
    lines += ["bar.sync 0;", f"setp.eq.u32 p, ${7 * e}, 0;", f"selp.u32 split, 0, ${6 * e}, p;"]

    # A packed tile's values have their sign bit clear: each fits its ``width`` bits, so a
    # register's ``4 // size`` values, squeezed together, fill its bottom ``chunk_bits``.
    per_register = 4 // size
    chunk_bits = per_register * width
    squeeze = []
    for register in registers if per_register > 1 else []:
        squeeze.append(f"and.b32 w, {register}, {(1 << width) - 1};")
        for i in range(1, per_register):
            squeeze += [f"shr.u32 q, {register}, {i};", f"and.b32 q, q, {((1 << width) - 1) << (width * i)};"]
            squeeze.append("or.b32 w, w, q;")
        squeeze.append(f"mov.b32 {register}, w;")

    for t in range(2):
        # Tile t, in the region at s: its stream words (words) from group word ``first``.
        lines += (
            ["mov.u32 first, 0;", "mov.u32 words, split;"]
            if t == 0
            else [f"add.u32 s, s, {region_bytes};", "mov.u32 first, split;", f"sub.u32 words, ${7 * e}, split;"]
        )
        lines += [
            f"and.b32 q, ${8 * e}, {1 << t};",
            "setp.ne.u32 packed, q, 0;",
            "mov.u32 o, %tid.x;",
            f"@packed bra bs_packed{t};",
            # A raw tile's words are its values as they lie in the buffer.
            f"bs_raw{t}:",
            "setp.ge.u32 p, o, words;",
            f"@p bra bs_tile{t}_done;",
            "shl.b32 a, o, 2;",
            "add.u32 a, a, s;",
            "ld.shared.b32 w, [a];",
            "add.u32 r, o, first;",
            f"mad.wide.u32 g, r, 4, ${9 * e};",
            "st.global.b32 [g], w;",
            f"add.u32 o, o, {threads};",
            f"bra bs_raw{t};",
            # A packed tile's words replace its values in the buffer, group by group (thread
            # o assembles group o: a tile has at most ``threads`` groups), from ``lead``, the
            # tile's stream address modulo 16; then the run is copied out in vectors.
            f"bs_packed{t}:",
            f"mad.wide.u32 g, first, 4, ${9 * e};",
            "cvt.u32.u64 lead, g;",
            "and.b32 lead, lead, 15;",
            "and.b64 aligned, g, -16;",
            "shl.b32 stop, words, 2;",
            "add.u32 stop, stop, lead;",
            f"mul.lo.u32 r, o, {width};",  # the group's first word in the tile
            "setp.lt.u32 mine, r, words;",
            f"mad.lo.u32 a, o, {group_bytes}, s;",
        ]
        for m in range(0, len(registers), 4):
            lines.append(f"@mine ld.shared.v4.b32 {{{', '.join(registers[m:m + 4])}}}, [a+{4 * m}];")
        lines += ["bar.sync 0;", f"@!mine bra bs_assembled{t};"]
        lines += ["shl.b32 a, r, 2;", "add.u32 a, a, lead;", "add.u32 a, a, s;"]  # the group's first word
        lines += squeeze
        # Every word is stored: those past the tile's last are never copied out.
        for word in range(width):
            terms = _group_word_terms(chunk_bits, len(registers), word)
            lines.append(f"shr.u32 w, {registers[terms[0][0]]}, {-terms[0][1]};")  # overlaps the word's start
            for k, shift in terms[1:]:
                lines += [f"shl.b32 q, {registers[k]}, {shift};", "or.b32 w, w, q;"]
            lines.append(f"st.shared.b32 [a+{4 * word}], w;")
        lines += [f"bs_assembled{t}:", "bar.sync 0;"]
        lines += _run_copy_ptx("lead", "stop", "aligned", threads, into_shared=False, label=str(t))
        lines += [f"bs_tile{t}_done:"]
    return "\n".join(lines + ["}"])


@constexpr_function
def _packing_constraints(operands):
    return ",".join(["=r"] * operands + ["r"] * (8 * operands) + ["l"] * operands)


@constexpr_function
def _restore_ptx(elements, vector, threads, buffer_bytes, bits, may_be_packed):
    """The decoder's PTX, run once by every thread of a program for its ``elements`` values.

    Outputs: the values' bits $0. Operands, ``elements`` registers each: the bit mask of the
    value's vector of ``vector`` consecutive values $E, the tile rank of the vector's first
    value $2E, then per program the tile's first byte in the buffer $3E (the stream address
    modulo 16), the end of its run $4E, the 16-byte aligned stream address of buffer byte 0
    $5E and whether the tile is sign-packed $6E.
    """
    e = elements
    size = bits // 8
    packed_bits = bits - 1
    lines = _ptx_prologue(buffer_bytes)
    lines += _run_copy_ptx(f"${3 * e}", f"${4 * e}", f"${5 * e}", threads, into_shared=True)
    lines += ["bar.sync 0;", f"add.u32 s, s, ${3 * e};"]  # s: the tile's first value
    load = {1: "u8", 2: "u16", 4: "b32"}[size]
    raw = _for_each_value(
        e,
        vector,
        e,
        lambda c: [f"mad.lo.u32 a, ${2 * e + c}, {size}, s;"],
        lambda c, j: [f"mov.u32 ${c + j}, 0;", f"@p ld.shared.{load} ${c + j}, [a];", f"@p add.u32 a, a, {size};"],
    )
    if not may_be_packed:
        return "\n".join(lines + raw + ["}"])
    # A packed tile is first unpacked in place: thread o takes group o (``PACKING_GROUP``
    # values in ``packed_bits`` words, a tile has at most ``threads`` groups), and after a
    # barrier writes the group's values as raw ones from the buffer's aligned start, in
    # 16-byte vectors; the raw path then reads them there. A group may run past the tile's
    # words: what it unpacks there lies past the tile's values.
    words = [f"y{i}" for i in range(packed_bits)]
    vector_words = ["v0", "v1", "v2", "v3"]
    lines += [".reg .u32 o, n;", f".reg .b32 {', '.join(words)};"]
    lines += [f"setp.ne.u32 packed, ${6 * e}, 0;", "@!packed bra bs_unpacked;"]
    lines += [
        f"sub.u32 n, ${4 * e}, ${3 * e};",
        "shr.u32 n, n, 2;",  # the tile's words
        "mov.u32 o, %tid.x;",
        f"mul.lo.u32 b, o, {packed_bits};",
        "setp.lt.u32 p, b, n;",
        "shl.b32 a, b, 2;",
        "add.u32 a, a, s;",
    ]
    lines += [f"@p ld.shared.b32 {word}, [a+{4 * i}];" for i, word in enumerate(words)]
    lines += ["bar.sync 0;", "mov.u32 s, bs_buffer;", "@!p bra bs_unpacked_group;"]
    lines.append(f"mad.lo.u32 a, o, {PACKING_GROUP * size}, s;")
    per_word = 4 // size
    for m in range(PACKING_GROUP // per_word):
        target = vector_words[m % 4]
        for k in range(per_word):
            first, shift = divmod(packed_bits * (m * per_word + k), 32)
            value = target if k == 0 else "hi"
            if shift + packed_bits <= 32:
                lines.append(f"shr.u32 {value}, {words[first]}, {shift};")
            else:
                lines.append(f"shf.r.clamp.b32 {value}, {words[first]}, {words[first + 1]}, {shift};")
            lines.append(f"and.b32 {value}, {value}, {(1 << packed_bits) - 1};")
            if k:
                lines += [f"shl.b32 hi, hi, {8 * size * k};", f"or.b32 {target}, {target}, hi;"]
        if m % 4 == 3:
            lines.append(f"st.shared.v4.b32 [a+{4 * (m - 3)}], {{{', '.join(vector_words)}}};")
    lines += ["bs_unpacked_group:", "bar.sync 0;", "bs_unpacked:"]
    return "\n".join(lines + raw + ["}"])


@constexpr_function
def _restore_constraints(elements):
    return ",".join(["=r"] * elements + ["r"] * (4 * elements) + ["l"] * elements + ["r"] * elements)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _value_bits(x, k: gl.constexpr, BITS: gl.constexpr):
    """Value ``k`` of each 32-bit word of ``x``, ``32 // BITS`` values from the lowest bits."""
    if BITS == 32:
        value = x
    else:
        value = (x >> (BITS * k)) & ((1 << BITS) - 1)
    return value


@constexpr_function
def _sign_bits(bits):
    """The sign bits of a 32-bit word of values, as an int32."""
    word = sum(1 << (bits * (k + 1) - 1) for k in range(32 // bits))
    return word - (1 << 32)


@gluon.jit
def _popcount(x):
    return gl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=True, pack=1)


@constexpr_function
def _all_but_value(k, bits):
    """An int32 with every bit set but those of value ``k`` of a word of ``bits``-bit values."""
    word = 0xFFFFFFFF & ~(((1 << bits) - 1) << (bits * k))
    return word - (1 << 32) if word >= 1 << 31 else word


@gluon.jit
def _widen(bits, FLOAT: gl.constexpr, BITS: gl.constexpr):
    """Values of ``FLOAT`` given as their bits (the lowest ``BITS`` of each int32), as float32."""
    if BITS == 32:
        wide = bits.to(gl.float32, bitcast=True)
    elif FLOAT == gl.bfloat16:
        wide = (bits << 16).to(gl.float32, bitcast=True)
    else:
        wide = bits.to(gl.int16).to(FLOAT, bitcast=True).to(gl.float32)
    return wide


@gluon.jit
def _relu(x, FLOAT: gl.constexpr, BITS: gl.constexpr):
    """For 32-bit words ``x`` of ``32 // BITS`` values of ``FLOAT`` each, the words of their
    ReLU: ``+0.0`` below zero, the bits of every other value kept."""
    for k in gl.static_range(32 // BITS):
        below = _widen(_value_bits(x, k, BITS), FLOAT, BITS) < 0
        x = gl.where(below, x & _all_but_value(k, BITS), x)
    return x


@gluon.jit(do_not_specialize=_ENCODE_UNSPECIALIZED, do_not_specialize_on_alignment=_ENCODE_UNSPECIALIZED)
def encode_kernel(
    x_ptr,
    stream_ptr,
    fixed_ptr,
    cursor_ptr,
    appends_ptr,
    base_ptr,
    report_ptr,
    nonzeros_ptr,
    square_ptr,
    numel,
    capacity,
    num_tiles,
    num_programs,
    TILE: gl.constexpr,
    BITS: gl.constexpr,
    GROUP: gl.constexpr,
    SIGN_PACK: gl.constexpr,
    COUNT_NONZEROS: gl.constexpr,
    REPORT: gl.constexpr,
    RELU_SQUARE: gl.constexpr,
):
    """Encode tiles ``GROUP * pid ...``; the protocol of ``triton_codec._encode_kernel``
    (claims relative to the cursor, the last program to finish advances it). With
    ``SIGN_PACK`` (``GROUP`` 2), a tile whose nonzeros all have a clear sign bit is packed.
    With ``RELU_SQUARE``, ``x`` is the input of a ReLU, whose output is encoded and whose
    square is written to ``square_ptr`` (``numel`` must then be a multiple of ``32 // BITS``:
    the square is stored in whole words)."""
    WARPS: gl.constexpr = gl.num_warps()
    WORDS: gl.constexpr = TILE // 32
    ROWS: gl.constexpr = GROUP * WORDS  # mask words of the group
    VECTOR: gl.constexpr = 128 // BITS  # values per 16-byte load
    CHUNKS: gl.constexpr = 32 // VECTOR  # vectors per mask word
    SIZE: gl.constexpr = BITS // 8
    PER_WORD: gl.constexpr = 32 // BITS
    OPERANDS: gl.constexpr = GROUP * TILE // (32 * WARPS * PER_WORD)  # value words per thread
    REGION: gl.constexpr = _packing_region_bytes(TILE, SIZE)
    gl.static_assert(not SIGN_PACK or GROUP == 2, "the packing PTX assembles words of two tiles")
    # [mask word, vector in the word, 32-bit word of the vector]: a thread holds whole
    # vectors, as 32-bit words (one register per word, not per value).
    layout: gl.constexpr = gl.BlockedLayout([1, 1, 4], [32 // CHUNKS, CHUNKS, 1], [WARPS, 1, 1], [2, 1, 0])
    word_layout: gl.constexpr = gl.SliceLayout(2, layout)
    row_layout: gl.constexpr = gl.SliceLayout(1, word_layout)
    # [tile of the group, mask word]: a tile's words across the threads, for the scans.
    tiles_layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, WARPS], [1, 0])

    pid = gl.program_id(0)
    first_tile = pid * GROUP
    row = gl.arange(0, ROWS, layout=row_layout)[:, None]
    chunk_index = gl.arange(0, CHUNKS, layout=gl.SliceLayout(0, word_layout))[None, :]
    lane = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))[None, None, :]
    word_index = first_tile * (TILE // PER_WORD) + (row * (32 // PER_WORD) + chunk_index * 4)[:, :, None] + lane
    index = word_index * PER_WORD  # of the word's first value
    words_ptr = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True)  # the caller checks 16-byte alignment
    whole = first_tile * TILE <= numel - GROUP * TILE  # the group is whole (in int32: numel < 2**31)
    if whole:
        x = gl.load(words_ptr + word_index)
    else:
        x = gl.load(words_ptr + word_index, mask=index < numel, other=0)
        if PER_WORD > 1:
            # The last word may hold values past the tensor's end (never past its 4-byte
            # aligned span): their bits are cleared.
            valid = gl.maximum(gl.minimum(numel - index, PER_WORD), 0)
            x = x & gl.where(valid == PER_WORD, -1, (1 << (BITS * valid)) - 1)
    zero = gl.zeros_like(x)
    if RELU_SQUARE:
        x = _relu(x, x_ptr.dtype.element_ty, BITS)
        square_bytes = gl.minimum(gl.maximum(numel - first_tile * TILE, 0), GROUP * TILE) * SIZE
        group_square = (square_ptr + first_tile * TILE).to(gl.int64, bitcast=True)
        gl.inline_asm_elementwise(
            _square_ptx(OPERANDS, x_ptr.dtype.element_ty, WARPS * 32),
            _square_constraints(OPERANDS),
            [x, zero + square_bytes, zero.to(gl.int64) + group_square],
            dtype=gl.int32,
            is_pure=False,
            pack=OPERANDS,
        )
    bits = gl.zeros_like(x)  # bit i: value i of the vector is nonzero
    for k in gl.static_range(PER_WORD):
        bits |= gl.where(_value_bits(x, k, BITS) != 0, 1 << (lane * PER_WORD + k), 0)
    chunk = gl.sum(bits, axis=2)
    word = gl.sum(chunk << (chunk_index * VECTOR), axis=1)

    tile = gl.arange(0, GROUP, layout=gl.SliceLayout(1, tiles_layout))
    word_index = gl.arange(0, WORDS, layout=gl.SliceLayout(0, tiles_layout))[None, :]
    words = gl.convert_layout(gl.reshape(word, [GROUP, WORDS]), tiles_layout)
    real = (first_tile + tile < num_tiles)[:, None]
    gl.store(fixed_ptr + (first_tile + tile[:, None]) * WORDS + word_index, words, mask=real)
    counts = _popcount(words)
    ranks = gl.associative_scan(counts, 1, _add) - counts  # of each word's first value, in its tile
    tile_counts = gl.sum(counts, axis=1)
    if SIGN_PACK:
        # A tile packs when no value has its sign bit set: the sign of the OR of its values.
        signs = gl.reduce_or(gl.reduce_or(x, axis=2), axis=1)
        tile_signs = gl.reduce_or(gl.convert_layout(gl.reshape(signs, [GROUP, WORDS]), tiles_layout), axis=1)
        packed = (tile_signs & _sign_bits(BITS)) == 0
        tile_lengths = (tile_counts * gl.where(packed, BITS - 1, BITS) + 31) // 32
    else:
        packed = tile < 0
        tile_lengths = (tile_counts * BITS + 31) // 32
    if COUNT_NONZEROS:
        gl.atomic_add(nonzeros_ptr, gl.sum(tile_counts, axis=0).to(gl.int64), sem="relaxed")
    # Each tile's values start on a word: its first word within the group's run.
    tile_firsts = gl.zeros_like(tile_lengths)
    total = 0
    for t in gl.static_range(GROUP):
        tile_firsts = gl.where(tile == t, total, tile_firsts)
        total += gl.sum(gl.where(tile == t, tile_lengths, 0), axis=0)

    # The cursor moves only when every program has finished (below), so all read the same.
    base = gl.load(cursor_ptr)
    if pid == 0:
        gl.store(base_ptr, base)
    offset = gl.atomic_add(appends_ptr, total.to(gl.int64), sem="relaxed")
    start = base + offset
    gl.store(
        fixed_ptr + num_tiles * WORDS + first_tile + tile[:, None] + 0 * word_index,
        (offset + tile_firsts[:, None] + 0 * word_index).to(gl.int32) | (packed.to(gl.int32) << 31)[:, None],
        mask=real & (word_index == 0),
    )
    fits = start + total <= capacity
    below = _popcount(word[:, None] & ((1 << (chunk_index * VECTOR)) - 1))
    if SIGN_PACK:
        # Each tile's values compacted in its own region, then every stream word assembled.
        region_bytes = gl.reshape(tile[:, None] * REGION + ranks * SIZE, [ROWS])
        chunk_bytes = gl.convert_layout(region_bytes, row_layout)[:, None] + below * SIZE
        tails = tile * REGION + tile_counts * SIZE  # the first byte past each tile's values
        split = gl.sum(gl.where(tile == 0, tile_lengths, 0), axis=0)
        flags = gl.sum(packed.to(gl.int32) << tile, axis=0)
        gl.inline_asm_elementwise(
            _packing_ptx(OPERANDS, VECTOR, WARPS * 32, REGION, BITS),
            _packing_constraints(OPERANDS),
            [
                x,
                zero + chunk[:, :, None],
                zero + chunk_bytes[:, :, None],
                zero + gl.sum(gl.where(tile == 0, tails, 0), axis=0),
                zero + gl.sum(gl.where(tile == 1, tails, 0), axis=0),
                zero + split,
                zero + gl.where(fits, total, 0),
                zero + flags,
                zero.to(gl.int64) + (stream_ptr + start).to(gl.int64, bitcast=True),
            ],
            dtype=gl.int32,
            is_pure=False,
            pack=OPERANDS,
        )
    else:
        # The group's run compacted in the buffer, then copied in 16-byte vectors: it starts
        # at the stream address modulo 16, so aligned buffer vectors are aligned in the stream.
        lead = (start % 4).to(gl.int32) * 4
        word_bytes = gl.reshape(lead + tile_firsts[:, None] * 4 + ranks * SIZE, [ROWS])
        last_words = gl.where(tile_lengths > 0, lead + (tile_firsts + tile_lengths - 1) * 4, GROUP * TILE * SIZE + 16)
        last_bytes = gl.reshape(last_words[:, None] + 0 * word_index, [ROWS])
        chunk_bytes = gl.convert_layout(word_bytes, row_layout)[:, None] + below * SIZE
        last = gl.convert_layout(last_bytes, row_layout)[:, None] + 0 * chunk_index
        gl.inline_asm_elementwise(
            _compaction_ptx(OPERANDS, VECTOR, WARPS * 32, GROUP * TILE * SIZE, BITS),
            _compaction_constraints(OPERANDS),
            [
                x,
                zero + chunk[:, :, None],
                zero + chunk_bytes[:, :, None],
                zero + last[:, :, None],
                zero + lead,
                zero + gl.where(fits, lead + total * 4, 0),
                zero.to(gl.int64) + (stream_ptr + (start - start % 4)).to(gl.int64, bitcast=True),
            ],
            dtype=gl.int32,
            is_pure=False,
            pack=OPERANDS,
        )

    finish_append(appends_ptr, cursor_ptr, report_ptr, base, num_programs, REPORT)


@gluon.jit(do_not_specialize=_DECODE_UNSPECIALIZED, do_not_specialize_on_alignment=_DECODE_UNSPECIALIZED)
def decode_kernel(
    out_ptr,
    square_ptr,
    square_grad_ptr,
    stream_ptr,
    fixed_ptr,
    base_ptr,
    numel,
    num_tiles,
    TILE: gl.constexpr,
    BITS: gl.constexpr,
    MAY_BE_PACKED: gl.constexpr,
    SQUARE: gl.constexpr,
    SQUARE_GRAD: gl.constexpr,
):
    """Restore tile ``pid`` (and its square when ``SQUARE``, and in its place the gradient of
    a ReLU's input when ``SQUARE_GRAD``); the arguments of ``triton_codec._decode_kernel``."""
    WARPS: gl.constexpr = gl.num_warps()
    WORDS: gl.constexpr = TILE // 32
    VECTOR: gl.constexpr = 128 // BITS
    CHUNKS: gl.constexpr = 32 // VECTOR
    ELEMENTS: gl.constexpr = TILE // (32 * WARPS)
    layout: gl.constexpr = gl.BlockedLayout([1, 1, VECTOR], [32 // CHUNKS, CHUNKS, 1], [WARPS, 1, 1], [2, 1, 0])
    word_layout: gl.constexpr = gl.SliceLayout(2, layout)
    row_layout: gl.constexpr = gl.SliceLayout(1, word_layout)
    flat: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])

    tile = gl.program_id(0)
    # Every load of the fixed part first, the mask words once (the scan takes them through
    # shared memory): issued after the scan's first barrier, the tile word would hold back
    # the stream's load by a round trip to memory.
    base = gl.load(base_ptr)
    tile_word = gl.load(fixed_ptr + num_tiles * WORDS + tile)
    start = base + (tile_word & 0x7FFFFFFF)
    row = gl.arange(0, WORDS, layout=row_layout)
    words = gl.load(fixed_ptr + tile * WORDS + row)
    _prefetch_fixed(fixed_ptr, tile + PREFETCH_TILES, num_tiles, WORDS, flat)
    counts = _popcount(gl.convert_layout(words, flat))
    ranks = gl.convert_layout(gl.associative_scan(counts, 0, _add) - counts, row_layout)
    count = gl.sum(counts, axis=0)
    row = row[:, None]
    word = words[:, None]
    chunk_index = gl.arange(0, CHUNKS, layout=gl.SliceLayout(0, word_layout))[None, :]
    chunk = (word >> (chunk_index * VECTOR)) & ((1 << VECTOR) - 1)
    chunk_ranks = ranks[:, None] + _popcount(word & ((1 << (chunk_index * VECTOR)) - 1))
    packed = tile_word < 0
    length = (count * gl.where(packed, BITS - 1, BITS) + 31) // 32
    lead = (start % 4).to(gl.int32) * 4
    lane_value = gl.arange(0, VECTOR, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))[None, None, :]
    index = tile * TILE + (row * 32 + chunk_index * VECTOR)[:, :, None] + lane_value
    zero = gl.zeros_like(index)
    bits = gl.inline_asm_elementwise(
        _restore_ptx(ELEMENTS, VECTOR, WARPS * 32, TILE * (BITS // 8), BITS, MAY_BE_PACKED),
        _restore_constraints(ELEMENTS),
        [
            zero + chunk[:, :, None],
            zero + chunk_ranks[:, :, None],
            zero + lead,
            zero + lead + length * 4,
            zero.to(gl.int64) + (stream_ptr + (start - start % 4)).to(gl.int64, bitcast=True),
            zero + packed.to(gl.int32),
        ],
        dtype=gl.int32,
        is_pure=True,
        pack=ELEMENTS,
    )
    value = bits.to(_int_type(BITS)).to(out_ptr.dtype.element_ty, bitcast=True)
    if tile * TILE <= numel - TILE:  # the tile is whole (in int32: numel < 2**31)
        _store_tile(out_ptr, square_ptr, square_grad_ptr, index, value, None, SQUARE, SQUARE_GRAD)
    else:
        _store_tile(out_ptr, square_ptr, square_grad_ptr, index, value, index < numel, SQUARE, SQUARE_GRAD)


@gluon.jit
def _prefetch_fixed(fixed_ptr, tile, num_tiles, WORDS: gl.constexpr, layout: gl.constexpr):
    """Bring the fixed part of a later ``tile`` into L2, so that its program's first wait is for
    L2, not memory: thread t < MASK_LINES takes line t of its masks, the next thread the line
    of its tile word."""
    MASK_LINES: gl.constexpr = WORDS * 4 // 128
    thread = gl.arange(0, gl.num_warps() * 32, layout=layout)
    masks = fixed_ptr + tile * WORDS + thread * 32
    address = gl.where(thread < MASK_LINES, masks, fixed_ptr + num_tiles * WORDS + tile)
    gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r",
        [address.to(gl.int64, bitcast=True), ((thread <= MASK_LINES) & (tile < num_tiles)).to(gl.int32)],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _store_tile(
    out_ptr, square_ptr, square_grad_ptr, index, value, mask, SQUARE: gl.constexpr, SQUARE_GRAD: gl.constexpr
):
    if SQUARE_GRAD:  # as compiled code computes them (the codecs' relu_square_backward)
        wide = value.to(gl.float32)
        gl.store(square_ptr + index, (wide * wide).to(out_ptr.dtype.element_ty), mask=mask)
        square_grad = gl.load(square_grad_ptr + index, mask=mask).to(gl.float32)
        value = gl.where(wide <= 0.0, 0.0, square_grad * (wide * 2.0)).to(out_ptr.dtype.element_ty)
        gl.store(out_ptr + index, value, mask=mask)
    else:
        gl.store(out_ptr + index, value, mask=mask)
        if SQUARE:  # as PyTorch squares: in float32, rounded to nearest even
            wide = value.to(gl.float32)
            gl.store(square_ptr + index, (wide * wide).to(out_ptr.dtype.element_ty), mask=mask)
