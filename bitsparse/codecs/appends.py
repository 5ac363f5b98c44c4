"""The end of an append to a value stream, shared by the Triton encoders.

An encoder launch appends one tensor's values: each program reads the cursor (it does not
move during the launch), claims its words with a relaxed atomic add on ``appends[0]``
relative to it, and counts itself finished on ``appends[1]``. The last program to finish
moves the cursor past everything claimed, clears both counters for the next append and,
when asked, reports the new cursor plus one. The append is one launch, with nothing else
on the stream.
"""

import triton
import triton.language as tl


@triton.jit
def finish_append(appends_ptr, cursor_ptr, report_ptr, base, num_programs, REPORT: tl.constexpr):
    """Count this program finished; the last one moves the cursor from ``base`` past the
    append and writes the report."""
    # Release/acquire order every program's claim and its read of the cursor before this.
    if tl.atomic_add(appends_ptr + 1, 1, sem="acq_rel") == num_programs - 1:
        end = base + tl.atomic_xchg(appends_ptr, 0, sem="acquire")
        tl.atomic_xchg(appends_ptr + 1, 0, sem="relaxed")
        tl.store(cursor_ptr, end)
        if REPORT:
            tl.store(report_ptr, end + 1)
