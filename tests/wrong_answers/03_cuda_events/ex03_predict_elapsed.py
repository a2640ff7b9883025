    # Wrong: counts only the kernel right before `end`.
    return b2_ms
