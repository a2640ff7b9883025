    # Wrong: adds up b's kernels between the markers, as if b never waited for a.
    return b1_ms + b2_ms
